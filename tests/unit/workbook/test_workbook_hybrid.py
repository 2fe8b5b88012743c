"""ssmkit.workbook.chapters.ch03_hybrid: what notebooks/03_hybrid.ipynb calls (Jamba's rule, layer
patterns, parameter split, the ratio sweep, long-context rows) and its parameters, on tiny
models."""

from __future__ import annotations

import pytest
import torch
from helpers import check_parameters

import ssmkit
from ssmkit import workbook
from ssmkit.data import make_task
from ssmkit.models import ModelConfig, build_model, matched_transformer
from ssmkit.workbook import WorkbookError
from ssmkit.workbook.chapters import ch03_hybrid


@pytest.fixture(scope="module")
def cfg():
    """The tiny preset's default recipe (byte vocabulary), as a TrainConfig."""
    return workbook.train_config("tiny", max_steps=1, device="cpu", tokenizer="byte")


def test_layer_pattern_names_every_mixer():
    assert (
        ch03_hybrid.layer_pattern(
            ModelConfig(d_model=32, n_layer=8, vocab_size=64, attn_every=4, attn_offset=2)
        )
        == "M M A M M M A M"
    )
    mixed = ModelConfig(
        d_model=32,
        n_layer=4,
        vocab_size=64,
        layout=["mamba1", "mamba2", "attn", "swa"],
        headdim=16,
        attn_cfg={"window_size": 8},
    )
    assert ch03_hybrid.layer_pattern(mixed) == "M M2 A W"
    assert ch03_hybrid.attention_share(mixed) == 0.5
    model = build_model(ModelConfig(d_model=32, n_layer=4, vocab_size=64))
    assert ch03_hybrid.layer_pattern(model) == "M M M M" and ch03_hybrid.attention_share(model) == 0
    llama = matched_transformer(model)
    assert ch03_hybrid.layer_pattern(llama) == " ".join("T" * llama.config.num_hidden_layers)
    assert ch03_hybrid.attention_share(llama) == 1


def test_hybrid_config_follows_jambas_rule(cfg):
    for every, want in (
        (0, "M " * 7 + "M"),
        (8, "M M M M A M M M"),
        (4, "M M A M M M A M"),
        (2, "M A M A M A M A"),
        (1, "A A A A A A A A"),
    ):
        run = ch03_hybrid.hybrid_config(cfg, every, d_model=32, n_layer=8)
        assert ch03_hybrid.layer_pattern(run) == want, every
    model_cfg = ch03_hybrid.hybrid_config(cfg, 1, d_model=32, n_layer=8).model_config(257)
    assert (
        model_cfg.attn_cfg["rotary_emb_dim"] == model_cfg.attn_cfg["head_dim"]
    )  # attention only: rotary
    jamba = ch03_hybrid.hybrid_config(cfg, 4, d_model=32, n_layer=8).model_config(257)
    assert jamba.attn_cfg["rotary_emb_dim"] == 0  # Jamba: none
    assert (
        ch03_hybrid.layer_pattern(ch03_hybrid.hybrid_config(cfg, 4, 1, d_model=32, n_layer=4))
        == "M A M M"
    )
    run = ch03_hybrid.hybrid_config(cfg, 2, out_dir="somewhere", d_model=32, n_layer=4)
    assert run.out_dir == "somewhere" and run.model_overrides["attn_every"] == 2
    assert cfg.out_dir != "somewhere" and "attn_every" not in cfg.model_overrides  # cfg untouched
    with pytest.raises(ValueError, match="attn_offset"):
        ch03_hybrid.hybrid_config(cfg, 4, 4)


def test_mamba3_is_a_state_space_layer_everywhere(cfg):
    """Mamba-3 has its letter, counts as an SSM (not as attention) in the share, the sweep's rows
    and the parameter split, and is a mixer hybrid_config can swap in, with its own state size and
    heads."""
    mixed = ModelConfig(
        d_model=32,
        n_layer=4,
        vocab_size=64,
        layout=["mamba3", "mamba2", "attn", "mamba3"],
        headdim=16,
        d_state=16,
    )
    assert (
        ch03_hybrid.layer_pattern(mixed) == "M3 M2 A M3"
        and ch03_hybrid.attention_share(mixed) == 0.25
    )
    m3 = ch03_hybrid.hybrid_config(cfg, 4, mixer="mamba3", d_model=16, n_layer=4).model_config(257)
    assert ch03_hybrid.layer_pattern(m3) == "M3 M3 A M3"
    g3 = m3.mamba3  # with_mixer's sizes for d_inner 32: N 64, P 32
    assert (g3.d_state, g3.headdim, g3.chunk_size) == (64, 32, 64)
    model = build_model(m3)
    split = ch03_hybrid.parameter_split(model)
    mixers = [layer.mixer for layer in model.backbone.layers]
    assert split["ssm"] == sum(
        p.numel() for m in mixers if isinstance(m, ssmkit.models.Mamba3) for p in m.parameters()
    )  # B_norm, C_norm included
    assert split["other"] == 0 and split["total"] == model.num_parameters()
    preset = workbook.train_config("tiny-mamba3", max_steps=1, device="cpu", tokenizer="byte")
    rows = ch03_hybrid.ratio_sweep(preset, width=16, depth=8, attn_every=(0, 4, 1))
    assert [(r["layers"], r["attn_share"], r["mixer"]) for r in rows] == [
        (" ".join(["M3"] * 8), 0, "mamba3"),
        ("M3 M3 A M3 M3 M3 A M3", 0.25, "mamba3"),
        (" ".join("A" * 8), 1, "none"),
    ]
    with pytest.raises(
        ValueError,
        match=r"mixers=\['mamba4'\] is not valid; valid: a non-empty list of "
        "mamba1, mamba2, mamba3",
    ):
        ch03_hybrid.mixer_comparison(cfg, attn_every=4, mixers=["mamba4"])


def test_hybrid_config_swaps_the_ssm_with_its_own_defaults(cfg):
    m2 = ch03_hybrid.hybrid_config(cfg, 4, mixer="mamba2", d_model=16, n_layer=4).model_config(257)
    assert ch03_hybrid.layer_pattern(m2) == "M2 M2 A M2"
    g2 = m2.mamba2
    assert (g2.d_state, g2.headdim, g2.chunk_size) == (64, 32, 64)
    same_shape = ch03_hybrid.hybrid_config(cfg, 4, d_model=16, n_layer=4).model_config(257)
    assert g2 == same_shape.with_mixer("mamba2").mamba2  # one rule: ModelConfig.with_mixer's
    back = ch03_hybrid.hybrid_config(cfg, 4, mixer="mamba1", d_model=16, n_layer=4).model_config(
        257
    )
    assert back.mamba1.d_state == 16 and ch03_hybrid.layer_pattern(back) == "M M A M"
    given = ch03_hybrid.hybrid_config(cfg, 4, mixer="mamba2", d_model=16, n_layer=4, d_state=8)
    assert given.model_config(257).mamba2.d_state == 8  # the caller's own knob wins
    odd = ch03_hybrid.hybrid_config(cfg, 4, mixer="mamba2", d_model=24, n_layer=4).model_config(257)
    assert odd.mamba2.headdim == 16  # divides d_inner 48


def test_parameter_split_adds_up():
    cfg = ModelConfig(
        d_model=32,
        n_layer=4,
        vocab_size=64,
        attn_every=2,
        attn_offset=1,
        d_intermediate=48,
        tie_embeddings=False,
    )
    model = build_model(cfg)
    split = ch03_hybrid.parameter_split(model)
    assert (
        split["total"] == model.num_parameters() == sum(v for k, v in split.items() if k != "total")
    )
    assert split["other"] == 0
    assert all(split[k] > 0 for k in ("ssm", "attention", "mlp", "embedding", "norms"))
    assert split["embedding"] == 2 * cfg.padded_vocab_size * 32  # embedding + untied head
    attn = model.backbone.layers[1].mixer
    assert split["attention"] == 2 * sum(p.numel() for p in attn.parameters())
    tied = build_model(ModelConfig(d_model=32, n_layer=2, vocab_size=64))
    assert ch03_hybrid.parameter_split(tied)["embedding"] == tied.config.padded_vocab_size * 32
    llama = matched_transformer(tied)
    split = ch03_hybrid.parameter_split(llama)
    assert split["total"] == sum(p.numel() for p in {id(p): p for p in llama.parameters()}.values())
    assert split["ssm"] == split["other"] == 0 and split["attention"] and split["mlp"]


def test_ratio_sweep_builds_the_sweep_and_reuses_rows(cfg):
    rows = ch03_hybrid.ratio_sweep(cfg, width=16, depth=8)  # no task: the models only
    assert [r["layers"] for r in rows] == [
        "M M M M M M M M",
        "M M M M A M M M",
        "M M A M M M A M",
        "M A M A M A M A",
        "A A A A A A A A",
    ]
    assert [r["attn_share"] for r in rows] == [0, 0.125, 0.25, 0.5, 1]
    assert [r["mixer"] for r in rows] == ["mamba1"] * 4 + ["none"]
    task = make_task("mqar", vocab_size=17, seq_len=16, num_kv_pairs=2)
    trained = ch03_hybrid.ratio_sweep(
        cfg, task, width=16, depth=8, attn_every=(4,), steps=2, batch=4
    )
    assert 0 <= trained[0]["task_acc"] <= 1 and trained[0]["params"] > 0
    pair = ch03_hybrid.mixer_comparison(
        cfg, task, attn_every=4, rows=trained, width=16, depth=8, steps=2, batch=4
    )
    assert pair[0] == trained[0]  # the Mamba-1 row reused
    assert pair[1]["mixer"] == "mamba2" and pair[1]["layers"] == "M2 M2 A M2 M2 M2 A M2"
    three = ch03_hybrid.mixer_comparison(
        cfg,
        task,
        attn_every=4,
        rows=trained + pair,
        width=16,
        depth=8,
        steps=2,
        batch=4,
        mixers=("mamba1", "mamba2", "mamba3"),
    )
    assert three[:2] == pair  # both rows reused
    assert three[2]["mixer"] == "mamba3" and three[2]["layers"] == "M3 M3 A M3 M3 M3 A M3"
    assert 0 <= three[2]["task_acc"] <= 1 and three[2]["params"] > 0
    with pytest.raises(ValueError, match="lm_tokens needs"):
        ch03_hybrid.ratio_sweep(cfg, width=16, depth=8, lm_tokens=1024)


def test_ratio_sweep_trains_language_models(cfg, shards, tmp_path):
    run = workbook.train_config(
        "tiny",
        max_steps=1,
        device="cpu",
        tokenizer="byte",
        seq_len=32,
        micro_batch=2,
        batch_tokens=64,
        eval_batches=1,
        progress=False,
    )
    rows = ch03_hybrid.ratio_sweep(
        run,
        width=16,
        depth=8,
        attn_every=(0, 4),
        lm_tokens=128,
        data=shards / "train",
        val_data=shards / "val",
        out_dir=tmp_path,
    )
    assert all(r["val_loss"] > 0 for r in rows)
    saved = ssmkit.from_pretrained(
        next((tmp_path / "attn_every_4" / "checkpoints").glob("step_*")) / "model"
    )
    assert ch03_hybrid.layer_pattern(saved) == rows[1]["layers"]  # a hybrid checkpoint loads


def test_a_seeded_hybrid_builds_the_same_and_saves(cfg, tmp_path):
    run = ch03_hybrid.hybrid_config(cfg, 2, d_model=16, n_layer=2)
    model = build_model(run.model_config(vocab_size=64), seed=run.seed)
    torch.randn(3)  # the global generator moves on
    again = build_model(run.model_config(vocab_size=64), seed=run.seed)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded
    model.save_pretrained(tmp_path / "h")
    loaded = ssmkit.from_pretrained(tmp_path / "h")
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values())
    )


def test_context_costs_rows_and_crossovers(cfg):
    models = ch03_hybrid.context_models(
        ch03_hybrid.hybrid_config(cfg, 0, d_model=16, n_layer=2), 2, max_len=64
    )
    assert [ch03_hybrid.layer_pattern(m) for m in models.values()][:2] == ["M M", "M A"]
    rows = ch03_hybrid.context_costs(models, [16, 32], new_tokens=2, checkpoint_from=32)
    assert [(r["model"], r["seq_len"]) for r in rows] == [(m, n) for n in (16, 32) for m in models]
    assert [r["checkpointed"] for r in rows] == [False] * 3 + [True] * 3
    by = {(r["model"], r["seq_len"]): r for r in rows}
    assert by["Mamba", 16]["cache_mb"] == by["Mamba", 32]["cache_mb"]  # a fixed-size state
    assert (
        by["Transformer++", 32]["cache_mb"] > by["Transformer++", 16]["cache_mb"]
    )  # keys and values grow
    assert not models["Mamba"].backbone.gradient_checkpointing  # switched back off
    fake = [
        {
            "model": m,
            "seq_len": n,
            "train_tok_s": t,
            "train_peak_mb": 1.0,
            "prefill_s": 1.0,
            "decode_tok_s": 1.0,
            "cache_mb": c,
        }
        for m, n, t, c in (
            ("Mamba", 1, 5.0, 1.0),
            ("Transformer++", 1, 9.0, 2.0),
            ("Mamba", 2, 8.0, 1.0),
            ("Transformer++", 2, 7.0, 3.0),
            ("Mamba", 4, 6.0, 1.0),
            ("Transformer++", 4, 3.0, 5.0),
        )
    ]
    cross = ch03_hybrid.crossovers(fake)
    assert cross["train_tok_s"] == 2 and cross["cache_mb"] == 1 and cross["train_peak_mb"] is None


def test_extrapolation_rows(cfg, shards):
    model = build_model(ModelConfig(d_model=16, n_layer=2, vocab_size=257))
    rows = ch03_hybrid.extrapolation({"Mamba": model}, shards / "val", [32, 10**6], max_windows=1)
    assert rows[0]["model"] == "Mamba" and rows[0]["loss"] > 0 and rows[0]["windows"] == 1
    assert rows[1]["loss"] is None and "skipped" in rows[1]["note"]


def test_the_notebook_parameters_are_checked(tmp_path):
    out = check_parameters(
        ch03_hybrid,
        tmp_path,
        attn_every=4,
        sweep_depth=8,
        sweep_tokens=0,
        context_lengths="[1024, 4096]",
    )
    assert out["context_lengths"] == [1024, 4096] and out["out_dir"] == tmp_path
    for bad, match in (
        (dict(attn_every=0), "attn_every"),
        (dict(sweep_depth=4), "sweep_depth"),
        (dict(context_lengths=[4096, 1024]), "ascending"),
        (dict(context_lengths=[]), "context_lengths"),
    ):
        with pytest.raises(WorkbookError, match=match):
            check_parameters(ch03_hybrid, tmp_path, **bad)
