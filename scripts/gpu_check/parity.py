"""Section ``parity``: every op of ssmkit's ``torch`` backend on the device against the
``reference`` backend on the CPU in fp32: forward and the gradients of every input, small shapes and
odd lengths; fp32 (max error / max |reference| <= FP32_REL, TF32 off) and bf16 (the kernels' own
suites' tolerances, :mod:`ssmkit.ops.tolerances`); the max error of each tensor and pass / fail.

A case: make(low) -> (inputs on the CPU, names of the activations cast to ``low``), call(inputs,
backend) -> a tuple of named outputs, the names of the inputs whose gradients are checked, and the
bf16 tolerance of each output and gradient. fp32: max |ours - ref| / max |ref| <= FP32_REL for
every tensor. bf16: as the kernels' suites (tests/unit/ops/test_low_precision.py): "elem"
|ours - ref| <= atol + rtol |ref| elementwise with ref rounded to the tensor's dtype; "scale" the
same with atol x max |ref| (fp32 parameters whose gradient is a sum over every position); "norm"
|ours - ref| <= NORM_PT |plain bf16 PyTorch - ref| + NORM_ATOL (layernorm_gated).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ssmkit import ops
from ssmkit.ops import tolerances

from .context import Context, no_tf32, rand, randn, rng

# The bf16 specs (kind, rtol, atol), from the suites' tolerances for bf16 inputs.
FP32_REL = tolerances.FP32_REL
_BF16_SCAN = tolerances.SCAN[torch.bfloat16]
_BF16_WEIGHT = tolerances.scan_weight(torch.bfloat16)
SCAN = ("elem", *_BF16_SCAN)  # selective_scan's output and state
SCAN_X2 = ("elem", *tolerances.scaled(_BF16_SCAN, tolerances.SCAN_DU))  # du, dx, dB, dC (x2)
SCAN_DT = ("elem", *tolerances.scaled(_BF16_SCAN, tolerances.SCAN_DDELTA))  # ddelta, ddt
SCAN_DA = ("elem", _BF16_WEIGHT[0], tolerances.SCAN_DA_ATOL * _BF16_WEIGHT[1])  # the S6's dA
PARAM_SUM = ("scale", *tolerances.SSD_PARAM)  # fp32 parameters' gradients: sums over positions
CONV = ("elem", *tolerances.CONV[torch.bfloat16])  # causal-conv1d's output and dx
CONV_W = ("elem", *tolerances.CONV_WEIGHT)  # its dweight, dbias (fp32, either dtype)
NORM = ("norm", tolerances.NORM_PT, tolerances.NORM_ATOL)


def _cast(inputs: dict, low_names: set, low: torch.dtype) -> dict:
    return {k: (v.to(low) if k in low_names and v is not None else v) for k, v in inputs.items()}


def _s6_case(groups: int, init: bool):
    b, d, n, L = 2, 8, 8, 129  # 129: two chunks of the torch path's 64 steps and one of 1

    def make(low):
        g = rng(10 + groups)
        bc = (b, n, L) if groups == 1 else (b, groups, n, L)
        inp = dict(
            u=randn(g, b, d, L),
            delta=0.5 * rand(g, b, d, L),
            A=-0.5 * rand(g, d, n),
            B=randn(g, *bc),
            C=randn(g, *bc),
            D=randn(g, d),
            z=randn(g, b, d, L),
            delta_bias=0.5 * rand(g, d),
        )
        if init:
            inp["initial_state"] = randn(g, b, d, n)
        return _cast(inp, {"u", "delta", "B", "C", "z"}, low)

    def call(t, backend):
        y, h = ops.selective_scan(
            **t, delta_softplus=True, return_final_state=True, backend=backend
        )
        return {"y": y, "h": h}

    tol = {
        "y": SCAN,
        "h": SCAN,
        "du": SCAN_X2,
        "ddelta": SCAN_DT,
        "dA": SCAN_DA,
        "dB": SCAN,
        "dC": SCAN,
        "dD": SCAN,
        "dz": SCAN,
        "ddelta_bias": SCAN,
        "dinitial_state": SCAN,
    }
    return make, call, tol


def _ssd_case(ngroups: int, init: bool):
    b, L, h, p, n, chunk = 2, 77, 4, 8, 16, 32  # 77: three chunks of 32 on a GPU (of 64 on a CPU)

    def make(low):
        g = rng(20 + ngroups)
        inp = dict(
            x=randn(g, b, L, h, p),
            dt=randn(g, b, L, h) - 2,
            A=-rand(g, h) - 0.5,
            B=randn(g, b, L, ngroups, n) / 5,
            C=randn(g, b, L, ngroups, n) / 5,
            D=randn(g, h, p) if init else randn(g, h),
            z=randn(g, b, L, h, p),
            dt_bias=rand(g, h) - 2,
        )
        if init:
            inp["initial_states"] = randn(g, b, h, p, n)
        return _cast(inp, {"x", "dt", "B", "C", "z"}, low)

    def call(t, backend):
        y, hf = ops.ssd_scan(
            **t, chunk_size=chunk, dt_softplus=True, return_final_states=True, backend=backend
        )
        return {"y": y, "h": hf}

    tol = {
        "y": SCAN,
        "h": SCAN,
        "dx": SCAN_X2,
        "dB": SCAN_X2,
        "dC": SCAN_X2,
        "dz": SCAN_X2,
        "ddt": SCAN_DT,
        "dA": PARAM_SUM,
        "dD": PARAM_SUM,
        "ddt_bias": PARAM_SUM,
        "dinitial_states": SCAN,
    }
    return make, call, tol


def _conv_case(channels_last: bool):
    b, d, L, w = 2, 16, 37, 4

    def make(low):
        g = rng(30)
        x = randn(g, b, L, d).transpose(1, 2) if channels_last else randn(g, b, d, L)
        return _cast(dict(x=x, weight=randn(g, d, w), bias=randn(g, d)), {"x"}, low)

    def call(t, backend):
        return {
            "y": ops.causal_conv1d(
                t["x"], t["weight"], t["bias"], activation="silu", backend=backend
            )
        }

    return make, call, {"y": CONV, "dx": CONV, "dweight": CONV_W, "dbias": CONV_W}


def _conv_update_case():
    b, d, w = 2, 16, 4

    def make(low):
        g = rng(31)
        inp = dict(
            x=randn(g, b, d), conv_state=randn(g, b, d, w), weight=randn(g, d, w), bias=randn(g, d)
        )
        return _cast(inp, {"x", "conv_state"}, low)

    def call(t, backend):
        state = t["conv_state"].clone()
        y = ops.causal_conv1d_update(
            t["x"], state, t["weight"], t["bias"], activation="silu", backend=backend
        )
        return {"y": y, "state": state}

    return (
        make,
        call,
        {
            "y": CONV,
            "state": CONV,
            "dx": CONV,
            "dconv_state": CONV,
            "dweight": CONV_W,
            "dbias": CONV_W,
        },
    )


def _step1_case():
    """selective_state_update, Mamba-1 layout: state (batch, dim, dstate)."""
    b, d, n = 2, 8, 8

    def make(low):
        g = rng(40)
        inp = dict(
            state=randn(g, b, d, n),
            x=randn(g, b, d),
            dt=randn(g, b, d) - 1,
            A=-rand(g, d, n) - 0.1,
            B=randn(g, b, n),
            C=randn(g, b, n),
            D=randn(g, d),
            z=randn(g, b, d),
            dt_bias=rand(g, d) - 1,
        )
        return _cast(inp, {"x", "dt", "B", "C", "z"}, low)

    def call(t, backend):
        state = t["state"].clone()
        args = {k: v for k, v in t.items() if k != "state"}
        y = ops.selective_state_update(state, **args, dt_softplus=True, backend=backend)
        return {"y": y, "state": state}

    tol = {
        "y": SCAN,
        "state": SCAN,
        "dstate": SCAN,
        "dx": SCAN_X2,
        "dB": SCAN_X2,
        "dC": SCAN_X2,
        "dz": SCAN_X2,
        "ddt": SCAN_DT,
        "dA": PARAM_SUM,
        "dD": PARAM_SUM,
        "ddt_bias": PARAM_SUM,
    }
    return make, call, tol


def _step2_case():
    """selective_state_update, Mamba-2 layout as the mixer passes it: A, dt, D, dt_bias per head,
    broadcast over headdim (and dstate)."""
    b, h, p, n, gr = 2, 4, 8, 16, 2

    def make(low):
        g = rng(41)
        inp = dict(
            state=randn(g, b, h, p, n),
            x=randn(g, b, h, p),
            dt=randn(g, b, h) - 1,
            A=-rand(g, h) - 0.5,
            B=randn(g, b, gr, n),
            C=randn(g, b, gr, n),
            D=randn(g, h),
            z=randn(g, b, h, p),
            dt_bias=rand(g, h) - 1,
        )
        return _cast(inp, {"x", "dt", "B", "C", "z"}, low)

    def call(t, backend):
        state = t["state"].clone()
        y = ops.selective_state_update(
            state,
            t["x"],
            t["dt"][..., None].expand(b, h, p),
            t["A"][:, None, None].expand(h, p, n),
            t["B"],
            t["C"],
            D=t["D"][:, None].expand(h, p),
            z=t["z"],
            dt_bias=t["dt_bias"][:, None].expand(h, p),
            dt_softplus=True,
            backend=backend,
        )
        return {"y": y, "state": state}

    tol = {
        "y": SCAN,
        "state": SCAN,
        "dstate": SCAN,
        "dx": SCAN_X2,
        "dB": SCAN_X2,
        "dC": SCAN_X2,
        "dz": SCAN_X2,
        "ddt": SCAN_DT,
        "dA": PARAM_SUM,
        "dD": PARAM_SUM,
        "ddt_bias": PARAM_SUM,
    }
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
        g = rng(50)
        inp = dict(x=randn(g, *shape), weight=randn(g, d))
        if gated:
            inp["z"] = randn(g, *shape)
        return _cast(inp, {"x", "z"}, low)

    def call(t, backend):
        if backend == "plain":  # the "pt" side of the norm rule
            return {
                "y": _plain_norm(
                    t["x"], t["weight"].to(t["x"].dtype), t.get("z"), group_size, norm_before_gate
                )
            }
        if not gated:
            return {"y": ops.rms_norm(t["x"], t["weight"], eps=1e-5, backend=backend)}
        return {
            "y": ops.rms_norm_gated(
                t["x"],
                t["weight"],
                t["z"],
                eps=1e-5,
                group_size=group_size,
                norm_before_gate=norm_before_gate,
                backend=backend,
            )
        }

    return make, call, {"y": NORM, "dx": NORM, "dweight": NORM, "dz": NORM}


def _mamba3_case(rank: int):
    """Mamba-3's scan (SISO rank 1, MIMO rank > 1), with the shapes of
    tests/unit/ops/test_cuda_dispatch.py."""
    b, L, h, p, gr, n, S = 2, 19, 4, 3, 2, 8, 2
    mimo = rank > 1

    def make(low):
        g = rng(60 + rank)
        inp = dict(
            x=randn(g, b, L, h, p),
            dt=randn(g, b, L, h).abs() + 0.1,
            A=-randn(g, b, L, h).abs() - 0.1,
            trap=randn(g, b, L, h),
            B=randn(g, b, L, rank, gr, n),
            C=randn(g, b, L, rank, gr, n),
            angles=randn(g, b, L, h, S),
            B_bias=randn(g, h, rank, n),
            C_bias=randn(g, h, rank, n),
            D=randn(g, h),
            z=randn(g, b, L, h, p),
        )
        if mimo:
            inp.update(
                mimo_x=randn(g, h, rank, p),
                mimo_z=randn(g, h, rank, p),
                mimo_o=randn(g, h, rank, p),
            )
        return _cast(inp, {"x", "dt", "A", "trap", "B", "C", "angles", "z"}, low)

    def call(t, backend):
        return {"y": ops.mamba3_scan(**t, chunk_size=8, backend=backend)}

    tol = {
        "y": SCAN,
        "dx": SCAN_X2,
        "dB": SCAN_X2,
        "dC": SCAN_X2,
        "dz": SCAN_X2,
        "dangles": SCAN_DT,
        "ddt": SCAN_DT,
        "dA": SCAN_DT,
        "dtrap": SCAN_DT,
        "dB_bias": PARAM_SUM,
        "dC_bias": PARAM_SUM,
        "dD": PARAM_SUM,
        "dmimo_x": PARAM_SUM,
        "dmimo_z": PARAM_SUM,
        "dmimo_o": PARAM_SUM,
    }
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
    """The S6 and SSD cases again with ``ops.compile_scan(True)`` on the torch backend (Triton on a
    GPU). Run on CUDA only: on CPU tests/unit/ops/test_compiled_scan.py checks the same and the
    compiles cost CI time."""

    def compiled(make, call, tol):
        def call_compiled(t, backend):
            if backend != "torch":
                return call(t, backend)
            # the choice is made in forward; backward follows the graph it built
            ops.compile_scan(True)
            try:
                return call(t, backend)
            finally:
                ops.compile_scan(False)

        return make, call_compiled, tol

    return {
        "selective_scan/compiled": (*compiled(*_s6_case(2, True)), False),
        "ssd_scan/compiled": (*compiled(*_ssd_case(2, True)), False),
    }


def _run(
    call, inputs: dict, backend: str, device, grad_names, grad_outs: dict | None, forward_only: bool
):
    """Leaves on ``device`` (gradients for ``grad_names``), the outputs, and the gradients after
    backward with ``grad_outs`` (made here, seeded, in each output's dtype, when None). Returns
    (outs, grads, grad_outs)."""
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
        g = rng(99)
        grad_outs = {k: randn(g, *o.shape).to(o.dtype) for k, o in outs.items()}
    grads = {}
    if not forward_only:
        pairs = [(o, grad_outs[k]) for k, o in outs.items() if o.requires_grad]
        torch.autograd.backward(
            [o for o, _ in pairs], [gr.to(o.device, o.dtype) for o, gr in pairs]
        )
        grads = {f"d{k}": t.grad for k, t in leaves.items() if t.grad is not None}
    return (
        {k: o.detach().cpu() for k, o in outs.items()},
        {k: v.detach().cpu() for k, v in grads.items()},
        grad_outs,
    )


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
    ok = (
        all(math.isfinite(t["ratio"]) and t["ratio"] <= 1 for t in tensors.values()) and not missing
    )
    spec = tol.get(worst, SCAN)
    worst_tol = (
        f"max|ours-ref| <= {FP32_REL} max|ref|"
        if not low
        else f"|ours-ref| <= {spec[1]}*|pt-ref| + {spec[2]}"
        if spec[0] == "norm"
        else f"|ours-ref| <= {spec[2]}{'*max|ref|' if spec[0] == 'scale' else ''} + {spec[1]}*|ref|"
    )
    return {
        "pass": ok,
        "worst": worst,
        "worst_ratio": tensors[worst]["ratio"],
        "worst_tolerance": worst_tol,
        "tensors": tensors,
        **({"missing_grads": missing} if missing else {}),
    }


def run(ctx: Context) -> dict:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    results, failed = {}, []
    cases = {**parity_cases(), **(compiled_cases() if ctx.device.type == "cuda" else {})}
    for name, (make, call, tol, forward_only) in cases.items():
        results[name] = {}
        for dname, dtype in dtypes.items():
            try:
                with no_tf32() if dtype == torch.float32 else contextlib.nullcontext():
                    r = run_parity_case(make, call, tol, forward_only, dtype, ctx.device)
            except Exception as exc:
                r = {"pass": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
            results[name][dname] = r
            if not r["pass"]:
                failed.append(f"{name}/{dname}")
            shown = (
                f"worst {r['worst']} at {r['worst_ratio']:.3g} of its tolerance"
                if "worst" in r
                else r.get("error", "")
            )
            ctx.log(f"  {'PASS' if r['pass'] else 'FAIL'} {name:<44} {dname}  {shown}")
    return {
        "pass": not failed,
        "failed": failed,
        "device": str(ctx.device),
        "oracle": "reference backend, CPU",
        "tolerance": {
            "fp32": f"max|ours-ref| <= {FP32_REL} max|ref|, TF32 off",
            "bf16": "the kernels' suites (tests/unit/ops/test_low_precision.py); ratio <= 1 passes",
        },
        "cases": results,
    }
