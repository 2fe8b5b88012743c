"""Section ``kernels`` (CUDA, when mamba_ssm / causal_conv1d import): their ops (backend "cuda")
against ssmkit's torch backend on the same GPU: parity (fwd/bwd, fp32) and speed (median fwd+bwd
ms, ratio) at realistic shapes (Mamba-1 130M: batch 8 x 2048, d_inner 1536; Mamba-2 130M's SSD)."""

from __future__ import annotations

import statistics

import torch

from ssmkit import ops

from .context import NO_CUDA, Context, free, max_rel, rand, randn, rng


def _kernel_shapes(quick: bool) -> dict:
    if quick:
        return dict(b=2, L=256, d=256, n=16, h=8, p=32, n2=64, chunk=64, dm=128)
    # Mamba-1 130M: d_model 768, d_inner 1536, d_state 16; Mamba-2 130M: 24 heads of 64,
    # d_state 128, chunk 256
    return dict(b=8, L=2048, d=1536, n=16, h=24, p=64, n2=128, chunk=256, dm=768)


def _kernel_ops(s: dict, dtype: torch.dtype, device) -> dict:
    """op -> (kernel module's op name, inputs factory, call(inputs, backend) -> output, decode
    step?)."""
    b, L, d, n, h, p, n2, dm = s["b"], s["L"], s["d"], s["n"], s["h"], s["p"], s["n2"], s["dm"]
    g = rng(70)

    def dev(t, low=True):
        return (t.to(dtype) if low else t).to(device)

    def s6():
        return dict(
            u=dev(randn(g, b, d, L)),
            delta=dev(0.5 * rand(g, b, d, L)),
            A=dev(-rand(g, d, n), False),
            B=dev(randn(g, b, n, L)),
            C=dev(randn(g, b, n, L)),
            D=dev(randn(g, d), False),
            z=dev(randn(g, b, d, L)),
            delta_bias=dev(rand(g, d), False),
        )

    def ssd():
        return dict(
            x=dev(randn(g, b, L, h, p)),
            dt=dev(randn(g, b, L, h) - 2),
            A=dev(-rand(g, h) - 0.5, False),
            B=dev(randn(g, b, L, 1, n2) / 5),
            C=dev(randn(g, b, L, 1, n2) / 5),
            D=dev(randn(g, h), False),
            dt_bias=dev(rand(g, h) - 2, False),
        )

    def conv(width):
        return lambda: dict(
            x=dev(randn(g, b, width, L)),
            weight=dev(randn(g, width, 4), False),
            bias=dev(randn(g, width), False),
        )

    def norm():
        return dict(x=dev(randn(g, b * L, dm)), weight=dev(randn(g, dm), False))

    def gated():
        return dict(
            x=dev(randn(g, b * L, d)), z=dev(randn(g, b * L, d)), weight=dev(randn(g, d), False)
        )

    def step2():
        return dict(
            state=dev(randn(g, b, h, p, n2), False),
            x=dev(randn(g, b, h, p)),
            dt=dev(randn(g, b, h) - 1),
            A=dev(-rand(g, h) - 0.5, False),
            B=dev(randn(g, b, 1, n2)),
            C=dev(randn(g, b, 1, n2)),
            D=dev(randn(g, h), False),
            dt_bias=dev(rand(g, h) - 1, False),
        )

    def conv_step():
        return dict(
            x=dev(randn(g, b, d)),
            state=dev(randn(g, b, d, 4)),
            weight=dev(randn(g, d, 4), False),
            bias=dev(randn(g, d), False),
        )

    def call_step2(t, backend):
        state = t["state"].clone()
        return ops.selective_state_update(
            state,
            t["x"],
            t["dt"][..., None].expand(b, h, p),
            t["A"][:, None, None].expand(h, p, n2),
            t["B"],
            t["C"],
            D=t["D"][:, None].expand(h, p),
            dt_bias=t["dt_bias"][:, None].expand(h, p),
            dt_softplus=True,
            backend=backend,
        )

    def call_conv_step(t, backend):
        return ops.causal_conv1d_update(
            t["x"], t["state"].clone(), t["weight"], t["bias"], activation="silu", backend=backend
        )

    return {
        "selective_scan": (
            "selective_scan",
            s6,
            lambda t, be: ops.selective_scan(**t, delta_softplus=True, backend=be),
            False,
        ),
        "ssd_scan": (
            "ssd_scan",
            ssd,
            lambda t, be: ops.ssd_scan(**t, chunk_size=s["chunk"], dt_softplus=True, backend=be),
            False,
        ),
        "causal_conv1d/mamba1": (
            "causal_conv1d",
            conv(d),
            lambda t, be: ops.causal_conv1d(
                t["x"], t["weight"], t["bias"], activation="silu", backend=be
            ),
            False,
        ),
        "causal_conv1d/mamba2": (
            "causal_conv1d",
            conv(d + 2 * n2),
            lambda t, be: ops.causal_conv1d(
                t["x"], t["weight"], t["bias"], activation="silu", backend=be
            ),
            False,
        ),
        "rms_norm": (
            "rms_norm",
            norm,
            lambda t, be: ops.rms_norm(t["x"], t["weight"], backend=be),
            False,
        ),
        "rms_norm_gated": (
            "rms_norm_gated",
            gated,
            lambda t, be: ops.rms_norm_gated(
                t["x"], t["weight"], t["z"], group_size=d, norm_before_gate=False, backend=be
            ),
            False,
        ),
        "selective_state_update/mamba2": ("selective_state_update", step2, call_step2, True),
        "causal_conv1d_update": ("causal_conv1d_update", conv_step, call_conv_step, True),
    }


def _fwd_bwd(call, inputs: dict, backend: str, decode: bool):
    """A callable running one forward (and backward of a fixed gradient) of ``call``, and its
    results."""
    leaves = {
        k: v.detach().clone().requires_grad_(v.is_floating_point() and not decode)
        for k, v in inputs.items()
    }
    grad = {}

    def run():
        for t in leaves.values():
            t.grad = None
        if decode:
            with torch.no_grad():
                return call(leaves, backend), {}
        y = call(leaves, backend)
        if "g" not in grad:
            grad["g"] = torch.randn(
                y.shape, generator=torch.Generator(device=y.device).manual_seed(3), device=y.device
            ).to(y.dtype)
        y.backward(grad["g"])
        return y.detach(), {f"d{k}": t.grad for k, t in leaves.items() if t.grad is not None}

    return run


def run(ctx: Context) -> dict:
    from ssmkit.ops import backend

    if not ctx.cuda:
        return {"status": NO_CUDA}
    missing = {op: backend.kernel_import_error(m) for op, m in backend.KERNEL_MODULES.items()}
    usable = {op for op, why in missing.items() if why is None}
    if not usable:
        reasons = sorted({why for why in missing.values() if why})
        return {
            "status": "skipped: mamba_ssm / causal_conv1d do not import: "
            + " | ".join(reasons)[:600],
            "import_errors": missing,
        }
    return kernel_rows(ctx, usable, missing)


def kernel_rows(ctx: Context, usable: set, missing: dict) -> dict:
    """Parity and speed of each kernel op in ``usable`` (op names of
    ssmkit.ops.backend.KERNEL_MODULES); the others are skipped with their reason in ``missing``."""
    from ssmkit.eval import time_round_robin
    from ssmkit.ops import backend

    shapes, quick_shapes = _kernel_shapes(ctx.quick), _kernel_shapes(True)
    steps, warmup = (3, 1) if ctx.quick else (5, 2)
    # parity tolerance: max |cuda - torch| / max |torch|, fp32 inputs (the SSD's Triton dots may use
    # TF32)
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
            errs = {"y": max_rel(y_c, y_t), **{k: max_rel(g_c[k], g_t[k]) for k in g_t if k in g_c}}
            limit = tol.get(op, 1e-3)
            passed = all(e <= limit for e in errs.values()) and set(g_t) <= set(g_c)
            row.update(parity={"max_rel": errs, "tolerance": limit, "pass": passed})
            # speed at the realistic shape, bf16 activations, fp32 parameters
            inputs = make()
            runs = {be: _fwd_bwd(call, inputs, be, decode) for be in ("torch", "cuda")}
            reps = 20 if decode else 1  # a decode step takes microseconds: time 20 at once

            def timed(fn, reps=reps):
                return lambda: [fn() for _ in range(reps)]

            seconds = time_round_robin(
                {be: timed(fn) for be, fn in runs.items()}, steps, warmup, device=ctx.device
            )
            ms = {be: 1e3 * statistics.median(s) / reps for be, s in seconds.items()}
            y_t, _ = runs["torch"]()
            y_c, _ = runs["cuda"]()
            row.update(
                shape={k: tuple(v.shape) for k, v in inputs.items()},
                what="fwd" if decode else "fwd+bwd",
                ms=ms,
                torch_over_cuda=ms["torch"] / ms["cuda"],
                bf16_out_max_rel=max_rel(y_c, y_t),
                status="ok",
            )
            ctx.log(
                f"  {name:<32} parity {'PASS' if row['parity']['pass'] else 'FAIL'} "
                f"(max rel {max(errs.values()):.2e}); {row['what']} "
                f"torch {ms['torch']:.3f} ms, cuda {ms['cuda']:.3f} ms: "
                f"kernel {row['torch_over_cuda']:.1f}x"
            )
        except Exception as exc:
            row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
            ctx.log(f"  {name:<32} error: {row['error']}")
        results[name] = row
        free()
    failed = [
        n
        for n, r in results.items()
        if r.get("status") == "error" or not r.get("parity", {}).get("pass", True)
    ]
    return {
        "pass": not failed,
        "failed": failed,
        "shapes": shapes,
        "ops": results,
        "timing": f"median of {steps} round-robin calls after {warmup} warm-up",
    }
