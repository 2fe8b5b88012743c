"""bf16 / fp16 inputs (the GPU training dtypes) through the torch backend of every op, against an
fp32 oracle, with the official kernels' own test tolerances.

The kernels keep weights in fp32 and accumulate in fp32, rounding once to the input dtype at the
end; the torch path must do the same, or its weight gradients lose ~3 digits (a bf16 weight cast
before the sum made the conv's weight gradient 300x the causal-conv1d suite's tolerance off). Each
test's oracle is the kernel suite's reference: the same op on the inputs upcast to fp32, its output
rounded to the input dtype.

The tolerances (rtol, atol) are the suites', from :mod:`ssmkit.ops.tolerances` (which names the
suite and file of each): causal-conv1d's for the conv, mamba_ssm's selective scan's for the S6 and
SSD scans, its gated layernorm's rule for the norms.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from ssmkit import ops
from ssmkit.ops.tolerances import (
    CONV,
    CONV_WEIGHT,
    NORM_ATOL,
    NORM_PT,
    SCAN,
    SCAN_DA_ATOL,
    SCAN_DDELTA,
    SCAN_DU,
    SSD_PARAM,
    scaled,
    scan_weight,
)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def close(actual, expected, rtol, atol, what):
    actual, expected = actual.float(), expected.float()
    bad = (actual - expected).abs() - (atol + rtol * expected.abs())
    assert bad.max() <= 0, (
        f"{what}: max excess {bad.max().item():.3g} over atol={atol}, rtol={rtol} "
        f"(max abs diff {(actual - expected).abs().max().item():.3g})"
    )


def torch_backend(fn):
    return lambda *a, **k: fn(*a, backend="torch", **k)


# ------------------------------------------------------------------------------------------------
# causal_conv1d: the causal-conv1d suite's cases, its reference and tolerances
# ------------------------------------------------------------------------------------------------


def conv_oracle(x, weight, bias, activation):
    """causal-conv1d's ``causal_conv1d_ref``: x cast to the weight's dtype (fp32), conv, cast
    back."""
    width, seqlen = weight.shape[1], x.shape[-1]
    out = F.conv1d(
        x.to(weight.dtype), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1]
    )
    out = out[..., :seqlen]
    return (out if activation is None else F.silu(out)).to(x.dtype)


CONV_GRID = list(
    itertools.product(
        DTYPES, [False, True], [False, True], [None, "silu"], [2, 3, 4], [1, 8, 129, 372], [64]
    )
)


@pytest.mark.parametrize(
    "dtype, channel_last, has_bias, activation, width, seqlen, dim",
    CONV_GRID,
    ids=["-".join(map(str, c)) for c in CONV_GRID],
)
def test_causal_conv1d_low_precision_as_the_kernel_suite(
    dtype, channel_last, has_bias, activation, width, seqlen, dim
):
    itype = DTYPES[dtype]
    rtol, atol = CONV[itype]
    g = torch.Generator().manual_seed(0)
    batch = 2
    if channel_last:
        x = torch.randn(batch, seqlen, dim, generator=g).to(itype).transpose(1, 2)
    else:
        x = torch.randn(batch, dim, seqlen, generator=g).to(itype)
    weight = torch.randn(dim, width, generator=g)
    bias = torch.randn(dim, generator=g) if has_bias else None
    grad = torch.randn(batch, dim, seqlen, generator=g).to(itype)
    results = []
    for fn in (torch_backend(ops.causal_conv1d), conv_oracle):
        xi = x.detach().clone().requires_grad_()
        wi = weight.clone().requires_grad_()
        bi = bias.clone().requires_grad_() if bias is not None else None
        out = (
            fn(xi, wi, bi, activation=activation)
            if fn is not conv_oracle
            else fn(xi, wi, bi, activation)
        )
        out.backward(grad)
        results.append((out, xi.grad, wi.grad, None if bi is None else bi.grad))
    (out, dx, dw, db), (out_ref, dx_ref, dw_ref, db_ref) = results
    assert out.dtype == itype and dx.dtype == itype and dw.dtype == torch.float32
    close(out, out_ref, rtol, atol, "output")
    close(dx, dx_ref, rtol, atol, "dx")
    close(dw, dw_ref, *CONV_WEIGHT, "dweight")
    if has_bias:
        close(db, db_ref, *CONV_WEIGHT, "dbias")


def test_causal_conv1d_weight_gradient_is_fp32_exact():
    """The weight gradient of bf16 activations is a sum over batch x length in fp32: as exact as the
    same sum computed in fp64 (relative error ~1e-6), where rounding the weight or the taps to bf16
    gave ~3e-3."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2048, 64, generator=g).bfloat16().transpose(1, 2)
    weight = torch.randn(64, 4, generator=g, requires_grad=True)
    grad = torch.randn(4, 64, 2048, generator=g).bfloat16()
    ops.causal_conv1d(x, weight, None, activation=None, backend="torch").backward(grad)
    w64 = weight.detach().double().requires_grad_()
    conv_oracle(x.double(), w64, None, None).backward(grad.double())
    rel = (weight.grad.double() - w64.grad).norm() / w64.grad.norm()
    assert rel < 1e-5, f"relative error of dweight {rel.item():.2e}"


# ------------------------------------------------------------------------------------------------
# selective_scan: mamba_ssm's test_selective_scan cases and tolerances
# ------------------------------------------------------------------------------------------------


def scan_case(itype, seqlen, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, dim, dstate = 2, 4, 8
    bc_shape = (batch, dstate, seqlen) if groups == 1 else (batch, groups, dstate, seqlen)
    return dict(
        u=torch.randn(batch, dim, seqlen, generator=g).to(itype),
        delta=(0.5 * torch.rand(batch, dim, seqlen, generator=g)).to(itype),
        A=-0.5 * torch.rand(dim, dstate, generator=g),
        B=torch.randn(*bc_shape, generator=g).to(itype),
        C=torch.randn(*bc_shape, generator=g).to(itype),
        D=torch.randn(dim, generator=g),
        z=torch.randn(batch, dim, seqlen, generator=g).to(itype),
        delta_bias=0.5 * torch.rand(dim, generator=g),
    )


def run_with_grads(fn, inputs, grad_out, **kw):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    out = fn(**leaves, **kw)
    y, state = out if isinstance(out, tuple) else (out, None)
    y.backward(grad_out)
    return y, state, {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seqlen", [128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_selective_scan_low_precision_as_the_kernel_suite(dtype, seqlen, groups):
    itype = DTYPES[dtype]
    rtol, atol = SCAN[itype]
    rtolw, atolw = scan_weight(itype)  # with z, as the suite
    inputs = scan_case(itype, seqlen, groups)
    grad = torch.randn(2, 4, seqlen, generator=torch.Generator().manual_seed(5)).to(itype)
    kw = dict(delta_softplus=True, return_final_state=True)
    y, h, grads = run_with_grads(torch_backend(ops.selective_scan), inputs, grad, **kw)
    upcast = {k: v.float() for k, v in inputs.items()}
    y_ref, h_ref, grads_ref = run_with_grads(
        lambda **a: ops.selective_scan(**a, backend="reference"), upcast, grad.float(), **kw
    )
    assert y.dtype == itype and y.is_contiguous() and h.dtype == torch.float32
    close(y, y_ref.to(itype), rtol, atol, "output")
    close(h, h_ref, rtol, atol, "final state")
    close(grads["u"], grads_ref["u"].to(itype), *scaled((rtol, atol), SCAN_DU), "du")
    close(
        grads["delta"], grads_ref["delta"].to(itype), *scaled((rtol, atol), SCAN_DDELTA), "ddelta"
    )
    close(grads["A"], grads_ref["A"], rtolw, SCAN_DA_ATOL * atolw, "dA")
    for name in ("B", "C"):  # variable B, C: the input tolerance
        close(grads[name], grads_ref[name].to(itype), rtol, atol, f"d{name}")
    for name in ("D", "z", "delta_bias"):
        close(grads[name], grads_ref[name], rtolw, atolw, f"d{name}")


def test_selective_scan_output_layout_follows_the_input():
    """Contiguous u gives a contiguous y (as the reference and the kernel: ``y.view`` works); a
    channels-last view (what the mixers pass) gives a channels-last view, so no layout copy is
    added."""
    inputs = scan_case(torch.float32, 16, 1)
    y = ops.selective_scan(**inputs, backend="torch")
    assert y.is_contiguous()
    y.view(-1)
    u = inputs["u"].transpose(1, 2).contiguous().transpose(1, 2)
    y = ops.selective_scan(**{**inputs, "u": u}, backend="torch")
    assert y.stride(1) == 1
    torch.testing.assert_close(
        y, ops.selective_scan(**inputs, backend="reference"), rtol=1e-5, atol=1e-5
    )


# ------------------------------------------------------------------------------------------------
# ssd_scan
# ------------------------------------------------------------------------------------------------


def ssd_case(itype, seqlen, ngroups, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, nheads, headdim, dstate = 2, 4, 8, 16
    return dict(
        x=torch.randn(batch, seqlen, nheads, headdim, generator=g).to(itype),
        dt=(torch.randn(batch, seqlen, nheads, generator=g) - 2).to(itype),
        A=-torch.rand(nheads, generator=g) - 0.5,
        B=(torch.randn(batch, seqlen, ngroups, dstate, generator=g) / 5).to(itype),
        C=(torch.randn(batch, seqlen, ngroups, dstate, generator=g) / 5).to(itype),
        D=torch.randn(nheads, generator=g),
        z=torch.randn(batch, seqlen, nheads, headdim, generator=g).to(itype),
        dt_bias=torch.rand(nheads, generator=g) - 2,
    )


@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("seqlen", [64, 300])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ssd_scan_low_precision(dtype, seqlen, ngroups):
    itype = DTYPES[dtype]
    rtol, atol = SCAN[itype]
    inputs = ssd_case(itype, seqlen, ngroups)
    grad = torch.randn(2, seqlen, 4, 8, generator=torch.Generator().manual_seed(5)).to(itype)
    kw = dict(chunk_size=64, dt_softplus=True, return_final_states=True)
    y, h, grads = run_with_grads(lambda **a: ops.ssd_scan(**a, backend="torch"), inputs, grad, **kw)
    upcast = {k: v.float() for k, v in inputs.items()}
    y_ref, h_ref, grads_ref = run_with_grads(
        lambda **a: ops.ssd_scan(**a, backend="reference"), upcast, grad.float(), **kw
    )
    assert y.dtype == itype and h.dtype == torch.float32
    close(y, y_ref.to(itype), rtol, atol, "output")
    close(h, h_ref, rtol, atol, "final state")
    for name in ("x", "B", "C", "z"):
        close(grads[name], grads_ref[name].to(itype), *scaled((rtol, atol), SCAN_DU), f"d{name}")
    close(grads["dt"], grads_ref["dt"].to(itype), *scaled((rtol, atol), SCAN_DDELTA), "ddt")
    for name in ("A", "D", "dt_bias"):  # fp32 parameters: sums over every position
        scale = grads_ref[name].abs().max().item()
        close(grads[name], grads_ref[name], SSD_PARAM[0], SSD_PARAM[1] * scale, f"d{name}")


# ------------------------------------------------------------------------------------------------
# norms: mamba_ssm's test_layernorm_gated rule
# ------------------------------------------------------------------------------------------------


NORM_GRID = list(itertools.product(DTYPES, [False, True], [None, 64], [True, False]))


@pytest.mark.parametrize(
    "dtype, has_z, group_size, norm_before_gate",
    NORM_GRID,
    ids=["-".join(map(str, c)) for c in NORM_GRID],
)
def test_rms_norm_gated_low_precision_as_the_kernel_suite(
    dtype, has_z, group_size, norm_before_gate
):
    """|ours - fp32| <= NORM_PT |plain low-precision PyTorch - fp32| + NORM_ATOL, for the output and
    every gradient."""
    itype = DTYPES[dtype]
    g = torch.Generator().manual_seed(0)
    d, eps = 256, 1e-5
    inputs = dict(
        x=torch.randn(4, 32, d, generator=g).to(itype), weight=torch.randn(d, generator=g)
    )
    if has_z:
        inputs["z"] = torch.randn(4, 32, d, generator=g).to(itype)
    grad = torch.randn(4, 32, d, generator=g).to(itype)
    kw = dict(eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)

    def plain(x, weight, z=None, cast=None, **_):
        """The gated RMSNorm written out, every step in ``cast`` (the input dtype: the "pt" of the
        suite)."""
        x, weight = x.to(cast), weight.to(cast)
        z = None if z is None else z.to(cast)
        if z is not None and not norm_before_gate:
            x = x * F.silu(z)
        shape = x.shape
        xg = x.reshape(*shape[:-1], -1, group_size or d)
        y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).reshape(shape) * weight
        return y * F.silu(z) if z is not None and norm_before_gate else y

    ours = run_with_grads(lambda **a: ops.rms_norm_gated(**a, backend="torch"), inputs, grad, **kw)
    ref = run_with_grads(lambda **a: plain(**a, cast=torch.float32).to(itype), inputs, grad)
    pt = run_with_grads(lambda **a: plain(**a, cast=itype), inputs, grad)

    def err(a, b):
        return (a.float() - b.float()).abs().max().item()

    assert err(ours[0], ref[0]) <= NORM_PT * err(pt[0], ref[0]) + NORM_ATOL
    for name in inputs:
        bound = NORM_PT * err(pt[2][name], ref[2][name]) + NORM_ATOL
        assert err(ours[2][name], ref[2][name]) <= bound, name
