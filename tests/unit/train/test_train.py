"""The training engine: config, schedule, parameter groups, accumulation, exact resume, NaN guard,
CLI.

Runs are tiny (byte tokenizer, d_model 32, seq_len 32) so the whole file takes seconds; the
loss-falls test uses the real cpu-tiny recipe (GPT-2 tokenizer, embedded corpus) cut short.
"""

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import (
    ROOT,
    losses,
    small,
)  # tests/helpers.py; the `shards` fixture is in tests/conftest.py

import ssmkit
from ssmkit.eval import flops_per_token
from ssmkit.train import TrainConfig, Trainer, TrainingError, lr_at, split_parameters


# --- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = TrainConfig.from_yaml(path)
    ssmkit.ModelConfig.preset(cfg.model, **cfg.model_overrides)  # the model part is valid too
    assert cfg.total_steps() > 0


def test_plan_presets_carry_the_plan_numbers():
    c = TrainConfig.from_yaml(ROOT / "configs" / "mamba-130m.yaml")
    assert (
        c.model,
        c.lr,
        c.batch_tokens,
        c.warmup_steps,
        c.betas,
        c.weight_decay,
        c.grad_clip,
    ) == ("mamba-130m", 3e-3, 2**19, 2000, (0.9, 0.95), 0.1, 1.0)
    big = TrainConfig.from_yaml(ROOT / "configs" / "mamba-1.4b.yaml")
    model = ssmkit.ModelConfig.preset(big.model, **big.model_overrides)
    assert (big.lr, model.n_layer, model.d_model) == (1.5e-3, 48, 2048)
    assert TrainConfig.from_yaml(ROOT / "configs" / "mamba2-130m.yaml").model == "mamba2-130m"


def test_overrides_and_yaml_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_tokens: 5e8\nlr: 3e-3\nseq_len: 128\nbatch_tokens: 1024\nmicro_batch: 8\n")
    cfg = TrainConfig.from_yaml(
        path, overrides=["lr=1e-3", "model_overrides.d_model=96", "schedule=wsd"]
    )
    assert (cfg.max_tokens, cfg.lr, cfg.model_overrides, cfg.schedule) == (
        500_000_000,
        1e-3,
        {"d_model": 96},
        "wsd",
    )
    assert cfg.total_steps() == math.ceil(5e8 / 1024)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(lr=-1.0), "lr must be a positive number"),
        (dict(precision="fp8"), "valid: fp32, bf16, fp16"),
        (dict(strategy="zero3"), "valid: single, ddp, fsdp"),
        (dict(max_steps=None), "set max_steps or max_tokens"),
        (dict(batch_tokens=1000), "nearest valid batch_tokens: 768 or 1024"),
        (dict(micro_batch=0), "micro_batch must be a positive integer"),
        (dict(min_lr=1.0), "min_lr must be in"),
    ],
)
def test_bad_configs(kw, message):
    base = dict(seq_len=64, micro_batch=4, batch_tokens=512, max_steps=10)
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**base, **kw})


def test_unknown_keys_list_the_valid_ones(tmp_path):
    with pytest.raises(
        ValueError, match=r"unknown TrainConfig key 'learning_rate'; valid: model, .* \(4\d in all"
    ):
        TrainConfig.from_dict({"learning_rate": 1e-3, "max_steps": 1})
    with pytest.raises(ValueError, match="unknown key 'nope'"):
        TrainConfig.from_dict({"max_steps": 1}, overrides=["nope=1"])
    # a near miss names the key meant, not the ~40 valid ones
    with pytest.raises(ValueError) as info:
        TrainConfig.from_dict({"max_steps": 1}, overrides=["max_step=50"])
    assert str(info.value) == (
        "unknown key 'max_step'; did you mean 'max_steps'? (in --set max_step=...)"
    )
    with pytest.raises(ValueError, match="does not exist"):
        TrainConfig.from_yaml(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("lr: [1e-3\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        TrainConfig.from_yaml(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping of TrainConfig keys"):
        TrainConfig.from_yaml(tmp_path / "list.yaml")


def test_grad_accum_derivation():
    cfg = TrainConfig(seq_len=2048, batch_tokens=2**19, micro_batch=16, max_steps=1)
    assert [cfg.grad_accum(w) for w in (1, 2, 4, 8, 16)] == [16, 8, 4, 2, 1]
    with pytest.raises(ValueError, match="micro_batch x world_size x seq_len"):
        cfg.grad_accum(3)


# --- schedule and parameter groups --------------------------------------------------------------
def test_schedule_values_at_known_steps():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)  # cosine starts at the peak
    assert lr_at(60, cfg) == pytest.approx(0.5 * (1e-3 + 1e-4))  # halfway: the mean
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    wsd = TrainConfig(
        lr=1e-3, min_lr=0.0, warmup_steps=10, max_steps=100, schedule="wsd", decay_frac=0.2
    )
    assert lr_at(50, wsd) == lr_at(79, wsd) == 1e-3
    assert lr_at(89, wsd) == pytest.approx(0.5e-3) and lr_at(99, wsd) == pytest.approx(0.0)
    assert (
        lr_at(50, TrainConfig(lr=2e-3, warmup_steps=0, max_steps=100, schedule="constant")) == 2e-3
    )


@pytest.mark.parametrize("preset", ["tiny", "tiny-mamba2"])
def test_weight_decay_groups(preset):
    model = ssmkit.build_model(preset)
    decay, no_decay = split_parameters(model)
    assert all(n.endswith(".weight") and "norm" not in n and "embedding" not in n for n in decay)
    assert (
        "backbone.embedding.weight" in no_decay and "lm_head.weight" not in decay + no_decay
    )  # tied: once
    kinds = {
        n.split(".")[-1] if "norm" not in n else "norm" for n in no_decay if "embedding" not in n
    }
    expected = {"A_log", "D", "bias", "norm"} | ({"dt_bias"} if preset == "tiny-mamba2" else set())
    assert kinds == expected
    assert any("in_proj" in n for n in decay) and any("conv1d" in n for n in decay)
    opt = ssmkit.train.build_optimizer(model, TrainConfig(max_steps=1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


@pytest.mark.parametrize("preset", ["tiny", "tiny-mamba2"])  # Mamba-1's A_log is 2-D
def test_fsdp_sharding_keeps_the_weight_decay_groups(preset):
    """fully_shard replaces the parameters; their ``_no_weight_decay`` tags must come along (else
    Mamba-1's A_log, a matrix, decays under FSDP only: 2.5e-3 off one process's weights after the 4
    steps of tests/integration/test_multinode.py)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ssmkit.train.distributed import Dist, wrap

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = ssmkit.build_model(preset)
        before = split_parameters(model)
        # a group of one process; world_size=2 so that wrap shards instead of returning the model
        wrap(model, "fsdp", "fp32", Dist(world_size=2))
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert split_parameters(model) == before
    finally:
        dist.destroy_process_group()


def test_flops_per_token():
    model = ssmkit.build_model("tiny")
    cfg = model.config
    linear = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d))
    )
    m = cfg.mamba1
    scan = cfg.n_layer * 3 * 9 * m.d_inner(cfg.d_model) * m.d_state
    assert flops_per_token(model, 128) == 6 * linear + scan


# --- the loop -----------------------------------------------------------------------------------
def test_accumulation_equals_the_large_batch(tmp_path, shards):
    runs = {}
    for micro in (8, 4, 2):  # 1, 2 and 4 micro-batches per step, same 8 windows
        cfg = small(tmp_path / str(micro), shards, micro_batch=micro, max_steps=3)
        trainer = Trainer(config=cfg)
        assert trainer.grad_accum == 8 // micro
        runs[micro] = (losses(trainer.fit()), trainer.model.state_dict())
    for micro in (4, 2):
        assert runs[micro][0] == pytest.approx(runs[8][0], abs=1e-5)
        for k, v in runs[8][1].items():
            torch.testing.assert_close(runs[micro][1][k], v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mamba2", "tiny-hybrid"])
def test_resume_is_exact(tmp_path, shards, preset):
    straight = losses(
        Trainer(config=small(tmp_path / "a", shards, model=preset, max_steps=8)).fit()
    )
    half = Trainer(config=small(tmp_path / "b", shards, model=preset, max_steps=8))
    part1 = losses(half.fit(until=4))  # stops at 4 with a checkpoint
    resumed = Trainer(config=small(tmp_path / "b", shards, model=preset, max_steps=8))
    assert resumed.resume()
    assert resumed.step == 4 and resumed.loader.step == 4 * resumed.grad_accum
    part2 = losses(resumed.fit())
    assert len(part1) == len(part2) == 4
    assert part1 + part2 == pytest.approx(straight, abs=1e-6)
    lines = [
        json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, 9))


def test_checkpoint_loads_with_from_pretrained(tmp_path, shards):
    trainer = Trainer(config=small(tmp_path, shards, max_steps=2))
    trainer.fit()
    ckpts = tmp_path / "run" / "checkpoints"
    latest = ckpts / (ckpts / "latest").read_text().strip()
    assert latest.name == "step_00000002"
    loaded = ssmkit.from_pretrained(latest / "model")
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(loaded(x).logits, trainer.model(x).logits, atol=1e-6, rtol=0)
    state = json.loads((latest / "trainer.json").read_text())
    assert (state["step"], state["tokens"]) == (2, 512)


def test_keep_last_and_metrics(tmp_path, shards):
    trainer = Trainer(
        config=small(tmp_path, shards, max_steps=6, ckpt_every=1, keep_last=2, eval_every=3)
    )
    history = trainer.fit()
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert names == ["step_00000005", "step_00000006"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    evals = [r for r in history if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"]))
    train = [r for r in history if r["kind"] == "train"]
    assert set(train[0]) >= {
        "step",
        "tokens",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "peak_mem_mb",
    }


# Jamba-style Mamba-1 (Δ/B/C norms, one epsilon) with 4 experts on layer 1: format "jamba" holds it
MOE_OVERRIDES = dict(
    d_model=32,
    n_layer=2,
    d_intermediate=32,
    num_experts=4,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.1,
    mixer_rms_eps=1e-5,
    mixer_rms_weights=True,
)


def test_a_mixture_of_experts_trains_with_its_aux_loss(tmp_path, shards):
    cfg = small(tmp_path, shards, model_overrides=MOE_OVERRIDES, max_steps=3)
    trainer = Trainer(config=cfg)
    router = trainer.model.backbone.layers[1].mlp.router.weight.detach().clone()
    x, y = next(trainer._batches(trainer.loader))
    loss, aux = trainer._loss((x, y))  # the LM's loss: next-token CE + coef · aux
    ce = ssmkit.eval.lm_loss(trainer.model, x, y)
    torch.testing.assert_close(loss, ce + 0.1 * aux, atol=1e-6, rtol=0)
    train = [r for r in trainer.fit() if r["kind"] == "train"]
    assert len(train) == 3 and all(1.0 < r["aux_loss"] <= 4.0 for r in train)  # k=2 when balanced
    assert not torch.equal(trainer.model.backbone.layers[1].mlp.router.weight, router)
    ckpts = tmp_path / "run" / "checkpoints"
    loaded = ssmkit.from_pretrained(ckpts / (ckpts / "latest").read_text().strip() / "model")
    torch.testing.assert_close(loaded(x).logits, trainer.model(x).logits, atol=1e-6, rtol=0)


class Poisoned(torch.nn.Module):
    """The tiny model, with a NaN loss on chosen calls."""

    def __init__(self, bad_calls):
        super().__init__()
        self.inner = ssmkit.build_model(
            ssmkit.ModelConfig.preset("tiny", d_model=32, n_layer=2, vocab_size=257)
        )
        self.config, self.bad, self.calls = self.inner.config, set(bad_calls), 0

    def forward(self, x):
        self.calls += 1
        logits = self.inner(x).logits
        return logits * float("nan") if self.calls in self.bad and self.training else logits


def test_nan_guard_skips_and_stops(tmp_path, shards):
    model = Poisoned({3})  # the 3rd step (micro_batch 8: one call a step)
    trainer = Trainer(model, small(tmp_path / "a", shards, micro_batch=8), data=shards / "train")
    with pytest.warns(UserWarning, match="step 3: loss is nan; step skipped"):
        history = trainer.fit()
    assert trainer.skipped == 1 and len(losses(history)) == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())
    stuck = Trainer(
        Poisoned(range(2, 100)),
        small(tmp_path / "b", shards, micro_batch=8, max_bad_steps=3),
        data=shards / "train",
    )
    with (
        pytest.warns(UserWarning),
        pytest.raises(TrainingError, match="not finite for 3 steps in a row"),
    ):
        stuck.fit()


def test_a_new_run_never_mixes_with_an_old_one(tmp_path, shards):
    Trainer(config=small(tmp_path, shards, max_steps=2)).fit()
    refused = r"already holds a run \(1 checkpoints, a metrics.jsonl\): resume it"
    for start in ("fit", "save_checkpoint"):  # a Trainer not resumed starts a new run
        with pytest.raises(ValueError, match=refused):
            getattr(Trainer(config=small(tmp_path, shards, max_steps=2)), start)()
    again = Trainer(config=small(tmp_path, shards, max_steps=3, overwrite=True))
    again.fit()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines if json.loads(x)["kind"] == "train"] == [1, 2, 3]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")] == ["step_00000003"]


def test_the_trainer_builds_and_resume_is_explicit(tmp_path, shards, capsys):
    """Building touches nothing in out_dir; resume() says whether it resumed, before fit()."""
    cfg = small(tmp_path, shards, max_steps=4)
    fresh = Trainer(config=cfg)
    assert not (tmp_path / "run").exists()
    assert fresh.resume() is False and fresh.step == 0  # nothing there: a new run
    assert "nothing to resume in" in capsys.readouterr().out
    fresh.fit(until=2)
    with pytest.raises(ValueError, match=r"resume\(\) comes before the first fit\(\)"):
        fresh.resume()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = Trainer(config=cfg)  # a run there: no refusal yet
    assert again.step == 0 and (tmp_path / "run" / "metrics.jsonl").read_text() == before
    assert again.resume() is True and again.step == 2


def test_wandb_missing_only_warns(tmp_path, shards, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.warns(UserWarning, match="wandb is not installed"):
        Trainer(config=small(tmp_path, shards, max_steps=1, tracking="wandb")).fit()


def test_data_as_a_token_loader(tmp_path, shards):
    from ssmkit.data import TokenLoader

    cfg = small(tmp_path, shards, max_steps=2)
    by_dir = losses(Trainer(config=cfg).fit())
    loader = TokenLoader(shards / "train", cfg.seq_len, cfg.micro_batch, seed=cfg.seed)
    history = Trainer(config=small(tmp_path / "b", shards, max_steps=2), data=loader).fit()
    assert losses(history) == by_dir
    assert [r["step"] for r in history if r["kind"] == "eval"] == [2]  # config's val_data
    with pytest.raises(ValueError, match="the TokenLoader given has .*'batch_size': 2"):
        Trainer(config=cfg, data=TokenLoader(shards / "train", cfg.seq_len, 2))


def test_vocab_mismatch_is_an_error(tmp_path, shards):
    model = ssmkit.build_model(
        ssmkit.ModelConfig.preset("tiny", d_model=32, n_layer=2, vocab_size=100)
    )
    with pytest.raises(
        ValueError, match="104 vocabulary rows but the data's tokenizer 'byte' has 257"
    ):
        Trainer(model, small(tmp_path, shards))


def test_loss_falls_with_cpu_tiny_on_the_embedded_corpus(tmp_path):
    cfg = TrainConfig.from_yaml(
        ROOT / "configs" / "cpu-tiny.yaml",
        overrides=[
            "seq_len=128",
            "micro_batch=2",
            "batch_tokens=256",
            "max_steps=30",
            "warmup_steps=5",
            "eval_every=30",
            "eval_batches=4",
            "log_every=5",
            "progress=false",
            f"out_dir={tmp_path}",
        ],
    )
    history = Trainer(config=cfg).fit()
    evals = [r["val_loss"] for r in history if r["kind"] == "eval"]
    assert evals[0] > 10.0 and evals[-1] < evals[0] - 2.0, evals  # ln(50257) = 10.8 at init


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cpu(tmp_path, shards, precision):
    history = Trainer(
        config=small(tmp_path, shards, precision=precision, max_steps=4, eval_every=4)
    ).fit()
    assert all(math.isfinite(x) for x in losses(history))
    evals = [r["val_loss"] for r in history if r["kind"] == "eval"]
    assert evals[-1] < evals[0]
    trainer = Trainer(config=small(tmp_path / "b", shards, precision=precision))
    trainer_dtypes = {p.dtype for p in trainer.model.parameters()}
    assert trainer_dtypes == {torch.float32}  # fp32 master weights


def test_matched_transformer_baseline_trains(tmp_path, shards, capsys):
    """The Llama baseline trains with a run config meant for ssmkit models (loss_chunk_size set, as
    configs/cpu-tiny.yaml has it): its loss is computed whole, and one line says so."""
    from transformers import LlamaForCausalLM

    mamba = ssmkit.build_model(
        ssmkit.ModelConfig.preset("tiny", d_model=64, n_layer=4, vocab_size=257)
    )
    llama = ssmkit.models.matched_transformer(mamba)
    rows = {r["model"]: r for r in ssmkit.models.parameter_report({"mamba": mamba, "llama": llama})}
    assert abs(rows["llama"]["non_embedding"] / rows["mamba"]["non_embedding"] - 1) < 0.25
    assert (
        llama.config.vocab_size == mamba.config.padded_vocab_size and llama.config.hidden_size == 64
    )
    trainer = Trainer(llama, small(tmp_path, shards, max_steps=4, eval_every=4, loss_chunk_size=64))
    assert (
        "LlamaForCausalLM computes its loss over all positions at once" in capsys.readouterr().out
    )
    history = trainer.fit()
    evals = [r["val_loss"] for r in history if r["kind"] == "eval"]
    assert evals[-1] < evals[0]
    latest = tmp_path / "run" / "checkpoints" / "step_00000004" / "model"
    reloaded = LlamaForCausalLM.from_pretrained(latest)
    x = torch.randint(0, 257, (1, 8))
    torch.testing.assert_close(reloaded(x).logits, trainer.model(x).logits, atol=1e-5, rtol=0)


# --- command line -------------------------------------------------------------------------------
def run_cli(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "ssmkit", "train", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        **kw,
    )


def test_cli_trains_and_resumes(tmp_path, shards):
    config = tmp_path / "c.yaml"
    config.write_text(small(tmp_path, shards, max_steps=4, ckpt_every=2).to_yaml())
    first = run_cli("--config", str(config), "--set", "max_steps=2")
    assert first.returncode == 0, first.stderr
    again = run_cli("--config", str(config), "--resume")
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "done: 4 steps" in again.stdout
    bad = run_cli("--config", str(config), "--set", "lr=-1")
    assert bad.returncode == 2 and "lr must be a positive number" in bad.stderr


def test_cpu_training_reuses_freed_memory():
    import platform

    from ssmkit.env import reuse_freed_memory

    expected = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert reuse_freed_memory() is expected


def test_memory_kept_for_reuse_goes_back_when_training_ends():
    """Under reuse_freed_memory a freed 256 MiB tensor stays in the process (what a notebook's
    kernel held after training, issue #25) until release_freed_memory, which fit() calls on a
    CPU."""
    import platform

    from ssmkit.env import release_freed_memory, reuse_freed_memory, rss_mb

    if not (reuse_freed_memory() and platform.libc_ver()[0] == "glibc" and rss_mb()):
        pytest.skip("glibc and /proc needed")
    base = rss_mb()
    x = torch.ones(64, 1024, 1024)
    (x * 2).sum()
    del x
    held = rss_mb() - base
    assert held > 200  # kept for reuse
    assert release_freed_memory() > 0.8 * held
    assert rss_mb() - base < 0.2 * held


@pytest.mark.slow
def test_torch_compile_gives_the_eager_losses(tmp_path, shards, monkeypatch):
    """compile=True runs the steps through torch.compile's wrapper, with the eager losses. Compiled
    with the aot_eager backend: dynamo's graph capture and AOT autograd, as inductor sees them, but
    not inductor's C++ code generation (minutes on a cold cache, and torch's to test; the compiled
    scan's tests in tests/unit/ops run inductor on ssmkit's ops)."""
    real = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda model, **kw: real(model, backend="aot_eager", **kw)
    )
    # 16-token windows: dynamo unrolls the scan's loop over time, so the compile grows with seq_len
    short = dict(max_steps=3, seq_len=16, batch_tokens=128)
    eager = losses(Trainer(config=small(tmp_path / "a", shards, **short)).fit())
    compiled = Trainer(config=small(tmp_path / "b", shards, compile=True, **short))
    assert compiled.module is not compiled.model  # the compiled wrapper runs the steps
    assert losses(compiled.fit()) == pytest.approx(eager, abs=1e-4)
