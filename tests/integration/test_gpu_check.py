"""scripts/gpu_check.py on a CPU: the script a lent GPU runs, exercised with its GPU parts skipped.

One subprocess runs ``--quick --device cpu`` end to end (the command line, the JSON last line,
--out); the flags and a deliberately failing section are checked by calling the check's ``main``
(the package scripts/gpu_check/, one module per section) in this process.
The oracles: parity's own reference backend, transformers' models loaded from ssmkit's weights
(equal logits), and tensors perturbed on purpose (the parity check must then fail).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.py"  # the command; the check is scripts/gpu_check/
SECTIONS = ["env", "parity", "kernels", "train_step", "generation", "notebook"]
NO_CUDA = "skipped: no CUDA device"


@pytest.fixture(scope="module")
def gpu_check():
    """The package scripts/gpu_check/, imported as the command imports it (it sets HF_HUB_OFFLINE=1
    when imported: restored afterwards)."""
    saved, path = os.environ.get("HF_HUB_OFFLINE"), list(sys.path)
    sys.path.insert(0, str(SCRIPT.parent))
    module = importlib.import_module("gpu_check")
    for section in ("context", "parity", "kernels", "notebook"):
        importlib.import_module(f"gpu_check.{section}")
    yield module
    sys.path[:] = path
    if saved is None:
        os.environ.pop("HF_HUB_OFFLINE", None)
    else:
        os.environ["HF_HUB_OFFLINE"] = saved


@pytest.fixture
def one_thread():
    """One torch thread (tiny ops on a busy shared CPU: threads only wait on each other), restored
    after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_main(module, argv, capsys):
    """main(argv) in this process: (exit code, the JSON last line, the other stdout lines)."""
    threads = torch.get_num_threads()
    try:
        code = module.main(argv)
    finally:
        torch.set_num_threads(threads)  # --quick on a CPU sets one thread
    lines = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(lines[-1]), lines[:-1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``gpu_check.py --quick --device cpu --out FILE``, once, in a subprocess."""
    out = tmp_path_factory.mktemp("gpu_check") / "summary.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("SSMKIT_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return proc, json.loads(lines[-1]), lines, out


def test_quick_cpu_run_prints_one_json_summary_last(quick_run):
    proc, summary, lines, out = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["ok"] is True and summary["failed"] == [] and summary["partial"] is False
    assert summary["device"] == "cpu" and summary["quick"] is True
    assert list(summary["sections"]) == SECTIONS and list(summary["status"]) == SECTIONS
    assert json.loads(out.read_text()) == summary  # --out: the same JSON
    assert any(
        "scripts/gpu_check.py" in line for line in lines[:-1]
    )  # the command for a lent device ...
    assert any(
        "estimated seconds per section" in line for line in lines[:-1]
    )  # ... and the estimates
    for name in SECTIONS:
        assert summary["sections"][name]["status"] == summary["status"][name]


def test_quick_cpu_run_skips_the_gpu_only_sections_and_says_so(quick_run):
    _, summary, lines, _ = quick_run
    for name in ("kernels", "notebook"):
        assert summary["status"][name] == NO_CUDA
        assert any(f"[{name}] {NO_CUDA}" in line for line in lines)
    for name in ("env", "parity", "train_step", "generation"):
        assert summary["status"][name] == "ok", summary["sections"][name]


def test_quick_cpu_env(quick_run):
    env = quick_run[1]["sections"]["env"]
    assert (
        env["torch"] == torch.__version__ and env["cuda_available"] is False and env["gpu"] is None
    )
    assert env["mamba_ssm"].startswith("not checked") and env["causal_conv1d"].startswith(
        "not checked"
    )
    assert {"selective_scan", "ssd_scan", "causal_conv1d", "rms_norm_gated"} <= set(env["backends"])
    # on CPU: the torch paths, and Mamba-1's scan on the fused CPU kernel where it builds
    fused = env["backends"].pop("selective_scan")
    assert fused.startswith(("cpu", "torch")), fused
    assert all(b.startswith("torch") for b in env["backends"].values())
    assert env["hf_hub_offline"] == "1"


def test_quick_cpu_parity_covers_every_op_fwd_and_bwd_within_tolerance(quick_run):
    parity = quick_run[1]["sections"]["parity"]
    assert parity["pass"] is True and parity["failed"] == []
    ops = {name.split("/")[0] for name in parity["cases"]}
    assert {
        "selective_scan",
        "ssd_scan",
        "causal_conv1d",
        "causal_conv1d_update",
        "selective_state_update",
        "rms_norm",
        "rms_norm_gated",
    } <= ops
    for name, by_dtype in parity["cases"].items():
        assert set(by_dtype) == {"fp32", "bf16"}, name
        for dtype, r in by_dtype.items():
            assert r["pass"] is True and r["worst_ratio"] <= 1, (name, dtype, r)
            assert all(t["ratio"] <= 1 for t in r["tensors"].values()), (name, dtype)
            if not name.endswith("/inference"):  # every input's gradient was compared
                assert any(k.startswith("d") for k in r["tensors"]), (name, dtype)
    s6 = parity["cases"]["selective_scan"]["fp32"]["tensors"]
    assert {"y", "h", "du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"} <= set(s6)


def test_quick_cpu_train_step_numbers_are_sane(quick_run):
    ts = quick_run[1]["sections"]["train_step"]
    assert set(ts["models"]) == {
        "ssmkit_mamba1",
        "hf_mamba1",
        "ssmkit_mamba2",
        "hf_mamba2",
        "llama",
    }
    for name, row in ts["models"].items():
        assert row["tokens_per_s"] > 0 and row["step_s"] > 0 and row["timed_steps"] >= 1, name
        assert row["mfu"] is None  # no peak FLOP/s known for a CPU
        assert row["loss"] is not None and 0 < row["loss"] < 20, name
    # transformers' models hold ssmkit's weights: the same logits (save_pretrained(format="hf")
    # round trip)
    assert all(diff < 1e-4 for diff in ts["same_weights_max_rel_logit_diff"].values()), ts
    assert set(ts["ratios"]) == {
        "ssmkit_mamba1_vs_hf_mamba1",
        "ssmkit_mamba2_vs_hf_mamba2",
        "ssmkit_mamba1_vs_llama",
        "ssmkit_mamba2_vs_llama",
    }
    assert all(v > 0 for v in ts["ratios"].values())
    assert ts["params"]["ssmkit_mamba1"]["params"] == ts["params"]["hf_mamba1"]["params"]


def test_quick_cpu_generation_numbers_are_sane(quick_run):
    gen = quick_run[1]["sections"]["generation"]
    assert len(gen["cells"]) == 4
    for cell in gen["cells"]:
        for name in ("ssmkit_mamba1", "ssmkit_mamba2", "llama"):
            assert cell[name]["decode_tokens_per_s"] > 0 and cell[name]["prefill_s"] > 0, cell
            assert cell[name]["cache_mb"] > 0
        assert cell["ssmkit_mamba1_decode_vs_llama"] > 0
    # the SSMs' caches do not grow with the prompt; the Llama's KV cache does
    short, long = gen["cells"][0], gen["cells"][2]
    assert short["batch"] == long["batch"] and short["prompt_len"] < long["prompt_len"]
    assert long["ssmkit_mamba1"]["cache_mb"] == short["ssmkit_mamba1"]["cache_mb"]
    assert long["llama"]["cache_mb"] > short["llama"]["cache_mb"]


def test_only_and_json_only(gpu_check, capsys):
    argv = ["--quick", "--device", "cpu", "--only", "env", "--json-only"]
    code, summary, others = run_main(gpu_check, argv, capsys)
    assert code == 0 and others == []  # --json-only: the JSON line alone
    assert summary["status"]["env"] == "ok"
    for name in SECTIONS[1:]:
        assert summary["status"][name] == "skipped: not selected (--only env)"


def test_skip(gpu_check, capsys):
    code, summary, others = run_main(
        gpu_check, ["--quick", "--device", "cpu", "--skip", "parity,train_step,generation"], capsys
    )
    assert code == 0 and others  # the human lines before the JSON
    assert summary["status"]["env"] == "ok"
    assert summary["status"]["kernels"] == summary["status"]["notebook"] == NO_CUDA
    for name in ("parity", "train_step", "generation"):
        assert (
            summary["status"][name] == "skipped: not selected (--skip parity,train_step,generation)"
        )


def test_time_budget_skips_the_sections_that_would_start_after_it(gpu_check, capsys):
    code, summary, others = run_main(
        gpu_check, ["--quick", "--device", "cpu", "--time-budget", "0"], capsys
    )
    assert code == 0
    assert summary["status"]["env"] == "ok"  # env always runs (under a second)
    for name in SECTIONS[1:]:
        assert summary["status"][name].startswith("skipped: time budget of 0 s spent"), summary[
            "status"
        ]
    assert any("[parity] skipped: time budget" in line for line in others)


def test_a_failing_section_is_recorded_as_error_and_the_others_still_run(
    gpu_check, capsys, monkeypatch, one_thread
):
    def broken(ctx):
        raise RuntimeError("injected fault")

    monkeypatch.setitem(gpu_check.SECTIONS, "env", broken)
    argv = ["--quick", "--device", "cpu", "--only", "env,parity,kernels"]
    code, summary, others = run_main(gpu_check, argv, capsys)
    assert code == 1 and summary["ok"] is False and summary["failed"] == ["env"]
    env = summary["sections"]["env"]
    assert env["status"] == "error" and env["error"] == "RuntimeError: injected fault"
    assert any("injected fault" in line for line in env["traceback"])
    assert summary["status"]["parity"] == "ok" and summary["sections"]["parity"]["pass"] is True
    assert summary["status"]["kernels"] == NO_CUDA
    assert any(line.startswith("FAILED: env") for line in others)


def test_out_file_holds_the_sections_done_when_the_run_is_stopped(
    gpu_check, capsys, monkeypatch, tmp_path, one_thread
):
    """--out is rewritten after every section: a run killed from outside (the device's time limit)
    still leaves what it measured, the sections it did not reach marked so."""

    def stopped(ctx):
        raise KeyboardInterrupt

    monkeypatch.setitem(gpu_check.SECTIONS, "train_step", stopped)
    out = tmp_path / "partial.json"
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(
            ["--quick", "--device", "cpu", "--only", "env,kernels,train_step", "--out", str(out)]
        )
    summary = json.loads(out.read_text())
    assert summary["partial"] is True and summary["ok"] is False
    assert summary["status"]["env"] == "ok" and summary["status"]["kernels"] == NO_CUDA
    for name in ("train_step", "generation", "notebook"):
        assert summary["status"][name] == "not reached (the run was stopped)"
    assert list(summary["sections"]) == SECTIONS


def test_parity_check_fails_on_a_wrong_result(gpu_check, one_thread):
    """The checker must catch an output off by 1% (fp32; 10% in bf16, whose tolerance is 1% + 0.05)
    and a weight gradient off by 2% (a test that cannot fail is a defect); the same case passes
    unperturbed."""
    make, call, tol = gpu_check.parity._conv_case(False)
    factor = {}

    def wrong_output(t, backend):
        out = call(t, backend)
        return {"y": out["y"] * factor["y"]} if backend == "torch" else out

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.02

    def wrong_weight_grad(t, backend):
        if backend == "torch":
            t = {**t, "weight": Scale.apply(t["weight"])}
        return call(t, backend)

    for dtype in (torch.float32, torch.bfloat16):
        factor["y"] = 1.01 if dtype == torch.float32 else 1.1
        run_case = gpu_check.parity.run_parity_case
        assert run_case(make, call, tol, False, dtype, "cpu")["pass"] is True
        bad = run_case(make, wrong_output, tol, False, dtype, "cpu")
        assert bad["pass"] is False and bad["tensors"]["y"]["ratio"] > 1
        bad = run_case(make, wrong_weight_grad, tol, False, dtype, "cpu")
        assert (
            bad["pass"] is False and bad["worst"] == "dweight" and bad["tensors"]["y"]["ratio"] <= 1
        )


def fake_kernels(conv_scale: float = 1.0) -> dict:
    """Stand-ins for mamba_ssm / causal_conv1d, under their module paths and with their signatures,
    computing with ssmkit's torch backend (``conv_scale``: a wrong causal_conv1d_fn, which parity
    must catch)."""
    from ssmkit import ops

    def selective_scan_fn(
        u,
        delta,
        A,
        B,
        C,
        D=None,
        z=None,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=False,
    ):
        return ops.selective_scan(
            u,
            delta,
            A,
            B,
            C,
            D=D,
            z=z,
            delta_bias=delta_bias,
            delta_softplus=delta_softplus,
            return_final_state=return_last_state,
            backend="torch",
        )

    def selective_state_update(
        state,
        x,
        dt,
        A,
        B,
        C,
        D=None,
        z=None,
        dt_bias=None,
        dt_softplus=False,
        state_batch_indices=None,
    ):
        return ops.selective_state_update(
            state,
            x,
            dt,
            A,
            B,
            C,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
            backend="torch",
        )

    def mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        initial_states=None,
        seq_idx=None,
        cu_seqlens=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        return_varlen_states=False,
    ):
        return ops.ssd_scan(
            x,
            dt,
            A,
            B,
            C,
            chunk_size,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
            initial_states=initial_states,
            return_final_states=return_final_states,
            dt_limit=dt_limit,
            backend="torch",
        )

    def causal_conv1d_fn(
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        return ops.causal_conv1d(x, weight, bias, activation, backend="torch") * conv_scale

    def causal_conv1d_update(
        x,
        conv_state,
        weight,
        bias=None,
        activation=None,
        cache_seqlens=None,
        conv_state_indices=None,
    ):
        return ops.causal_conv1d_update(x, conv_state, weight, bias, activation, backend="torch")

    def rms_norm_fn(
        x,
        weight,
        bias,
        residual=None,
        x1=None,
        weight1=None,
        bias1=None,
        eps=1e-6,
        dropout_p=0.0,
        rowscale=None,
        prenorm=False,
        residual_in_fp32=False,
        return_dropout_mask=False,
    ):
        return ops.rms_norm(x, weight, eps=eps, backend="torch")

    def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
        return ops.rms_norm_gated(
            x,
            weight,
            z,
            eps=eps,
            group_size=group_size,
            norm_before_gate=norm_before_gate,
            backend="torch",
        )

    return {
        "mamba_ssm.ops.selective_scan_interface": {"selective_scan_fn": selective_scan_fn},
        "mamba_ssm.ops.triton.selective_state_update": {
            "selective_state_update": selective_state_update
        },
        "mamba_ssm.ops.triton.ssd_combined": {
            "mamba_chunk_scan_combined": mamba_chunk_scan_combined
        },
        "causal_conv1d": {
            "causal_conv1d_fn": causal_conv1d_fn,
            "causal_conv1d_update": causal_conv1d_update,
        },
        "mamba_ssm.ops.triton.layer_norm": {"rms_norm_fn": rms_norm_fn},
        "mamba_ssm.ops.triton.layernorm_gated": {"rmsnorm_fn": rmsnorm_fn},
    }


@pytest.mark.parametrize("conv_scale", [1.0, 1.01])
def test_kernels_section_code_with_fake_kernels(gpu_check, monkeypatch, conv_scale, one_thread):
    """The kernels section's parity and timing code (GPU-only in the script) on CPU tensors, with
    fake kernel modules standing in for mamba_ssm / causal_conv1d and the dispatcher routed to them
    as if on CUDA: every op is called with the arguments it takes, and a wrong kernel fails
    parity."""
    import types

    from ssmkit.ops import backend

    for module, fns in fake_kernels(conv_scale).items():
        fake = types.ModuleType(module)
        for name, fn in fns.items():
            setattr(fake, name, fn)
        monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
    ctx = gpu_check.context.Context(torch.device("cpu"), True, 60, "fp32", lambda *a: None)
    usable = {
        "selective_scan",
        "ssd_scan",
        "causal_conv1d",
        "causal_conv1d_update",
        "rms_norm",
        "rms_norm_gated",
        "selective_state_update",
    }
    result = gpu_check.kernels.kernel_rows(ctx, usable, {})
    rows = result["ops"]
    assert {r.get("status") for r in rows.values()} == {"ok"}, rows
    for name, row in rows.items():
        assert row["ms"]["torch"] > 0 and row["ms"]["cuda"] > 0 and row["torch_over_cuda"] > 0
        assert row["what"] == (
            "fwd"
            if name in ("selective_state_update/mamba2", "causal_conv1d_update")
            else "fwd+bwd"
        )
        if row["what"] == "fwd+bwd":  # every input's gradient compared
            assert len(row["parity"]["max_rel"]) > 2, (name, row["parity"])
    conv = [n for n in rows if n.startswith("causal_conv1d/")]
    if conv_scale == 1.0:
        assert result["pass"] is True and all(r["parity"]["pass"] for r in rows.values())
    else:
        assert result["pass"] is False and sorted(result["failed"]) == sorted(conv)
    skipped = gpu_check.kernels.kernel_rows(
        ctx, usable - {"ssd_scan"}, {"ssd_scan": "import failed: no triton"}
    )
    assert skipped["ops"]["ssd_scan"] == {"status": "skipped: import failed: no triton"}


def test_bad_arguments_are_refused(gpu_check, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--only", "env,nonsense"])
    assert exc.value.code == 2 and "nonsense" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "env", "--skip", "parity"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--device", "cuda"])
        assert "CUDA is not available" in capsys.readouterr().err


def test_notebook_command_is_accepted_offline_and_short(gpu_check, tmp_path):
    """The notebook section's command, routed as ``ssmkit workbook run`` routes it and built into
    the TrainConfig notebook 01 builds (its first cell's calls), without running it:
    params/gpu-a100.yaml's 130M bf16 recipe, but the offline corpus and 30 steps of 8 x 2048
    tokens."""
    from ssmkit.checks import parse_value
    from ssmkit.workbook import train_config
    from ssmkit.workbook.chapters import ch01_prototype
    from ssmkit.workbook.notebooks import declared_parameters, load_params_file
    from ssmkit.workbook.params import route_parameters, workbook_parameters

    section = gpu_check.notebook
    cmd, params = section.notebook_command("cpu", tmp_path / "run", quick=False, cell_timeout=600)
    assert cmd[1:5] == ["-m", "ssmkit.cli", "workbook", "run"] and "--out" in cmd
    notebook = ROOT / section.NOTEBOOK
    shared = load_params_file(ROOT / section.PARAMS_FILE)
    assert (
        shared["data"] != "stdlib-docs" and params["data"] == "stdlib-docs"
    )  # the file's needs the hub
    explicit = {k: parse_value(str(v)) for k, v in params.items()}
    declared = declared_parameters(notebook)
    values, _ = route_parameters({notebook: declared}, explicit, shared, workbook_parameters())
    given = {**declared, **values[notebook], "out_dir": str(tmp_path / "nb")}
    p = ch01_prototype.PARAMETERS.check(given)
    cfg = train_config(
        p["config"],
        data=p["data"],
        tokenizer=p["tokenizer"],
        max_tokens=p["max_tokens"],
        device=p["device"],
        precision=p["precision"],
        seed=p["seed"],
        evals=p["evals"],
        out_dir=str(p["out_dir"] / "mamba"),
        overwrite=True,
        **p["overrides"],
    )
    assert cfg.model == "mamba-130m" and cfg.precision == "bf16" and cfg.seq_len == 2048
    assert cfg.total_steps() == 30 and cfg.grad_accum(1) == 1 and cfg.micro_batch == 8
    assert cfg.data == "stdlib-docs" and cfg.tokenizer in ("gpt2", "byte")
