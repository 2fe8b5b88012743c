"""ssmkit.workbook.chapters.ch02_scale_up: what notebooks/02_scale_up.ipynb calls (DDP/FSDP
comparison tables, memory rows, the Slurm command, data preparation with its MDS copy, remote
streaming offline, mixed-precision runs with the fp16 grad scaler, Mamba-2 vs Mamba-1 throughput
rows, the lm-eval call, the scaling sweep and its power-law fit), on tiny models."""

from __future__ import annotations

import math
import random

import pytest
import torch
from helpers import ROOT, check_parameters, small

from ssmkit.data import TokenLoader, read_mds
from ssmkit.eval import summarize_run
from ssmkit.train import TrainConfig
from ssmkit.workbook import WorkbookError
from ssmkit.workbook.chapters import ch02_scale_up


def tiny_cfg(shards, tmp_path, **kw) -> TrainConfig:
    """helpers.small with TrainConfig's default floor of the schedule."""
    return small(tmp_path, shards, **{"min_lr": 1e-5, **kw})


def fake_run(losses, nproc=1, val=None, **extra):
    history = [
        {
            "kind": "train",
            "step": i + 1,
            "tokens": 8 * (i + 1),
            "loss": v,
            "tokens_per_s": 100.0 + i,
            "peak_mem_mb": 50.0,
            **extra,
        }
        for i, v in enumerate(losses)
    ]
    if val is not None:
        history.append(
            {
                "kind": "eval",
                "step": len(losses),
                "tokens": 8 * len(losses),
                "val_loss": val,
                "val_ppl": math.exp(val),
            }
        )
    return {**summarize_run(history), "history": history, "nproc": nproc}


# --- the power law --------------------------------------------------------------------------------


def test_fit_power_law_recovers_a_known_exponent():
    xs = [1e9, 3e9, 1e10, 3e10, 1e11]
    fit = ch02_scale_up.fit_power_law(xs, [7.0 * x**-0.076 for x in xs])
    assert fit["b"] == pytest.approx(0.076, rel=1e-9) and fit["a"] == pytest.approx(7.0, rel=1e-9)
    assert fit["r2"] == pytest.approx(1.0) and fit["points"] == 5
    assert ch02_scale_up.predict_loss(fit, 1e12) == pytest.approx(7.0 * 1e12**-0.076)
    rng = random.Random(0)  # 1% multiplicative noise: the exponent survives
    noisy = ch02_scale_up.fit_power_law(
        xs, [7.0 * x**-0.076 * math.exp(rng.gauss(0, 0.01)) for x in xs]
    )
    assert noisy["b"] == pytest.approx(0.076, abs=0.01) and 0.8 < noisy["r2"] < 1
    rising = ch02_scale_up.fit_power_law([1, 2, 4], [1, 2, 4])
    assert rising["b"] == pytest.approx(-1.0)  # y = x: a negative exponent, not an error
    for bad in (([1, 1], [2, 3]), ([1, 2], [1, -1]), ([1, 2, 3], [1, 2]), ([0, 1], [1, 2])):
        with pytest.raises(ValueError, match="fit_power_law"):
            ch02_scale_up.fit_power_law(*bad)


@pytest.mark.parametrize("preset", ["mamba-130m", "mamba3-130m"])
def test_model_compute_counts_on_the_meta_device(preset):
    c = ch02_scale_up.model_compute(preset, 10**9, vocab_size=50277, seq_len=2048)
    assert 125e6 < c["params"] < 135e6  # the 130M class with GPT-2's vocabulary
    assert c["compute"] == c["flops_per_token"] * 10**9
    assert (
        6 * c["params"] < c["flops_per_token"] < 7 * c["params"]
    )  # 6N (tied head counted) + the scans


def test_plot_scaling_writes_a_figure(tmp_path):
    rows = [{"d_model": d, "compute": 1e12 * d, "val_loss": 3.0 * d**-0.1} for d in (32, 64, 128)]
    fit = ch02_scale_up.fit_power_law([r["compute"] for r in rows], [r["val_loss"] for r in rows])
    fig = ch02_scale_up.plot_scaling(
        rows, fit, tmp_path / "s.png", extra={"130M?": (1e17, 1.5)}, show=False
    )
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert len(fig.axes[0].lines) == 3  # points, the fit, the prediction


# --- 2.1: tables of the strategy runs -------------------------------------------------------------


def test_loss_table_and_differences():
    runs = {
        "one process": fake_run([5.0, 4.0, 3.0], val=3.5),
        "ddp": fake_run([5.0, 4.00001, 3.00002], nproc=2, val=3.50001),
        "fsdp": fake_run([5.0, 3.9, 3.0], nproc=2, val=3.5),
    }
    rows = ch02_scale_up.loss_table(runs)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["max_abs_diff"] == pytest.approx(0.1) and rows[0]["max_abs_diff"] == 0
    diff = ch02_scale_up.max_loss_difference(runs)
    assert diff["ddp"] == pytest.approx(2e-5) and diff["fsdp"] == pytest.approx(0.1)
    assert diff["ddp val"] == pytest.approx(1e-5) and diff["fsdp val"] == 0


def test_memory_rows_and_metrics(shards, tmp_path):
    runs = {
        "one process": fake_run([3.0]),
        "ddp": fake_run([3.0], nproc=2, rank_peak_mem_mb=[300.0, 310.0], rank_state_mb=[6.0, 6.0]),
        "fsdp": fake_run([3.0], nproc=2, rank_peak_mem_mb=[290.0, 295.0], rank_state_mb=[3.0, 3.0]),
    }
    rows = ch02_scale_up.memory_rows(runs)
    assert [(r["run"], r["rank"]) for r in rows] == [
        ("one process", 0),
        ("ddp", 0),
        ("ddp", 1),
        ("fsdp", 0),
        ("fsdp", 1),
    ]
    assert rows[0] == {"run": "one process", "rank": 0, "peak_mb": 50.0, "state_mb": None}
    assert rows[2]["peak_mb"] == 310.0 and rows[4]["state_mb"] == 3.0
    metrics = ch02_scale_up.strategy_metrics(runs, rows)
    assert metrics["ddp_state_mb"] == 6.0 and metrics["fsdp_rank0_peak_mb"] == 290.0
    assert metrics["one_process_tok_s"] == 100 and "one_process_max_loss_diff" not in metrics
    planned = ch02_scale_up.memory_rows(runs, tiny_cfg(shards, tmp_path))
    by = {(r["run"], r["rank"]): r for r in planned}
    ddp, fsdp = by["ddp", 0]["planned_state_mb"], by["fsdp", 0]["planned_state_mb"]
    assert fsdp == pytest.approx(ddp / 2, rel=0.05) and by["ddp", 0]["planned_step_mb"] > ddp


def test_memory_rows_plan_a_mamba3_run(shards, tmp_path, monkeypatch):
    """Notebook 02 with a Mamba-3 preset: the planner's rows (the planner refused Mamba-3 before).
    The planned state is 12 bytes per parameter of the real model (fp32 weights, AdamW's m and v),
    halved by FSDP on 2 ranks. On a CPU a Mamba-1 run plans as the fused scan it takes ("cpu"), or
    as the torch path under SSMKIT_BACKEND=torch. On GPUs the rows use the kernels' formulas only
    where every mixer's kernel imports: mamba_ssm 2.3 has none for Mamba-3, whose layers then take
    the torch path."""
    import ssmkit.env
    import ssmkit.ops.backend
    from ssmkit.models import build_model
    from ssmkit.train import plan_memory

    two = dict(nproc=2, rank_peak_mem_mb=[300.0, 310.0], rank_state_mb=[6.0, 6.0])
    runs = {
        "one process": fake_run([3.0]),
        "ddp": fake_run([3.0], **two),
        "fsdp": fake_run([3.0], **two),
    }
    m3 = tiny_cfg(
        shards, tmp_path, model="tiny-mamba3", model_overrides={"d_model": 32, "n_layer": 2}
    )
    by = {(r["run"], r["rank"]): r for r in ch02_scale_up.memory_rows(runs, m3)}
    params = build_model(m3.model_config()).num_parameters()
    assert by["ddp", 0]["planned_state_mb"] == round(12 * params / 2**20, 2)
    assert by["fsdp", 1]["planned_state_mb"] == pytest.approx(6 * params / 2**20, abs=0.01)
    assert by["one process", 0]["planned_step_mb"] > by["ddp", 0]["planned_state_mb"]
    m1 = tiny_cfg(shards, tmp_path)
    on_cpu = {}
    for backend in ("cpu", "torch"):
        if backend == "torch":
            monkeypatch.setenv("SSMKIT_BACKEND", "torch")
        else:
            monkeypatch.delenv("SSMKIT_BACKEND", raising=False)
        on_cpu[backend] = ch02_scale_up.memory_rows(runs, m1)[0]["planned_step_mb"]
        expected = plan_memory(m1, strategy="single", n_gpus=1, backend=backend).total / 2**20
        assert on_cpu[backend] == round(expected, 1), backend
    assert on_cpu["cpu"] < on_cpu["torch"]  # the fused scan saves no per-step states
    monkeypatch.delenv("SSMKIT_BACKEND")
    monkeypatch.setattr(ssmkit.env, "pick_device", lambda device="auto": "cuda")
    monkeypatch.setattr(
        ssmkit.ops.backend,
        "kernel_import_error",
        lambda module: "no Mamba-3 kernels" if "mamba3" in module else None,
    )
    for cfg, backend in ((m3, "torch"), (m1, "cuda")):
        planned = ch02_scale_up.memory_rows(runs, cfg)[0]["planned_step_mb"]
        expected = plan_memory(cfg, strategy="single", n_gpus=1, backend=backend).total / 2**20
        assert planned == round(expected, 1), (cfg.model, backend)


def test_slurm_command_names_the_config():
    text = ch02_scale_up.slurm_command(
        "mamba-1.4b", nodes=2, gpus_per_node=4, sets=["max_tokens=1e9"]
    )
    assert "ssmkit train --config configs/mamba-1.4b.yaml --nproc 4 --set max_tokens=1e9" in text
    assert (
        "sbatch --nodes=2 --gres=gpu:4 scripts/slurm/train.sbatch configs/mamba-1.4b.yaml" in text
    )
    assert (  # the line of scripts/slurm/train.sbatch (tests/integration/test_multinode.py)
        "srun ssmkit train --config configs/mamba-1.4b.yaml --resume --nnodes $SLURM_NNODES "
        "--nproc 4 --rdzv-endpoint $HEAD:29500 --rdzv-id $SLURM_JOB_ID --set max_tokens=1e9"
    ) in text
    assert (
        "torchrun --nnodes=$SLURM_NNODES --nproc-per-node=4 --rdzv-backend=c10d "
        "--rdzv-endpoint=$HEAD:29500 --rdzv-id=$SLURM_JOB_ID "
        "--rdzv-conf=join_timeout=600,read_timeout=600 -m ssmkit.train "
        "--config configs/mamba-1.4b.yaml --set max_tokens=1e9 --resume"
    ) in text
    script = (ROOT / "scripts" / "slurm" / "train.sbatch").read_text()
    assert 'srun ssmkit train --config "$CONFIG" --resume' in script
    with pytest.raises(WorkbookError, match="does not exist; run configs: .*cpu-tiny"):
        ch02_scale_up.slurm_command("mamba-9b")


def test_compare_strategies_wants_a_gpu_per_rank(shards, tmp_path, monkeypatch):
    import ssmkit.env

    monkeypatch.setattr(ssmkit.env, "pick_device", lambda device="auto": "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(WorkbookError, match="nproc=2 needs 2 GPUs .* 1 visible"):
        ch02_scale_up.compare_strategies(tiny_cfg(shards, tmp_path), nproc=2, out_dir=tmp_path)
    assert not (tmp_path / "one_process").exists()  # nothing launched


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-mamba3"])
def test_compare_strategies_trains_alike(shards, tmp_path, preset):
    """2.1 with a Mamba-3 model (notebook 02's CI run checks the same with its Mamba-1 config:
    tests/integration/test_notebooks.py); the planner's state per rank (its weights + AdamW rows)
    is the state each rank counted."""
    cfg = tiny_cfg(
        shards, tmp_path, max_steps=2, model=preset, tokenizer="byte"
    )  # the shards' vocabulary
    runs = ch02_scale_up.compare_strategies(cfg, nproc=2, out_dir=tmp_path / "s", show=False)
    assert list(runs) == ["one process", "ddp", "fsdp"]
    assert [r["nproc"] for r in runs.values()] == [1, 2, 2]
    assert max(ch02_scale_up.max_loss_difference(runs).values()) < 5e-5
    assert (tmp_path / "s" / "one_process" / "metrics.jsonl").exists()
    for row in ch02_scale_up.memory_rows(runs, cfg)[1:]:  # both rounded to 0.01 MiB: 5%, not exact
        assert row["planned_state_mb"] == pytest.approx(row["state_mb"], rel=0.05), row


# --- 2.2: data ------------------------------------------------------------------------------------


def test_prepare_at_scale_writes_shards_and_their_mds_copy(tmp_path):
    prep = ch02_scale_up.prepare_at_scale(
        "stdlib-docs", "byte", tmp_path / "d", max_tokens=5000, seq_len=64
    )
    assert prep["tokens"] == 5000 and prep["tokens_per_s"] > 0 and prep["documents"] >= 1
    assert prep["mds_samples"] == (5000 - 1) // 64 == len(list(read_mds(tmp_path / "d" / "mds")))
    first = TokenLoader(tmp_path / "d", 64, 1)
    window = first._tokens(0, 65).tolist()
    assert prep["first_sample"] == window and len(window) == 65  # the loader's window 0
    assert all(name.endswith(".mds") for name in prep["mds_files"])
    again = ch02_scale_up.prepare_at_scale(
        "stdlib-docs", "byte", tmp_path / "d", max_tokens=5000, seq_len=64
    )
    assert again["tokens"] == 5000  # redone from scratch


def test_stream_remote_offline_says_why():
    out = ch02_scale_up.stream_remote(
        "slimpajama", docs=1, tokenizer="byte"
    )  # conftest: HF_HUB_OFFLINE=1
    assert (
        out["ok"] is False
        and "cannot be streamed here" in out["error"]
        and "stdlib-docs" in out["error"]
    )
    with pytest.raises(WorkbookError, match="not a remote corpus"):
        ch02_scale_up.stream_remote("stdlib-docs")


# --- 2.3: mixed precision -------------------------------------------------------------------------


def test_autocast_support_on_cpu():
    assert ch02_scale_up.autocast_support("cpu") == {"bf16": "bfloat16", "fp16": "float16"}


def test_precision_runs_and_the_grad_scaler(shards, tmp_path):
    runs = ch02_scale_up.precision_runs(
        tiny_cfg(shards, tmp_path, max_steps=4),
        shards / "train",
        shards / "val",
        out_dir=tmp_path / "p",
        fp16_init_scale=2.0**40,
        fp16_growth_interval=2,
    )
    rows = {r["precision"]: r for r in ch02_scale_up.precision_rows(runs)}
    assert rows["fp32"]["max_abs_diff"] == 0 and rows["bf16"]["max_abs_diff"] < 0.02
    assert rows["fp32"]["grad_scale"] is None
    fp16 = rows["fp16"]
    assert fp16["scaler_skipped"] >= 1 and fp16["grad_scale"] < 2.0**40  # 2^40: overflows at first
    scales = [r["grad_scale"] for r in runs["fp16"]["history"] if r["kind"] == "train"]
    assert scales[0] == 2.0**39  # skipped, halved
    metrics = ch02_scale_up.precision_metrics(list(rows.values()))
    assert (
        metrics["fp16_scaler_skipped"] == fp16["scaler_skipped"]
        and "fp32_scaler_skipped" not in metrics
    )
    assert set(metrics) >= {"fp32_final_loss", "bf16_final_loss", "fp16_final_loss"}
    first = [next(iter(r["model"].parameters())) for r in runs.values()]
    assert not torch.equal(first[0], first[1])  # each model trained itself


def test_the_trainer_records_the_scale_and_resumes_the_count(shards, tmp_path):
    from ssmkit.train import Trainer

    cfg = tiny_cfg(shards, tmp_path, max_steps=2, precision="fp16", ckpt_every=1)
    trainer = Trainer(config=cfg)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    history = trainer.fit()
    assert [r["scaler_skipped"] for r in history if r["kind"] == "train"] == [1, 2]
    resumed = Trainer(config=tiny_cfg(shards, tmp_path, max_steps=3, precision="fp16"))
    assert resumed.resume()
    assert resumed.scaler_skipped == 2 and resumed.scaler.get_scale() == 2.0**38


# --- 2.4 and 2.5 ----------------------------------------------------------------------------------


def test_mixer_throughput_rows():
    rows = ch02_scale_up.mixer_throughput(
        [32], [8, 16], d_model=32, n_layer=1, headdim=16, chunk_size=16, steps=1, warmup=0
    )
    assert [(r["seq_len"], r["d_state"]) for r in rows] == [(32, 8), (32, 16)]
    for r in rows:
        # the ratio of the rates, each row's tok/s rounded to an integer: within what that rounding
        # moves
        m1, m2 = r["mamba1_tok_s"], r["mamba2_tok_s"]
        assert r["ratio"] == pytest.approx(m2 / m1, rel=0.5 / m1 + 0.5 / m2, abs=0.01)
        assert r["mamba1_params"] > 0 and r["mamba2_params"] > 0
    assert rows[1]["mamba1_params"] > rows[0]["mamba1_params"]  # a larger state: more weights


def test_mixer_throughput_times_mamba3_too():
    """With mixers=(..., "mamba3"): a Mamba-3 LM of the same width and depth (its size as built
    here) timed with the others, and its ratio to Mamba-2; unknown or repeated mixers are
    refused."""
    from ssmkit.models import ModelConfig, build_model

    rows = ch02_scale_up.mixer_throughput(
        [32],
        [8],
        d_model=32,
        n_layer=1,
        headdim=16,
        chunk_size=16,
        steps=1,
        warmup=0,
        mixers=("mamba1", "mamba2", "mamba3"),
    )
    row = rows[0]
    assert list(row) == [
        "seq_len",
        "d_state",
        "mamba1_tok_s",
        "mamba2_tok_s",
        "mamba3_tok_s",
        "ratio",
        "mamba3_ratio",
        "mamba1_params",
        "mamba2_params",
        "mamba3_params",
    ]
    assert row["mamba3_ratio"] == pytest.approx(row["mamba3_tok_s"] / row["mamba2_tok_s"], abs=0.01)
    m3 = ModelConfig(
        d_model=32, n_layer=1, vocab_size=257, mixer="mamba3", d_state=8, headdim=16, chunk_size=16
    )
    assert row["mamba3_params"] == build_model(m3).num_parameters()
    only = ch02_scale_up.mixer_throughput(
        [16], [8], d_model=32, n_layer=1, headdim=16, steps=1, warmup=0, mixers=["mamba3"]
    )
    assert set(only[0]) == {"seq_len", "d_state", "mamba3_tok_s", "mamba3_params"}
    for bad in (["mamba4"], [], ["mamba2", "mamba2"]):
        with pytest.raises(
            ValueError, match="is not valid; valid: distinct names of mamba1, mamba2, mamba3"
        ):
            ch02_scale_up.mixer_throughput([16], [8], mixers=bad)


def test_evaluate_models_on_the_offline_tasks(tmp_path):
    pytest.importorskip("lm_eval")
    from ssmkit.models import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=16, n_layer=1, vocab_size=257))
    rows, results = ch02_scale_up.evaluate_models(
        {"tiny one": model}, "offline", tokenizer="byte", limit=2, out_dir=tmp_path
    )
    tasks = {r["task"] for r in rows}
    assert tasks == {"ssmkit_docstring_cloze", "ssmkit_lastword"}
    acc = [r for r in rows if r["task"] == "ssmkit_docstring_cloze" and r["metric"] == "acc"]
    assert len(acc) == 1 and 0 <= acc[0]["value"] <= 1 and acc[0]["model"] == "tiny one"
    assert (tmp_path / "tiny_one" / "results.json").exists() and "tiny one" in results
    wide = ch02_scale_up.score_table(rows + [{**r, "model": "other"} for r in rows])
    assert len(wide) == len(rows) and all(
        set(r) == {"task", "metric", "tiny one", "other"} for r in wide
    )


# --- beyond: the sweep ----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "tiny-mamba3"])
def test_scaling_sweep_rows(shards, tmp_path, preset):
    cfg = tiny_cfg(shards, tmp_path, model=preset)
    rows = ch02_scale_up.scaling_sweep(
        cfg, [16, 32], 1024, shards / "train", shards / "val", out_dir=tmp_path / "sweep"
    )
    assert [r["d_model"] for r in rows] == [16, 32] and all(r["tokens"] == 1024 for r in rows)
    assert rows[0]["params"] < rows[1]["params"] and rows[0]["compute"] < rows[1]["compute"]
    assert all(r["compute"] == r["flops_per_token"] * 1024 and r["val_loss"] > 0 for r in rows)
    assert (tmp_path / "sweep" / "d32" / "config.yaml").exists()


# --- the notebook's parameters --------------------------------------------------------------------


def test_the_notebook_parameters_are_checked(tmp_path):
    def check_params(**changes):
        return check_parameters(ch02_scale_up, tmp_path, **changes)

    out = check_params(
        nproc=2,
        ssd_lengths="[256, 1024]",
        ssd_states=[16, 64],
        eval_tasks="offline",
        eval_limit=None,
        scaling_widths=[32, 64],
        scaling_tokens=2e4,
    )
    assert {
        k: out[k]
        for k in (
            "nproc",
            "ssd_lengths",
            "ssd_states",
            "eval_tasks",
            "eval_limit",
            "scaling_widths",
            "scaling_tokens",
        )
    } == {
        "nproc": 2,
        "ssd_lengths": [256, 1024],
        "ssd_states": [16, 64],
        "eval_tasks": "offline",
        "eval_limit": None,
        "scaling_widths": [32, 64],
        "scaling_tokens": 20000,
    }
    assert check_params(eval_tasks="hellaswag, piqa")["eval_tasks"] == ["hellaswag", "piqa"]
    assert check_params(eval_tasks=["arc_easy"], eval_limit="50")["eval_limit"] == 50
    assert check_params(eval_limit="none")["eval_limit"] is None
    for bad, match in (
        (dict(nproc=1), "nproc"),
        (dict(ssd_lengths=[1024, 256]), "ascending"),
        (dict(ssd_states=[]), "ssd_states"),
        (dict(eval_tasks=""), "eval_tasks"),
        (dict(eval_limit=0), "eval_limit"),
        (dict(scaling_widths=[4]), "scaling_widths"),
        (dict(scaling_tokens=0), "scaling_tokens"),
    ):
        with pytest.raises(WorkbookError, match=match):
            check_params(**bad)


def test_prepare_at_scale_replaces_only_what_it_wrote(tmp_path):
    """A directory with files prepare_at_scale did not write is refused and left as it was."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "thesis.txt").write_text("keep me")
    with pytest.raises(WorkbookError, match="did not write"):
        ch02_scale_up.prepare_at_scale("stdlib-docs", "byte", mine, max_tokens=2000, seq_len=64)
    assert (mine / "thesis.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1
