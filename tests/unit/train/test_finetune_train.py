"""Fine-tuning through ssmkit.train: `base:`, `lora:`, `freeze_embedding`, `precision: bf16-pure`,
SFT data.

Oracles: an uninterrupted run for resuming (bitwise on CPU), the base checkpoint for what must not
move, the model called by hand on the loader's batch for what the Trainer computes, and
ssmkit.finetune's adapter loader for what a checkpoint's adapter/ holds.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import ROOT, losses, perturb_

import ssmkit
from ssmkit.data import vocab_size
from ssmkit.data.sft import SFTLoader, prepare_sft
from ssmkit.finetune import load_adapter
from ssmkit.train import TrainConfig, Trainer
from ssmkit.train.checkpoint import saved_shapes
from ssmkit.train.resolve import resolve

pytest.importorskip("peft")

VOCAB = vocab_size("byte")
LORA = dict(r=4, alpha=8, dropout=0.05, target_modules=["in_proj", "x_proj", "dt_proj", "out_proj"])


@pytest.fixture(scope="module")
def sft_dirs(tmp_path_factory):
    """sft-arith with the byte tokenizer: 400 training samples and the held-out split's first 40."""
    base = tmp_path_factory.mktemp("sft")
    train = prepare_sft("sft-arith", base / "train", tokenizer="byte", max_samples=400)
    val = prepare_sft("sft-arith", base / "val", tokenizer="byte", split="val", max_samples=40)
    return train, val


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A "pretrained" base in transformers' format (a Mamba-1 of 2 layers, d_model 32, byte
    vocabulary; its weights moved off the init, so its state carries across tokens as a trained
    model's does)."""
    torch.manual_seed(0)
    model = ssmkit.build_model(
        ssmkit.ModelConfig(d_model=32, n_layer=2, vocab_size=VOCAB, d_state=8)
    )
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.A_log.sub_(2.0)  # slow decay: a long memory
    return perturb_(model, 0).save_pretrained(tmp_path_factory.mktemp("base") / "model")


def run_config(tmp_path, base_dir, sft_dirs, name="run", **kw) -> TrainConfig:
    train, val = sft_dirs
    base = dict(
        base=str(base_dir),
        lora=dict(LORA),
        data=str(train),
        val_data=str(val),
        tokenizer="byte",
        seq_len=96,
        micro_batch=4,
        batch_tokens=384,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=1,
        max_steps=4,
        log_every=1,
        eval_every=0,
        eval_batches=2,
        progress=False,
        out_dir=str(tmp_path / name),
    )
    return TrainConfig(**{**base, **kw})


def adapter_tensors(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


# --- the config -----------------------------------------------------------------------------------


def test_the_config_checks_base_lora_and_precision(tmp_path, base_dir, sft_dirs):
    cfg = run_config(tmp_path, base_dir, sft_dirs)
    again = TrainConfig.from_yaml(
        _write(tmp_path / "c.yaml", cfg.to_yaml()), overrides=["lora.r=8"]
    )
    assert again.lora == {**LORA, "r": 8} and again.base == str(base_dir)
    assert (
        TrainConfig.from_dict(cfg.to_dict(), overrides=["lora=none"]).lora is None
    )  # full fine-tuning
    assert run_config(tmp_path, base_dir, sft_dirs, precision="bf16-pure").precision == "bf16-pure"
    bad = [
        (dict(model="mamba-130m"), "leave model and model_overrides unset"),
        (dict(model_overrides={"d_model": 64}), "leave model and model_overrides unset"),
        (dict(base=None), "lora needs base"),
        (dict(lora={"rank": 4}), "unknown lora keys \\['rank'\\]; valid keys: r, alpha"),
        (dict(lora={"dropout": 1.5}), "lora.dropout must be a number in \\[0, 1\\)"),
        (dict(lora={"target_modules": "in_proj"}), "lora.target_modules must be a list"),
        (dict(strategy="fsdp"), "lora with strategy fsdp is not supported"),
        (dict(precision="bf16-master"), "precision"),
    ]
    for change, words in bad:
        with pytest.raises(ValueError, match=words):
            run_config(tmp_path, base_dir, sft_dirs, **change)
    with pytest.raises(ValueError, match="only model_overrides and lora take sub-keys"):
        TrainConfig.from_dict(cfg.to_dict(), overrides=["seq_len.x=1"])


def test_dora_is_reachable_from_the_run_config_and_the_command_line_grammar(
    tmp_path, base_dir, sft_dirs
):
    from ssmkit.finetune import trainable_share
    from ssmkit.train.model_setup import build_run_model

    cfg = run_config(tmp_path, base_dir, sft_dirs)
    dora = TrainConfig.from_dict(cfg.to_dict(), overrides=["lora.use_dora=true"])
    assert dora.lora == {**LORA, "use_dora": True}
    model, _ = build_run_model(dora, VOCAB)
    rows = 2 * 64 + (2 + 2 * 8) + 64 + 32  # in_proj, x_proj, dt_proj, out_proj: one per output
    assert trainable_share(model)["by_kind"]["lora_magnitude_vector"] == 2 * rows  # 2 layers
    with pytest.raises(ValueError, match="lora.use_dora must be true or false; got 'maybe'"):
        run_config(tmp_path, base_dir, sft_dirs, lora={**LORA, "use_dora": "maybe"})


def _write(path, text):
    path.write_text(text)
    return path


def test_the_cpu_tiny_lora_config_is_valid():

    cfg = TrainConfig.from_yaml(ROOT / "configs" / "cpu-tiny-lora.yaml")
    assert cfg.base and cfg.lora is not None and cfg.data.startswith("sft")


# --- LoRA: what trains, what is saved, resuming ---------------------------------------------------


def test_a_lora_run_trains_the_adapter_only_and_checkpoints_only_it(tmp_path, base_dir, sft_dirs):
    cfg = run_config(tmp_path, base_dir, sft_dirs, ckpt_every=2)
    trainer = Trainer(config=cfg)
    history = trainer.fit()
    assert len(losses(history)) == 4 and all(map(torch.isfinite, torch.tensor(losses(history))))
    evals = [r for r in history if r["kind"] == "eval"]
    assert len(evals) == 1 and evals[0]["val_loss"] > 0  # the held-out completion loss
    base = ssmkit.from_pretrained(base_dir)
    inner = trainer.model.get_base_model()
    for name, p in base.named_parameters():  # the base did not move
        mine = inner.get_parameter(
            name.replace("weight", "base_layer.weight")
            if any(name.endswith(f"{t}.weight") for t in LORA["target_modules"])
            else name
        )
        assert torch.equal(mine, p), name
    ckpt = trainer.ckpt_dir / "step_00000004"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "adapter",
        "manifest.json",
        "rng",
        "state",
        "trainer.json",
    ]
    assert all(".lora_" in k for k in saved_shapes(ckpt)), sorted(saved_shapes(ckpt))[:3]
    assert len(saved_shapes(ckpt)) == 2 * 2 * len(
        LORA["target_modules"]
    )  # A and B, 2 layers, 4 targets
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    reloaded = load_adapter(ssmkit.from_pretrained(base_dir), ckpt / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(x).logits, trainer.model.eval()(x).logits, rtol=0, atol=0
        )
    where = resolve(trainer.out_dir)
    assert (where.kind, where.step_dir, where.adapter_dir) == ("lora", ckpt, ckpt / "adapter")
    with pytest.raises(ValueError, match="holds a LoRA adapter \\(adapter/\\).*load_adapter"):
        where.model_source()


def test_a_lora_run_resumes_exactly(tmp_path, base_dir, sft_dirs):
    whole = Trainer(config=run_config(tmp_path, base_dir, sft_dirs, name="whole", ckpt_every=2))
    uninterrupted = losses(whole.fit())
    cfg = run_config(tmp_path, base_dir, sft_dirs, name="parts", ckpt_every=2)
    first = losses(Trainer(config=cfg).fit(until=2))
    resumed = Trainer(config=cfg)
    assert resumed.resume()
    assert resumed.step == 2
    second = losses(resumed.fit())
    assert first + second == uninterrupted  # bitwise, dropout included
    mine, want = adapter_tensors(resumed), adapter_tensors(whole)
    assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want)
    # the adapter belongs to its base: another base is refused
    torch.manual_seed(1)
    other = ssmkit.build_model(
        ssmkit.ModelConfig(d_model=32, n_layer=2, vocab_size=VOCAB, d_state=8)
    )
    other_dir = other.save_pretrained(tmp_path / "other-base")
    with pytest.raises(ValueError, match="trained on another base model"):
        Trainer(config=dataclasses.replace(cfg, base=str(other_dir), max_steps=6)).resume()


# --- full fine-tuning, frozen embedding, bf16 weights ---------------------------------------------


def test_full_fine_tuning_from_a_run_checkpoint_with_a_frozen_embedding(
    tmp_path, base_dir, sft_dirs
):
    cfg = run_config(tmp_path, base_dir, sft_dirs, lora=None, freeze_embedding=True, max_steps=2)
    first = Trainer(config=cfg)
    first.fit()
    # a run's out_dir is a base too (its latest checkpoint's model/)
    again = Trainer(
        config=run_config(
            tmp_path,
            first.out_dir,
            sft_dirs,
            name="again",
            lora=None,
            freeze_embedding=True,
            max_steps=1,
        )
    )
    assert torch.equal(
        again.model.backbone.layers[0].mixer.in_proj.weight,
        first.model.backbone.layers[0].mixer.in_proj.weight,
    )
    base = ssmkit.from_pretrained(base_dir)
    tuned = ssmkit.from_pretrained(first.ckpt_dir / "step_00000002" / "model")  # a full checkpoint
    # the embedding (and the head tied to it) stayed; the rest moved
    assert torch.equal(tuned.backbone.embedding.weight, base.backbone.embedding.weight)
    in_proj = (m.backbone.layers[0].mixer.in_proj.weight for m in (tuned, base))
    assert not torch.equal(*in_proj)
    assert all(
        p is not first.model.backbone.embedding.weight
        for g in first.optimizer.param_groups
        for p in g["params"]
    )


def test_bf16_pure_trains_bf16_weights_without_a_master_copy(tmp_path, base_dir, sft_dirs):
    for precision, dtype in (("bf16-pure", torch.bfloat16), ("bf16", torch.float32)):
        cfg = run_config(
            tmp_path,
            base_dir,
            sft_dirs,
            name=precision,
            lora=None,
            precision=precision,
            max_steps=2,
        )
        trainer = Trainer(config=cfg)
        history = trainer.fit()
        assert {p.dtype for p in trainer.model.parameters()} == {dtype}
        states = [
            v for st in trainer.optimizer.state.values() for k, v in st.items() if k == "exp_avg"
        ]
        assert states and {v.dtype for v in states} == {dtype}
        assert all(torch.isfinite(torch.tensor(losses(history))))


# --- SFT data: seq_idx reaches the model; sources are prepared ------------------------------------


def test_the_trainer_passes_seq_idx_and_scores_the_labelled_tokens(tmp_path, base_dir, sft_dirs):
    cfg = run_config(tmp_path, base_dir, sft_dirs, lora=None, max_steps=1, val_data=None)
    trainer = Trainer(config=cfg)
    model = ssmkit.from_pretrained(base_dir)  # the same weights, before the step
    x, y, seq_idx = next(iter(SFTLoader(sft_dirs[0], cfg.seq_len, cfg.micro_batch, seed=cfg.seed)))
    assert int(seq_idx.max()) >= 1  # rows hold several packed samples
    with torch.no_grad():
        want = model(x, labels=y, shift_labels=False, seq_idx=seq_idx).loss.item()
        unpacked = model(x, labels=y, shift_labels=False).loss.item()
    assert abs(want - unpacked) > 1e-4  # the state reset matters (~9e-4 here), above 1e-6
    assert losses(trainer.fit()) == [pytest.approx(want, abs=1e-6)]


def test_sft_sources_are_prepared_with_their_held_out_split(tmp_path, base_dir, monkeypatch):
    monkeypatch.setenv("SSMKIT_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": f"{a} + {a} = ", "completion": str(2 * a)} for a in range(60)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:48]))
    (tmp_path / "d.val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[48:]))
    cfg = run_config(
        tmp_path,
        base_dir,
        (None, None),
        data=f"sft:{tmp_path / 'd.jsonl'}",
        val_data=None,
        seq_len=48,
        batch_tokens=192,
        max_steps=1,
    )
    trainer = Trainer(config=cfg)
    assert trainer.sft and trainer.val_loader.index["options"]["split"] == "val"
    assert trainer.val_loader.index["samples"] == 12 and trainer.loader.data.index["samples"] == 48
    assert [r["kind"] for r in trainer.fit()] == ["train", "eval"]
    (tmp_path / "d.val.jsonl").unlink()  # no sibling: no validation
    alone = Trainer(config=dataclasses.replace(cfg, out_dir=str(tmp_path / "alone")))
    assert alone.val_loader is None
    offline = Trainer(
        config=dataclasses.replace(
            cfg, data="sft-arith", out_dir=str(tmp_path / "arith"), seq_len=96, batch_tokens=384
        )
    )
    assert offline.val_loader.index["options"]["split"] == "val"
    assert offline.val_loader.index["options"]["source"] == "sft-arith"
    with pytest.raises(ValueError, match="the file .* does not exist"):
        Trainer(config=dataclasses.replace(cfg, data="sft:nowhere.jsonl"))
    # a prepared training directory with a .jsonl of its own for validation
    given = Trainer(
        config=dataclasses.replace(
            cfg,
            data=str(trainer.loader.dir),
            out_dir=str(tmp_path / "g"),
            val_data=f"sft:{tmp_path / 'd.jsonl'}",
        )
    )
    assert given.val_loader.index["samples"] == 48
    with pytest.raises(
        ValueError, match="is neither a prepared SFT directory nor 'sft:PATH.jsonl'"
    ):
        Trainer(
            config=dataclasses.replace(
                cfg,
                data=str(trainer.loader.dir),
                out_dir=str(tmp_path / "h"),
                val_data=str(tmp_path),
            )
        )


def test_the_cli_trains_and_resumes_a_lora_run(tmp_path, base_dir, sft_dirs, capsys):
    from ssmkit.train import cli

    cfg = run_config(tmp_path, base_dir, sft_dirs, max_steps=2)
    config = _write(tmp_path / "lora.yaml", cfg.to_yaml())
    cli.main(["--config", str(config), "--set", "max_steps=1"])
    cli.main(["--config", str(config), "--resume", "--set", "lora.r=4"])
    out = capsys.readouterr().out
    assert "resumed from" in out and "done: 2 steps" in out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", str(config), "--set", "model=tiny-mamba2"])
    assert exit_.value.code == 2
    assert "leave model and model_overrides unset" in capsys.readouterr().err


def test_generate_convert_and_eval_take_a_lora_run_as_its_merged_model(
    tmp_path, base_dir, sft_dirs, capsys
):
    """A LoRA run's out_dir is what a batch user points the other commands at: its base with the
    adapter merged (the oracle: the Trainer's own peft model), exported whole, refused on a changed
    base."""
    import shutil

    from ssmkit.cli import main
    from ssmkit.train.load import load_model

    base = shutil.copytree(base_dir, tmp_path / "base")  # this test changes it at the end
    trainer = Trainer(
        config=run_config(tmp_path, base, sft_dirs, max_steps=2, lora={**LORA, "dropout": 0.0})
    )
    trainer.fit()
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        trained = trainer.model.eval()(ids).logits
        merged, where = load_model(str(tmp_path / "run"))
        torch.testing.assert_close(merged(ids).logits, trained, rtol=0, atol=1e-5)
    assert not hasattr(merged, "peft_config") and where.tokenizer_dir == where.step_dir / "adapter"
    main(
        [
            "generate",
            str(tmp_path / "run"),
            "--prompt",
            "What is 2 + 2?",
            "--max-new-tokens",
            "4",
            "--tokenizer",
            "byte",
        ]
    )
    assert capsys.readouterr().out.startswith("What is 2 + 2?")
    main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"])
    assert "hf layout" in capsys.readouterr().out
    with torch.no_grad():
        torch.testing.assert_close(
            ssmkit.from_pretrained(tmp_path / "hf")(ids).logits, trained, rtol=0, atol=1e-5
        )
    changed = ssmkit.from_pretrained(base)
    with torch.no_grad():
        changed.lm_head.weight.add_(0.01)
    changed.save_pretrained(base, overwrite=True)
    with pytest.raises(ValueError, match="has changed since the run"):
        load_model(str(tmp_path / "run"))


def _edit_trainer_json(step, manifest: bool = True, **changes):
    """trainer.json of ``step`` changed (a value None: the key removed); ``manifest``: its manifest
    entry recomputed, as a user editing by hand would."""
    from ssmkit.train.manifest import write_manifest

    path = step / "trainer.json"
    state = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    path.write_text(json.dumps(state))
    if manifest:
        write_manifest(step)


def test_a_lora_run_records_its_base_absolute_and_loads_from_anywhere(
    tmp_path, base_dir, sft_dirs, monkeypatch
):
    """Fault injected: the run trained with a relative base, loaded from another directory (before:
    "'base' is neither a checkpoint directory nor a hub id"); then trainer.json edited."""
    import shutil

    from ssmkit.train.load import load_model
    from ssmkit.train.manifest import CheckpointCorrupt

    shutil.copytree(base_dir, tmp_path / "work" / "base")
    monkeypatch.chdir(tmp_path / "work")
    Trainer(config=run_config(tmp_path, "base", sft_dirs, max_steps=1)).fit()
    step = resolve(tmp_path / "run").step_dir
    state = json.loads((step / "trainer.json").read_text())
    assert state["config"]["base"] == "base"
    assert state["base_path"] == str((tmp_path / "work" / "base").resolve())
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "base").mkdir(parents=True)  # a different "base" here must not be taken
    monkeypatch.chdir(elsewhere)
    load_model(tmp_path / "run")  # the recorded absolute base
    # trainer.json changed without its manifest: refused like adapter/ (before: not verified)
    _edit_trainer_json(step, manifest=False, base_fingerprint=None)
    with pytest.raises(CheckpointCorrupt, match="is corrupt: trainer.json has"):
        load_model(tmp_path / "run")
    # ... and with it: no fingerprint, no load (before: merged onto whatever base was named)
    _edit_trainer_json(step)
    with pytest.raises(ValueError, match="trainer.json records no base_fingerprint, so the base"):
        load_model(tmp_path / "run")
    # a run from before base_path: its relative base, read from here, says so
    _edit_trainer_json(step, base_fingerprint=state["base_fingerprint"], base_path=None)
    shutil.rmtree(elsewhere / "base")
    with pytest.raises(ValueError, match=r"'base', is read relative to the directory the run"):
        load_model(tmp_path / "run")
    monkeypatch.chdir(tmp_path / "work")
    load_model(tmp_path / "run")  # from where it was trained: still loads
    # the recorded absolute base moved away
    _edit_trainer_json(step, base_path=str(tmp_path / "gone"))
    with pytest.raises(ValueError, match=r"the base recorded in .*trainer.json, .*gone \(given as"):
        load_model(tmp_path / "run")
