"""The SSD's recomputing backward (ssmkit.ops.ssd.ssd_chunked_recompute, over
ssmkit.ops.recompute.scan_in_segments) against ssd_chunked under autograd, its oracle.

Every case compares the outputs, the final state and the gradients of one random linear function of
both with respect to every input (x, dt, A, B, C, D, z, dt_bias, initial_states): fp32, max |diff|
<= 1e-5 x max(1, max |oracle|) (TOL; the two paths differ only in where a sum over segments is
taken). Segments are a few chunks long so that several run: lengths that are no multiple of the
segment or the chunk, one segment, ngroups > 1, packed rows whose samples cross segment boundaries
and start exactly on them, a row that does not start with sample 0, initial states. bf16 inputs are
held to the kernel suites' tolerances (ssmkit.ops.tolerances). Then the dispatch (the length
threshold, forcing on / off, per-sample states left on ssd_chunked), what the backward keeps (the
point of it), and bad input.
"""

from __future__ import annotations

import sys

import pytest
import torch

from ssmkit import ops
from ssmkit.ops import recompute
from ssmkit.ops.tolerances import SCAN, SCAN_DDELTA, SCAN_DU, SSD_PARAM, scaled

SSD = sys.modules["ssmkit.ops.ssd"]
TOL = 1e-5
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def case(seqlen, ngroups=1, batch=2, nheads=4, headdim=8, dstate=16, D_hdim=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        x=r(batch, seqlen, nheads, headdim),
        dt=r(batch, seqlen, nheads) - 1,
        A=-torch.rand(nheads, generator=g) - 0.5,
        B=r(batch, seqlen, ngroups, dstate) / 3,
        C=r(batch, seqlen, ngroups, dstate) / 3,
        D=r(nheads, headdim) if D_hdim else r(nheads),
        z=r(batch, seqlen, nheads, headdim),
        dt_bias=r(nheads) / 2,
        initial_states=r(batch, nheads, headdim, dstate),
    )


def run(fn, inputs, weights=None, **kw):
    """(y, final state, {name: gradient}) of sum(w_y y) + sum(w_h h) for fresh leaves of
    ``inputs``."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items() if v is not None}
    y, h = fn(**leaves, return_final_states=True, **kw)
    g = torch.Generator().manual_seed(7)
    wy = torch.randn(y.shape, generator=g).to(y.dtype) if weights is None else weights[0]
    wh = torch.randn(h.shape, generator=g) if weights is None else weights[1]
    loss = (y.float() * wy.float()).sum() + (h * wh).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return y.detach(), h.detach(), dict(zip(leaves, grads)), (wy, wh)


def close(a, b, what, tol=TOL):
    err = (a.double() - b.double()).abs().max().item()
    scale = max(1.0, b.abs().max().item())
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol:g} x {scale:.3g}"
    return err / scale


def compare(inputs, segment, chunk, **kw):
    """ssd_chunked_recompute against ssd_chunked; returns the largest relative difference."""
    y0, h0, g0, w = run(SSD.ssd_chunked, inputs, chunk_size=chunk, **kw)
    y1, h1, g1, _ = run(
        SSD.ssd_chunked_recompute, inputs, w, chunk_size=chunk, segment=segment, **kw
    )
    worst = max(close(y1, y0, "y"), close(h1, h0, "final state"))
    assert set(g1) == set(g0)
    for name in g0:
        worst = max(worst, close(g1[name], g0[name], f"d{name}"))
    return worst


SEQ_100 = torch.tensor(
    [
        # samples of 16 (ends on a segment boundary), 16 (starts and ends on one), 37 (crosses two
        # boundaries), 5, 26: with segment 16
        [0] * 16 + [1] * 16 + [2] * 37 + [3] * 5 + [4] * 26,
        # the row starts with sample 2 (no initial state reaches it); one sample crossing 4
        # segments; a sample starting at step 80 (a boundary), of one step at the end
        [2] * 7 + [3] * 73 + [4] * 19 + [5],
    ],
    dtype=torch.int32,
)


@pytest.mark.parametrize(
    "seqlen, chunk, segment, ngroups, packed, init, extra",
    [
        (100, 8, 24, 1, False, True, {}),  # 100 = 4 x 24 + 4 = 12 x 8 + 4
        (100, 8, 20, 2, False, False, {}),  # segment 20 -> 16: whole chunks
        (37, 8, 64, 1, False, True, {}),  # one segment, the chunk padded
        (64, 16, 16, 2, False, True, dict(dt_limit=(0.05, 0.6))),  # segment = chunk, dt clamped
        (100, 8, 16, 1, True, True, {}),  # packed, samples on and across boundaries
        (100, 4, 16, 2, True, False, {}),
        (100, 8, 16, 1, True, True, dict(z=None, D=None)),  # no skip, no gate
        (100, 8, 32, 1, False, True, dict(D_hdim=True, dt_bias=None, dt_softplus=False)),
    ],
)
def test_recompute_equals_autograd_fp32(seqlen, chunk, segment, ngroups, packed, init, extra):
    extra = dict(extra)
    inputs = case(seqlen, ngroups, D_hdim=extra.pop("D_hdim", False))
    for k in ("z", "D", "dt_bias"):
        if k in extra and extra[k] is None:
            inputs[k] = extra.pop(k)
    if not init:
        inputs["initial_states"] = None
    kw = {"dt_softplus": True, **extra}
    if not kw["dt_softplus"]:  # Δ as given: positive
        inputs["dt"] = inputs["dt"].abs() / 4
    if packed:
        kw["seq_idx"] = SEQ_100[:, :seqlen]
    compare(inputs, segment, chunk, **kw)


def test_recompute_bf16_within_the_kernel_tolerances():
    """bf16 inputs: the recomputing path against the fp32 oracle (ssd_chunked on the inputs
    upcast), at the tolerances ssmkit holds the torch backend to (those of mamba_ssm's suites):
    the output and final state at SCAN[bf16], dx, dB, dC, dz at x SCAN_DU, ddt at x SCAN_DDELTA,
    the fp32 parameters' at SSD_PARAM of their largest magnitude."""
    itype = torch.bfloat16
    rtol, atol = SCAN[itype]
    inputs = {
        k: v.to(itype) if k in ("x", "dt", "B", "C", "z") else v for k, v in case(100, 2).items()
    }
    kw = dict(dt_softplus=True, seq_idx=SEQ_100)
    y, h, g, w = run(SSD.ssd_chunked_recompute, inputs, chunk_size=8, segment=16, **kw)
    upcast = {k: v.float() for k, v in inputs.items()}
    y0, h0, g0, _ = run(SSD.ssd_chunked, upcast, (w[0].float(), w[1]), chunk_size=8, **kw)
    assert y.dtype == itype and h.dtype == torch.float32

    def within(a, b, tol, what):
        a, b = a.float(), b.float()
        excess = ((a - b).abs() - (tol[1] + tol[0] * b.abs())).max().item()
        assert excess <= 0, f"{what}: exceeds (rtol, atol) = {tol} by {excess:.3g}"

    within(y, y0.to(itype), (rtol, atol), "y")
    within(h, h0, (rtol, atol), "final state")
    for name in ("x", "B", "C", "z"):
        within(g[name], g0[name].to(itype), scaled((rtol, atol), SCAN_DU), f"d{name}")
    within(g["dt"], g0["dt"].to(itype), scaled((rtol, atol), SCAN_DDELTA), "ddt")
    for name in ("A", "D", "dt_bias", "initial_states"):
        scale = g0[name].abs().max().item()
        within(g[name], g0[name], (SSD_PARAM[0], SSD_PARAM[1] * scale), f"d{name}")


def test_recompute_under_autocast_differentiates_the_forward_it_ran():
    """bf16 autocast around the forward only, the backward outside it (as training loops do; CPU:
    the einsums' matmuls in bf16): the backward recomputes under the forward's autocast, so its
    gradients are ssd_chunked's under the same autocast, to TOL (recomputed without autocast they
    would be the fp32 ones, ~1e-3 away)."""
    inputs = case(100, 2)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(inputs["x"].shape, generator=g)
    grads = []
    for fn, kw in ((SSD.ssd_chunked, {}), (SSD.ssd_chunked_recompute, {"segment": 16})):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(**leaves, chunk_size=8, dt_softplus=True, **kw)
        grads.append(torch.autograd.grad((y.float() * w).sum(), list(leaves.values())))
    for name, a, b in zip(leaves, *grads):
        close(b, a, f"d{name}")


def test_without_grad_it_is_the_segmented_forward():
    inputs = case(100)
    with torch.no_grad():
        kw = dict(chunk_size=8, dt_softplus=True, return_final_states=True)
        y0, h0 = SSD.ssd_chunked(**inputs, **kw)
        y1, h1 = SSD.ssd_chunked_recompute(**inputs, segment=16, **kw)
    close(y1, y0, "y")
    close(h1, h0, "final state")
    y = SSD.ssd_chunked_recompute(**inputs, chunk_size=8, segment=16)
    assert isinstance(y, torch.Tensor) and y.shape == inputs["x"].shape


# --- the generic helper ---------------------------------------------------------------------------


def test_scan_in_segments_on_a_decaying_sum():
    """h_t = a h_{t-1} + u_t, y_t = c h_t, with h0 None and given, against the same loop under
    autograd: y, h and the gradients of u, a, c, h0."""
    g = torch.Generator().manual_seed(3)
    u = torch.randn(2, 11, 3, generator=g, requires_grad=True)
    a = torch.rand(3, generator=g).requires_grad_()
    c = torch.randn(3, generator=g, requires_grad=True)

    def fn(h, seq, rest):
        (u_,), (a_, c_) = seq, rest
        ys = []
        for t in range(u_.shape[1]):
            h = u_[:, t] if h is None else a_ * h + u_[:, t]
            ys.append(c_ * h)
        return torch.stack(ys, 1), h

    for h0 in (None, torch.randn(2, 3, generator=g, requires_grad=True)):
        wrt = [u, a, c] + ([h0] if h0 is not None else [])
        y0, hT0 = fn(h0, [u], [a, c])
        want = torch.autograd.grad((y0 * y0).sum() + hT0.sum(), wrt)
        bounds = recompute.segment_bounds(11, 4)
        assert bounds == [(0, 4), (4, 8), (8, 11)]
        y1, hT1 = recompute.scan_in_segments(fn, h0, [u], [a, c], bounds)
        got = torch.autograd.grad((y1 * y1).sum() + hT1.sum(), wrt)
        close(y1, y0, "y")
        close(hT1, hT0, "h")
        for name, x1, x0 in zip("u a c h0".split(), got, want):
            close(x1, x0, f"d{name}")


def test_segment_bounds():
    assert recompute.segment_bounds(10, 6, 4) == [(0, 4), (4, 8), (8, 10)]  # 6 -> one chunk
    assert recompute.segment_bounds(10, 3, 4) == [(0, 4), (4, 8), (8, 10)]  # at least one chunk
    assert recompute.segment_bounds(5, 64, 8) == [(0, 5)]
    with pytest.raises(ValueError, match="segment"):
        recompute.segment_bounds(10, 0)


# --- dispatch, memory, bad input ------------------------------------------------------------------


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = SSD.ssd_chunked_recompute

    def counted(*a, **k):
        calls.append(a[0].shape[1])
        return real(*a, **k)

    monkeypatch.setattr(SSD, "ssd_chunked_recompute", counted)
    monkeypatch.setattr(SSD, "RECOMPUTE_FROM", 128)  # tokens: batch 2 x 64
    yield calls
    ops.ssd_recompute(None)


def test_ssd_scan_recomputes_above_the_threshold_or_when_forced(spy):
    """Above RECOMPUTE_FROM tokens (batch x seqlen) a call of the torch backend recomputes; forced
    on, at any length; forced off, at none; other backends and per-sample states never."""
    for seqlen in (64, 65):
        ops.ssd_scan(**case(seqlen), chunk_size=8, backend="torch")
    assert spy == [65]
    ops.ssd_recompute(True)
    ops.ssd_scan(**case(10), chunk_size=8, backend="torch")
    ops.ssd_recompute(False)
    ops.ssd_scan(**case(100), chunk_size=8, backend="torch")
    assert spy == [65, 10]
    ops.ssd_recompute(None)
    ops.ssd_scan(**case(100), chunk_size=8, backend="reference")  # only the torch backend
    seq = SEQ_100.clone()
    inputs = {**case(100), "initial_states": None}
    ops.ssd_scan(**inputs, chunk_size=8, seq_idx=seq, return_sample_states=True, backend="torch")
    assert spy == [65, 10]  # per-sample states stay on ssd_chunked
    ops.ssd_scan(**inputs, chunk_size=8, seq_idx=seq, backend="torch")
    assert spy == [65, 10, 100]


def saved_bytes(fn):
    """Bytes of the distinct storages autograd keeps for the backward of ``fn()``."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_the_backward_keeps_the_inputs_and_one_state_per_segment():
    """What the recomputing path saves: its inputs and one state per segment after the first (the
    initial state is an input), no more; ssd_chunked keeps many times that."""
    inputs = {k: v.requires_grad_() for k, v in case(512, nheads=8, headdim=16).items()}
    kw = dict(chunk_size=16, dt_softplus=True)
    lean, _ = saved_bytes(lambda: SSD.ssd_chunked_recompute(**inputs, segment=128, **kw))
    plain, _ = saved_bytes(lambda: SSD.ssd_chunked(**inputs, **kw))
    h = inputs["initial_states"]
    expected = sum(t.untyped_storage().nbytes() for t in inputs.values()) + 3 * h.nbytes
    assert lean == expected
    assert plain > 4 * lean


def test_bad_input():
    inputs = case(20)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="segment must be a positive integer"):
            SSD.ssd_chunked_recompute(**inputs, chunk_size=8, segment=bad)
    with pytest.raises(ValueError, match="chunk_size"):
        SSD.ssd_chunked_recompute(**inputs, chunk_size=0)
    with pytest.raises(ValueError, match="initial_states must be"):
        SSD.ssd_chunked_recompute(**{**inputs, "initial_states": torch.zeros(1)}, chunk_size=8)
    with pytest.raises(ValueError, match="True, False or None"):
        ops.ssd_recompute("yes")
