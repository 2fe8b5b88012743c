"""Tests of :mod:`ssmkit.ops`. Each test names its oracle:

* ``torch`` backend vs ``reference`` backend (the literal recurrence): outputs and the gradients of
  every differentiable input, under a seeded random upstream gradient (fp32, ``REL_TOL``), with the
  selective scan's time chunk forced small so forward and backward cross chunk boundaries;
* bf16 inputs on the ``torch`` backend vs the fp32 reference on the same upcast values
  (``BF16_TOL``);
* SSD's three views (recurrence, quadratic dual, chunked) against each other; ``segsum`` against a
  double loop; ``dt_limit`` against clamping Δ by hand;
* closed forms and second paths: A = 0, B = C = 1 makes the scan a cumulative sum; zero input only
  decays the initial state; ``F.conv1d`` with symmetric padding, truncated; one-step updates applied
  token by token vs the whole-sequence op; gated and grouped RMSNorm written out by hand;
* transformers' pure-PyTorch ``mamba_selective_scan`` and ``mamba2_chunk_scan`` (an outside oracle);
* backend selection (argument, ``SSMKIT_BACKEND``, automatic) and the errors for bad backends / bad
  input.
"""

from __future__ import annotations

import importlib
import random
import re

import pytest
import torch
import torch.nn.functional as F

import ssmkit
from ssmkit import ops
from ssmkit.ops.backend import KERNEL_MODULES, BackendError
from ssmkit.ops.tolerances import FP32_REL

SCAN = importlib.import_module("ssmkit.ops.s6")
STEP = importlib.import_module("ssmkit.ops.s6_step")
SSD = importlib.import_module("ssmkit.ops.ssd")
CONV = importlib.import_module("ssmkit.ops.conv")

# Relative error = max|got - want| / max(max|want|, TINY), within the fp32 bound FP32_REL (1e-4:
# room for a different summation order and nothing more; ssmkit.ops.tolerances says why).
REL_TOL = FP32_REL
# bf16 inputs and outputs carry 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per value); sums of
# rounded terms reach ~9e-3 here (the gradient of delta_bias), so 2e-2; a wrong result is far above
# it.
BF16_TOL = 2e-2
TINY = 1e-12


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(TINY)).item()


def assert_close(got, want, tol, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def forward_backward(fn, inputs, seed=1234):
    """Call ``fn(**inputs)`` on fresh leaf copies of the tensor inputs and backpropagate
    sum_i <out_i, w_i> with seeded random weights w_i. Returns (outputs, {input name: grad})."""
    leaves = {
        k: v.detach().clone().requires_grad_() if torch.is_tensor(v) else v
        for k, v in inputs.items()
    }
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = gen(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    grads = {k: v.grad for k, v in leaves.items() if torch.is_tensor(v)}
    return tuple(o.detach() for o in outs), grads


def assert_same_forward_backward(fn, oracle, inputs, tol, oracle_inputs=None):
    """fn and oracle agree in every output and in the gradient of every tensor input."""
    outs, grads = forward_backward(fn, inputs)
    want_outs, want_grads = forward_backward(
        oracle, inputs if oracle_inputs is None else oracle_inputs
    )
    assert len(outs) == len(want_outs)
    for i, (got, want) in enumerate(zip(outs, want_outs)):
        assert_close(got, want, tol, f"output {i}")
    assert grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert want is not None and want.abs().max() > 0, f"the oracle gives no gradient for {name}"
        assert grads[name] is not None, f"no gradient for {name}"
        assert_close(grads[name], want, tol, f"gradient of {name}")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, scale=1.0):
    return torch.randn(shape, generator=g) * scale


def rand(g, *shape, lo=0.0, hi=1.0):
    return lo + (hi - lo) * torch.rand(shape, generator=g)


def with_backend(fn, backend):
    return lambda **kw: fn(**kw, backend=backend)


def scan_inputs(
    batch=2,
    dim=4,
    dstate=3,
    seqlen=11,
    ngroups=None,
    D=True,
    z=True,
    delta_bias=True,
    softplus=True,
    h0=True,
    final=True,
    seed=0,
):
    """Inputs of ``selective_scan``; ngroups=None gives B, C of shape (batch, dstate, seqlen)."""
    g = gen(seed)
    bc = (batch, dstate, seqlen) if ngroups is None else (batch, ngroups, dstate, seqlen)
    inputs = dict(
        u=randn(g, batch, dim, seqlen),
        delta=(
            randn(g, batch, dim, seqlen, scale=0.5)
            if softplus
            else rand(g, batch, dim, seqlen, lo=0.05, hi=0.5)
        ),
        A=-rand(g, dim, dstate, lo=0.5, hi=1.5),
        B=randn(g, *bc),
        C=randn(g, *bc),
        delta_softplus=softplus,
        return_final_state=final,
    )
    if D:
        inputs["D"] = randn(g, dim)
    if z:
        inputs["z"] = randn(g, batch, dim, seqlen)
    if delta_bias:
        inputs["delta_bias"] = randn(g, dim, scale=0.5) if softplus else rand(g, dim, hi=0.1)
    if h0:
        inputs["initial_state"] = randn(g, batch, dim, dstate)
    return inputs


def ssd_inputs(
    batch=2,
    seqlen=11,
    nheads=4,
    headdim=3,
    ngroups=2,
    dstate=5,
    chunk_size=4,
    D="heads",
    z=True,
    dt_bias=True,
    softplus=True,
    h0=True,
    final=True,
    seed=0,
):
    """Inputs of ``ssd_scan``; D is None, "heads" (nheads,) or "channels" (nheads, headdim)."""
    g = gen(seed)
    inputs = dict(
        x=randn(g, batch, seqlen, nheads, headdim),
        dt=(
            randn(g, batch, seqlen, nheads, scale=0.5)
            if softplus
            else rand(g, batch, seqlen, nheads, lo=0.05, hi=0.5)
        ),
        A=-rand(g, nheads, lo=0.5, hi=1.5),
        B=randn(g, batch, seqlen, ngroups, dstate),
        C=randn(g, batch, seqlen, ngroups, dstate),
        chunk_size=chunk_size,
        dt_softplus=softplus,
        return_final_states=final,
    )
    if D is not None:
        inputs["D"] = randn(g, nheads) if D == "heads" else randn(g, nheads, headdim)
    if z:
        inputs["z"] = randn(g, batch, seqlen, nheads, headdim)
    if dt_bias:
        inputs["dt_bias"] = randn(g, nheads, scale=0.5) if softplus else rand(g, nheads, hi=0.1)
    if h0:
        inputs["initial_states"] = randn(g, batch, nheads, headdim, dstate)
    return inputs


def conv_inputs(batch=2, dim=3, seqlen=9, width=4, bias=True, activation="silu", seed=0):
    g = gen(seed)
    inputs = dict(
        x=randn(g, batch, dim, seqlen),
        weight=randn(g, dim, width, scale=0.5),
        activation=activation,
    )
    if bias:
        inputs["bias"] = randn(g, dim)
    return inputs


def norm_inputs(shape=(2, 5, 8), z=True, seed=0, **options):
    g = gen(seed)
    inputs = dict(x=randn(g, *shape), weight=rand(g, shape[-1], lo=0.5, hi=1.5), **options)
    if z:
        inputs["z"] = randn(g, *shape)
    return inputs


DT_LIMIT = (0.01, 0.05)


def with_wide_dt(inputs, seed=5):
    """ssd inputs whose step sizes Δ lie on both sides of DT_LIMIT (about 0.001 to 10)."""
    shape = inputs["dt"].shape
    g = gen(seed)
    dt = randn(g, *shape, scale=3.0) if inputs["dt_softplus"] else rand(g, *shape, lo=0.001, hi=0.1)
    return {**inputs, "dt": dt}


def set_scan_chunk(monkeypatch, T, batch, dim, dstate):
    """Make the torch selective scan process time in chunks of T steps."""
    monkeypatch.setattr(SCAN, "_CHUNK_ELEMENTS", T * batch * dim * dstate)
    assert SCAN._chunk_len(batch, dim, dstate) == T


# --------------------------------------------------------------------------------------------
# 1. torch backend == reference backend, outputs and gradients (fp32)
# --------------------------------------------------------------------------------------------

SCAN_CASES = {
    "all-options": dict(),
    "grouped-BC": dict(dim=6, ngroups=3),
    "grouped-one-channel-per-group": dict(ngroups=4),
    "bare": dict(D=False, z=False, delta_bias=False, softplus=False, h0=False, final=False),
    "no-initial-state": dict(h0=False),
    "bias-without-softplus": dict(softplus=False, z=False),
    "seqlen-1": dict(seqlen=1),
    "seqlen-1-grouped": dict(seqlen=1, ngroups=2, D=False),
}


def _random_scan_cases(n):
    """Seeded random shapes and options: (case kwargs, chunk length)."""
    rng = random.Random(2024)
    cases = []
    for i in range(n):
        ngroups = rng.choice([None, 1, 2])
        dim = rng.choice([2, 4, 6])
        flags = {k: rng.random() < 0.5 for k in ("D", "z", "delta_bias", "softplus", "h0", "final")}
        case = dict(
            batch=rng.randint(1, 3),
            dim=dim,
            dstate=rng.randint(1, 5),
            seqlen=rng.randint(1, 17),
            ngroups=ngroups,
            seed=i,
            **flags,
        )
        cases.append(pytest.param(case, rng.randint(1, 6), id=f"random{i}"))
    return cases


@pytest.mark.parametrize("T", [1, 3, 5, 64])
@pytest.mark.parametrize("case", list(SCAN_CASES.values()), ids=list(SCAN_CASES))
def test_selective_scan_torch_matches_reference(monkeypatch, case, T):
    inputs = scan_inputs(**case)
    batch, dim, _ = inputs["u"].shape
    set_scan_chunk(monkeypatch, T, batch, dim, inputs["A"].shape[1])
    assert_same_forward_backward(
        with_backend(ops.selective_scan, "torch"),
        with_backend(ops.selective_scan, "reference"),
        inputs,
        REL_TOL,
    )


@pytest.mark.parametrize("case, T", _random_scan_cases(4))
def test_selective_scan_torch_matches_reference_random_shapes(monkeypatch, case, T):
    inputs = scan_inputs(**case)
    batch, dim, _ = inputs["u"].shape
    set_scan_chunk(monkeypatch, T, batch, dim, inputs["A"].shape[1])
    assert_same_forward_backward(
        ops.selective_scan_torch, ops.selective_scan_reference, inputs, REL_TOL
    )


SSD_CASES = {
    "all-options": dict(),
    "D-per-channel-one-group": dict(ngroups=1, D="channels"),
    "one-head-per-group": dict(ngroups=4),
    "bare": dict(D=None, z=False, dt_bias=False, softplus=False, h0=False, final=False),
    "no-initial-state": dict(h0=False),
    "bias-without-softplus": dict(softplus=False),
    "seqlen-1": dict(seqlen=1),
}


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
@pytest.mark.parametrize("case", list(SSD_CASES.values()), ids=list(SSD_CASES))
def test_ssd_three_views_agree(case, chunk_size):
    """ssd_scan's torch backend (chunked) and the quadratic dual both equal the recurrence."""
    inputs = ssd_inputs(chunk_size=chunk_size, **case)
    reference = with_backend(ops.ssd_scan, "reference")
    assert_same_forward_backward(with_backend(ops.ssd_scan, "torch"), reference, inputs, REL_TOL)
    assert_same_forward_backward(ops.ssd_quadratic, reference, inputs, REL_TOL)


def test_ssd_torch_on_cpu_uses_its_own_chunk(monkeypatch):
    """On a CPU the torch backend runs the model's chunk_size=256 as chunks of CPU_CHUNK_SIZE (64):
    the same outputs, final states and gradients as the model's chunk and as the recurrence, over a
    length that is a multiple of neither."""
    inputs = ssd_inputs(seqlen=300, chunk_size=256, headdim=4, dstate=8)
    seen = []
    real = SSD.ssd_chunked
    monkeypatch.setitem(SSD._IMPLS, "torch", lambda *a, **k: seen.append(a[5]) or real(*a, **k))
    torch_backend = with_backend(ops.ssd_scan, "torch")
    assert_same_forward_backward(
        torch_backend, with_backend(ops.ssd_scan, "reference"), inputs, REL_TOL
    )
    assert seen and set(seen) == {SSD.CPU_CHUNK_SIZE}
    assert_same_forward_backward(torch_backend, ops.ssd_chunked, inputs, 1e-5)


CONV_CASES = {
    "width4-silu": dict(),
    "width2-no-activation": dict(width=2, activation=None),
    "no-bias-swish": dict(bias=False, activation="swish"),
    "seqlen-shorter-than-width": dict(seqlen=3),
    "seqlen-1": dict(seqlen=1),
}


@pytest.mark.parametrize("case", list(CONV_CASES.values()), ids=list(CONV_CASES))
def test_causal_conv1d_torch_matches_reference(case):
    assert_same_forward_backward(
        with_backend(ops.causal_conv1d, "torch"),
        with_backend(ops.causal_conv1d, "reference"),
        conv_inputs(**case),
        REL_TOL,
    )


@pytest.mark.parametrize("shape", [(2, 5, 8), (3, 1), (1, 16)])
def test_rms_norm_torch_matches_reference(shape):
    assert_same_forward_backward(
        with_backend(ops.rms_norm, "torch"),
        with_backend(ops.rms_norm, "reference"),
        norm_inputs(shape, z=False, eps=1e-5),
        REL_TOL,
    )


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("group_size", [None, 4, 2])
@pytest.mark.parametrize("z", [True, False])
def test_rms_norm_gated_torch_matches_reference(z, group_size, norm_before_gate):
    inputs = norm_inputs(z=z, group_size=group_size, norm_before_gate=norm_before_gate)
    assert_same_forward_backward(
        with_backend(ops.rms_norm_gated, "torch"),
        with_backend(ops.rms_norm_gated, "reference"),
        inputs,
        REL_TOL,
    )


# --------------------------------------------------------------------------------------------
# 1 and 4. one-step updates applied token by token == the whole-sequence op, gradients included
# --------------------------------------------------------------------------------------------


def conv_steps(x, weight, bias=None, activation=None, backend=None):
    """causal_conv1d_update over x's time steps from a zero state; returns (y, final conv_state)."""
    batch, dim, seqlen = x.shape
    state = x.new_zeros(batch, dim, weight.shape[1])
    ys = [
        ops.causal_conv1d_update(x[:, :, t], state, weight, bias, activation, backend=backend)
        for t in range(seqlen)
    ]
    return torch.stack(ys, dim=-1), state


def mamba1_steps(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_final_state=True,
    backend=None,
):
    """selective_state_update with Mamba-1 shapes, one time step at a time; returns (y, final
    state)."""
    state = initial_state.clone()
    ys = [
        ops.selective_state_update(
            state,
            u[..., t],
            delta[..., t],
            A,
            B[..., t],
            C[..., t],
            D=D,
            z=None if z is None else z[..., t],
            dt_bias=delta_bias,
            dt_softplus=delta_softplus,
            backend=backend,
        )
        for t in range(u.shape[-1])
    ]
    return torch.stack(ys, dim=-1), state


def mamba2_steps(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=None,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    initial_states=None,
    return_final_states=True,
    backend=None,
):
    """selective_state_update with Mamba-2 head shapes (state (b, h, p, n), A (h, p, n), D and
    dt_bias (h, p)) built from ssd_scan's inputs, one time step at a time; returns (y, final
    state)."""
    headdim, dstate = x.shape[3], B.shape[3]
    per_channel = lambda v: v.unsqueeze(-1).expand(*v.shape, headdim)  # noqa: E731  (..., h) -> (..., h, p)
    A_hpn = A[:, None, None].expand(A.shape[0], headdim, dstate)
    D_hp = None if D is None else (D if D.dim() == 2 else per_channel(D))
    state = initial_states.clone()
    ys = [
        ops.selective_state_update(
            state,
            x[:, t],
            per_channel(dt[:, t]),
            A_hpn,
            B[:, t],
            C[:, t],
            D=D_hp,
            z=None if z is None else z[:, t],
            dt_bias=None if dt_bias is None else per_channel(dt_bias),
            dt_softplus=dt_softplus,
            backend=backend,
        )
        for t in range(x.shape[1])
    ]
    return torch.stack(ys, dim=1), state


STATE_UPDATE_CASES = {
    "mamba1": (mamba1_steps, ops.selective_scan_reference, lambda: scan_inputs(seqlen=6)),
    "mamba1-grouped-BC": (
        mamba1_steps,
        ops.selective_scan_reference,
        lambda: scan_inputs(seqlen=6, ngroups=2),
    ),
    "mamba1-bare": (
        mamba1_steps,
        ops.selective_scan_reference,
        lambda: scan_inputs(seqlen=6, D=False, z=False, delta_bias=False, softplus=False),
    ),
    "mamba2": (mamba2_steps, ops.ssd_reference, lambda: ssd_inputs(seqlen=6)),
    "mamba2-D-per-channel": (
        mamba2_steps,
        ops.ssd_reference,
        lambda: ssd_inputs(seqlen=6, ngroups=1, D="channels"),
    ),
}


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(STATE_UPDATE_CASES.values()), ids=list(STATE_UPDATE_CASES))
def test_selective_state_update_steps_match_scan(case, backend):
    steps, scan, make_inputs = case
    inputs = make_inputs()
    y, state = steps(**inputs, backend=backend)
    want_y, want_state = scan(**inputs)
    assert_close(y, want_y, REL_TOL, "y")
    assert_close(state, want_state, REL_TOL, "final state")


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("case", list(STATE_UPDATE_CASES.values()), ids=list(STATE_UPDATE_CASES))
def test_selective_state_update_in_place_steps_match_scan(monkeypatch, case, mode):
    """Without autograd (generation) the torch backend updates the state in place (Mamba-2: one
    decay per head, a batched outer product): the same outputs and final state as the scan."""
    steps, scan, make_inputs = case
    inputs = {k: v.detach() if torch.is_tensor(v) else v for k, v in make_inputs().items()}
    calls = []
    real = STEP._state_update_in_place
    monkeypatch.setattr(STEP, "_state_update_in_place", lambda *a: calls.append(1) or real(*a))
    with getattr(torch, mode)():
        y, state = steps(**inputs, backend="torch")
    assert len(calls) == inputs["x" if "x" in inputs else "u"].shape[1 if "x" in inputs else -1]
    want_y, want_state = scan(**inputs)
    assert_close(y, want_y, REL_TOL, "y")
    assert_close(state, want_state, REL_TOL, "final state")


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(STATE_UPDATE_CASES.values()), ids=list(STATE_UPDATE_CASES))
def test_selective_state_update_steps_gradients_match_scan(case, backend):
    steps, scan, make_inputs = case
    assert_same_forward_backward(with_backend(steps, backend), scan, make_inputs(), REL_TOL)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(CONV_CASES.values()), ids=list(CONV_CASES))
def test_causal_conv1d_update_steps_match_conv(case, backend):
    inputs = conv_inputs(**case)
    y, state = conv_steps(**inputs, backend=backend)
    assert_close(y, ops.causal_conv1d_reference(**inputs), REL_TOL, "y")
    width = inputs["weight"].shape[1]
    # the last `width` inputs, zeros before t=0
    last_inputs = F.pad(inputs["x"], (width, 0))[:, :, -width:]
    assert torch.equal(state, last_inputs)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(CONV_CASES.values()), ids=list(CONV_CASES))
def test_causal_conv1d_update_steps_gradients_match_conv(case, backend):
    assert_same_forward_backward(
        lambda **kw: conv_steps(**kw, backend=backend)[0],
        ops.causal_conv1d_reference,
        conv_inputs(**case),
        REL_TOL,
    )


# --------------------------------------------------------------------------------------------
# 2. bf16 inputs on the torch backend vs the fp32 reference on the same values
# --------------------------------------------------------------------------------------------

BF16_CASES = {
    # op: (torch-backend call, fp32 reference, inputs, names of the inputs given in bf16)
    "selective_scan": (
        with_backend(ops.selective_scan, "torch"),
        ops.selective_scan_reference,
        lambda: scan_inputs(ngroups=2),
        ("u", "delta", "B", "C", "z"),
    ),
    "ssd_scan": (
        with_backend(ops.ssd_scan, "torch"),
        ops.ssd_reference,
        lambda: ssd_inputs(),
        ("x", "dt", "B", "C", "z"),
    ),
    "causal_conv1d": (
        with_backend(ops.causal_conv1d, "torch"),
        ops.causal_conv1d_reference,
        lambda: conv_inputs(),
        ("x",),
    ),
    "rms_norm_gated": (
        with_backend(ops.rms_norm_gated, "torch"),
        with_backend(ops.rms_norm_gated, "reference"),
        lambda: norm_inputs(group_size=4, norm_before_gate=False),
        ("x", "z"),
    ),
}


@pytest.mark.parametrize("case", list(BF16_CASES.values()), ids=list(BF16_CASES))
def test_bf16_inputs_match_fp32_reference(monkeypatch, case):
    fn, reference, make_inputs, bf16_names = case
    set_scan_chunk(monkeypatch, 3, batch=2, dim=4, dstate=3)  # the selective scan case's shapes
    inputs = make_inputs()
    inputs.update({k: inputs[k].bfloat16() for k in bf16_names})
    upcast = {k: v.float() if torch.is_tensor(v) else v for k, v in inputs.items()}
    outs = fn(**inputs)
    y = outs[0] if isinstance(outs, tuple) else outs
    assert y.dtype == torch.bfloat16
    if isinstance(outs, tuple):
        assert outs[1].dtype == torch.float32, "the final state is fp32"
    assert_same_forward_backward(fn, reference, inputs, BF16_TOL, oracle_inputs=upcast)


# --------------------------------------------------------------------------------------------
# 3. SSD details: segsum, dt_limit
# --------------------------------------------------------------------------------------------


def test_segsum_matches_double_loop():
    a = randn(gen(0), 2, 3, 7)
    out = ops.segsum(a)
    T = a.shape[-1]
    want = torch.full((2, 3, T, T), -torch.inf)
    for t in range(T):
        for s in range(t + 1):
            want[..., t, s] = a[..., s + 1 : t + 1].sum(-1)
    assert torch.equal(torch.isinf(out), torch.isinf(want))
    assert (out[torch.isinf(out)] < 0).all()
    finite = ~torch.isinf(want)
    assert_close(out[finite], want[finite], REL_TOL, "segsum")


def test_ssd_dt_limit_clamps_dt():
    inputs = with_wide_dt(ssd_inputs(seqlen=13, chunk_size=4))
    dt = ops.discretize_dt(inputs["dt"], inputs["dt_bias"], dt_softplus=True)
    assert (dt < DT_LIMIT[0]).any() and (dt > DT_LIMIT[1]).any(), (
        "the test needs Δ on both sides of the limit"
    )
    # oracle: Δ clamped by hand, fed as a plain step size
    by_hand = {**inputs, "dt": dt.clamp(*DT_LIMIT), "dt_bias": None, "dt_softplus": False}
    want = ops.ssd_reference(**by_hand)
    limited = {**inputs, "dt_limit": DT_LIMIT}
    views = {
        "reference": ops.ssd_reference,
        "quadratic": ops.ssd_quadratic,
        "chunked": ops.ssd_chunked,
        "ssd_scan(backend='torch')": with_backend(ops.ssd_scan, "torch"),
    }
    for name, fn in views.items():
        got = fn(**limited)
        assert_close(got[0], want[0], REL_TOL, f"{name} y")
        assert_close(got[1], want[1], REL_TOL, f"{name} final state")
    for fn in (ops.ssd_quadratic, ops.ssd_chunked):
        assert_same_forward_backward(fn, ops.ssd_reference, limited, REL_TOL)
    unclamped = ops.ssd_chunked(**inputs)
    assert rel_err(unclamped[0], want[0]) > 0.1


# --------------------------------------------------------------------------------------------
# 4. closed forms and second paths for the whole-sequence ops
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_selective_scan_without_decay_is_cumsum(monkeypatch, backend):
    """A = 0, B = C = 1: every state component is h0 + cumsum(Δ u), y = Σ_n h_n."""
    batch, dim, dstate, seqlen = 2, 3, 4, 10
    set_scan_chunk(monkeypatch, 3, batch, dim, dstate)
    g = gen(0)
    u, delta = randn(g, batch, dim, seqlen), rand(g, batch, dim, seqlen, lo=0.1, hi=1.0)
    h0 = randn(g, batch, dim, dstate)
    ones = torch.ones(batch, dstate, seqlen)
    y, h = ops.selective_scan(
        u,
        delta,
        torch.zeros(dim, dstate),
        ones,
        ones,
        initial_state=h0,
        return_final_state=True,
        backend=backend,
    )
    cum = torch.cumsum(delta * u, dim=-1)
    assert_close(y, h0.sum(-1, keepdim=True) + dstate * cum, REL_TOL, "y")
    assert_close(h, h0 + cum[:, :, -1:], REL_TOL, "final state")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_selective_scan_zero_input_decays_initial_state(monkeypatch, backend):
    """u = 0, C = 1: y_t = Σ_n h0_n exp(A_n Σ_{k<=t} Δ_k)."""
    batch, dim, dstate, seqlen = 2, 3, 4, 10
    set_scan_chunk(monkeypatch, 3, batch, dim, dstate)
    g = gen(1)
    delta, A = rand(g, batch, dim, seqlen, lo=0.1, hi=0.5), -rand(g, dim, dstate, lo=0.2, hi=2.0)
    h0, B = randn(g, batch, dim, dstate), randn(g, batch, dstate, seqlen)
    y, h = ops.selective_scan(
        torch.zeros(batch, dim, seqlen),
        delta,
        A,
        B,
        torch.ones(batch, dstate, seqlen),
        initial_state=h0,
        return_final_state=True,
        backend=backend,
    )
    decay = torch.exp(
        A[None, :, :, None] * torch.cumsum(delta, dim=-1)[:, :, None, :]
    )  # (b, d, n, t)
    assert_close(y, (h0[..., None] * decay).sum(2), REL_TOL, "y")
    assert_close(h, h0 * decay[..., -1], REL_TOL, "final state")


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(CONV_CASES.values()), ids=list(CONV_CASES))
def test_causal_conv1d_matches_symmetric_padded_conv(case, backend):
    """Second path: pad W-1 on both sides (like nn.Conv1d(padding=W-1)) and keep the first seqlen
    outputs."""
    inputs = conv_inputs(**case)
    x, weight, bias = inputs["x"], inputs["weight"], inputs.get("bias")
    width, seqlen = weight.shape[1], x.shape[2]
    want = F.conv1d(x, weight[:, None, :], bias, padding=width - 1, groups=x.shape[1])[
        :, :, :seqlen
    ]
    if inputs["activation"] is not None:
        want = want * torch.sigmoid(want)
    assert_close(ops.causal_conv1d(**inputs, backend=backend), want, REL_TOL, "y")


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_rms_norm_gated_one_group_is_gated_rms_norm(backend, norm_before_gate):
    inputs = norm_inputs(group_size=8, norm_before_gate=norm_before_gate)
    x, w, z = inputs["x"], inputs["weight"], inputs["z"]
    gate = z * torch.sigmoid(z)
    if norm_before_gate:
        want = ops.rms_norm(x, w, backend=backend) * gate
    else:
        want = ops.rms_norm(x * gate, w, backend=backend)
    assert_close(ops.rms_norm_gated(**inputs, backend=backend), want, REL_TOL, "y")
    assert_close(
        ops.rms_norm_gated(x, w, backend=backend),
        ops.rms_norm(x, w, backend=backend),
        REL_TOL,
        "no z",
    )


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_rms_norm_gated_groups_by_hand(backend, group_size):
    eps = 1e-5
    inputs = norm_inputs(group_size=group_size, norm_before_gate=False, eps=eps)
    x, w, z = inputs["x"], inputs["weight"], inputs["z"]
    v = x * z * torch.sigmoid(z)
    parts = []
    for s in range(0, v.shape[-1], group_size):
        part = v[..., s : s + group_size]
        parts.append(part / torch.sqrt((part**2).mean(-1, keepdim=True) + eps))
    want = torch.cat(parts, dim=-1) * w
    assert_close(ops.rms_norm_gated(**inputs, backend=backend), want, REL_TOL, "y")


# --------------------------------------------------------------------------------------------
# 5. transformers' pure-PyTorch implementations as an outside oracle
# --------------------------------------------------------------------------------------------


def hf_selective_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_final_state=False,
):
    """transformers' Mamba-1 scan (no grouped B/C, no initial state) with our argument names."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    return mamba_selective_scan(
        u,
        delta,
        A,
        B,
        C,
        D=D,
        z=z,
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        return_last_state=return_final_state,
    )


def hf_ssd_scan(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    dt_bias=None,
    dt_softplus=False,
    initial_states=None,
    return_final_states=False,
    dt_limit=(0.0, float("inf")),
):
    """transformers' Mamba-2 chunked scan (no z gate, D per head only) with our argument names."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    return mamba2_chunk_scan(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=D,
        dt_bias=dt_bias,
        initial_states=initial_states,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        return_final_states=return_final_states,
    )


@pytest.mark.parametrize(
    "case",
    [
        dict(h0=False),
        dict(h0=False, D=False, z=False, delta_bias=False, softplus=False),
    ],
    ids=["all-options", "bare"],
)
def test_selective_scan_matches_transformers(monkeypatch, case):
    inputs = scan_inputs(**case)
    set_scan_chunk(monkeypatch, 4, 2, 4, 3)
    assert_same_forward_backward(
        with_backend(ops.selective_scan, "torch"), hf_selective_scan, inputs, REL_TOL
    )


@pytest.mark.parametrize(
    "case",
    [
        dict(z=False),
        dict(z=False, h0=False, chunk_size=16, ngroups=1),
        dict(z=False, D=None, dt_bias=False, softplus=False, chunk_size=3, ngroups=4),
    ],
    ids=["all-options", "one-group-chunk-larger-than-seqlen", "bare"],
)
def test_ssd_scan_matches_transformers(case):
    inputs = ssd_inputs(**case)
    assert_same_forward_backward(with_backend(ops.ssd_scan, "torch"), hf_ssd_scan, inputs, REL_TOL)
    limited = {**with_wide_dt(inputs), "dt_limit": DT_LIMIT}
    assert_same_forward_backward(with_backend(ops.ssd_scan, "torch"), hf_ssd_scan, limited, REL_TOL)


# --------------------------------------------------------------------------------------------
# 6. backend selection
# --------------------------------------------------------------------------------------------


def op_calls():
    """For every op with a backend choice: (function, small valid inputs)."""
    g = gen(0)
    return {
        "selective_scan": (ops.selective_scan, scan_inputs(seqlen=3)),
        "selective_state_update": (
            ops.selective_state_update,
            dict(
                state=randn(g, 2, 4, 3),
                x=randn(g, 2, 4),
                dt=rand(g, 2, 4),
                A=-rand(g, 4, 3),
                B=randn(g, 2, 3),
                C=randn(g, 2, 3),
            ),
        ),
        "ssd_scan": (ops.ssd_scan, ssd_inputs(seqlen=3)),
        "causal_conv1d": (ops.causal_conv1d, conv_inputs(seqlen=3)),
        "causal_conv1d_update": (
            ops.causal_conv1d_update,
            dict(x=randn(g, 2, 3), conv_state=randn(g, 2, 3, 4), weight=randn(g, 3, 4)),
        ),
        "rms_norm": (ops.rms_norm, norm_inputs(z=False)),
        "rms_norm_gated": (ops.rms_norm_gated, norm_inputs()),
        **mamba3_op_calls(g),
    }


def mamba3_op_calls(g):
    """Mamba-3's ops (tests/unit/models/test_mamba3.py tests them): a 2-step SISO scan, a rank-2
    MIMO scan, one step."""
    b, L, h, p, n, S = 1, 2, 2, 3, 4, 1
    scan = dict(
        x=randn(g, b, L, h, p),
        dt=rand(g, b, L, h),
        A=-rand(g, b, L, h),
        trap=randn(g, b, L, h),
        angles=randn(g, b, L, h, S),
    )
    siso = dict(
        scan,
        B=randn(g, b, L, 1, 1, n),
        C=randn(g, b, L, 1, 1, n),
        B_bias=randn(g, h, 1, n),
        C_bias=randn(g, h, 1, n),
    )
    mimo = dict(
        scan,
        B=randn(g, b, L, 2, 1, n),
        C=randn(g, b, L, 2, 1, n),
        B_bias=randn(g, h, 2, n),
        C_bias=randn(g, h, 2, n),
        mimo_x=randn(g, h, 2, p),
    )
    states = [randn(g, b, h, S), randn(g, b, h, p, n), randn(g, b, 1, h, n), randn(g, b, h, p)]
    step = {
        k: v[:, 0] if k in ("x", "dt", "A", "trap", "angles", "B", "C") else v
        for k, v in siso.items()
    }
    return {
        "mamba3_siso": (ops.mamba3_scan, siso),
        "mamba3_mimo": (ops.mamba3_scan, mimo),
        "mamba3_step": (ops.mamba3_step, dict(step, states=states)),
    }


def test_every_op_is_covered():
    assert op_calls().keys() == KERNEL_MODULES.keys()


@pytest.mark.parametrize("how", ["env", "argument"])
@pytest.mark.parametrize("op", list(KERNEL_MODULES))
def test_forced_cuda_on_cpu_tensors_raises(monkeypatch, op, how):
    fn, inputs = op_calls()[op]
    if how == "env":
        monkeypatch.setenv("SSMKIT_BACKEND", "cuda")
    else:
        monkeypatch.delenv("SSMKIT_BACKEND", raising=False)
        inputs["backend"] = "cuda"
    with pytest.raises(BackendError, match=rf"'cuda' was forced for {op} but cannot run: \S+"):
        fn(**inputs)


@pytest.mark.parametrize("how", ["env", "argument"])
@pytest.mark.parametrize("op", ["selective_scan", "ssd_scan", "rms_norm"])
def test_unknown_backend_name_raises(monkeypatch, op, how):
    fn, inputs = op_calls()[op]
    if how == "env":
        monkeypatch.setenv("SSMKIT_BACKEND", "tpu")
    else:
        inputs["backend"] = "tpu"
    with pytest.raises(
        BackendError, match=r"'tpu' is not a backend; valid values: reference, torch, cpu, cuda"
    ):
        fn(**inputs)


@pytest.mark.parametrize("op", list(KERNEL_MODULES))
def test_select_order_argument_env_automatic(monkeypatch, op):
    x = torch.zeros(2)
    monkeypatch.delenv("SSMKIT_BACKEND", raising=False)
    # automatic on CPU tensors: the fused CPU kernel where the op has one (and it builds)
    fused = op in ops.backend.CPU_KERNELS and ops.backend.cpu_kernel_error(op) is None
    assert ops.backend.select(op, x) == ("cpu" if fused else "torch")
    monkeypatch.setenv("SSMKIT_BACKEND", "reference")
    assert ops.backend.select(op, x) == "reference"
    assert ops.backend.select(op, x, backend="torch") == "torch"
    monkeypatch.setenv("SSMKIT_BACKEND", "torch")
    assert ops.backend.select(op, x, backend="reference") == "reference"


@pytest.mark.parametrize("env", [None, "reference", "torch"])
@pytest.mark.parametrize(
    "module, op",
    [(SCAN, "selective_scan"), (SSD, "ssd_scan"), (CONV, "causal_conv1d")],
    ids=["selective_scan", "ssd_scan", "causal_conv1d"],
)
def test_dispatch_runs_the_selected_implementation(monkeypatch, module, op, env):
    """A spy on each implementation records which one a call without ``backend=`` runs."""
    calls = []
    for name in ("reference", "torch", "cpu"):
        if name not in module._IMPLS:
            continue
        real = module._IMPLS[name]
        monkeypatch.setitem(
            module._IMPLS, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k)
        )
    if env is None:
        monkeypatch.delenv("SSMKIT_BACKEND", raising=False)
    else:
        monkeypatch.setenv("SSMKIT_BACKEND", env)
    fn, inputs = op_calls()[op]
    fn(**inputs)
    # automatic: the fused CPU kernel where the op has one that builds, else torch
    assert calls == [env or ops.backend.select(op, torch.zeros(1))]


def test_env_reference_gives_reference_results(monkeypatch):
    fn, inputs = op_calls()["selective_scan"]
    monkeypatch.setenv("SSMKIT_BACKEND", "reference")
    y, h = fn(**inputs)
    want_y, want_h = ops.selective_scan_reference(**inputs)
    assert torch.equal(y, want_y) and torch.equal(h, want_h)


def test_env_report_names_torch_and_every_op(monkeypatch):
    monkeypatch.delenv("SSMKIT_BACKEND", raising=False)
    report = ssmkit.env_report()
    assert isinstance(report, str)
    assert torch.__version__ in report
    for op in KERNEL_MODULES:
        assert re.search(rf"^\s+{op}\s+(reference|torch|cpu|cuda)\b", report, re.M), (
            f"{op} missing from:\n{report}"
        )


# --------------------------------------------------------------------------------------------
# 7. bad input: ValueError naming the argument and the expected shape
# --------------------------------------------------------------------------------------------


def _bad(fn, make_inputs, **changes):
    return lambda backend: fn(**{**make_inputs(), **changes}, backend=backend)


BAD_INPUTS = {
    "scan-delta-shape": (
        _bad(ops.selective_scan, scan_inputs, delta=torch.zeros(2, 4, 10)),
        r"u and delta must both be \(batch, dim, seqlen\)",
    ),
    "scan-A-dim": (
        _bad(ops.selective_scan, scan_inputs, A=torch.zeros(5, 3)),
        r"A must be \(dim=4, dstate\); got \(5, 3\)",
    ),
    "scan-B-seqlen": (
        _bad(ops.selective_scan, scan_inputs, B=torch.zeros(2, 3, 10)),
        r"B must be \(batch=2, dstate=3, seqlen=11\) .*got \(2, 3, 10\)",
    ),
    "scan-C-ngroups": (
        _bad(ops.selective_scan, scan_inputs, C=torch.zeros(2, 3, 3, 11)),
        r"C must be .*ngroups dividing dim=4; got \(2, 3, 3, 11\)",
    ),
    "scan-initial-state": (
        _bad(ops.selective_scan, scan_inputs, initial_state=torch.zeros(2, 4, 2)),
        r"initial_state must be \(batch=2, dim=4, dstate=3\); got \(2, 4, 2\)",
    ),
    "ssd-x-dims": (
        _bad(ops.ssd_scan, ssd_inputs, x=torch.zeros(2, 11, 12)),
        r"x must be \(batch, seqlen, nheads, headdim\)",
    ),
    "ssd-dt": (
        _bad(ops.ssd_scan, ssd_inputs, dt=torch.zeros(2, 11, 3)),
        r"dt must be \(batch=2, seqlen=11, nheads=4\); got \(2, 11, 3\)",
    ),
    "ssd-A": (
        _bad(ops.ssd_scan, ssd_inputs, A=torch.zeros(3)),
        r"A must be \(nheads=4,\); got \(3,\)",
    ),
    "ssd-ngroups": (
        _bad(ops.ssd_scan, ssd_inputs, B=torch.zeros(2, 11, 3, 5), C=torch.zeros(2, 11, 3, 5)),
        r"B must be .*ngroups dividing nheads=4",
    ),
    "ssd-initial-states": (
        _bad(ops.ssd_scan, ssd_inputs, initial_states=torch.zeros(2, 4, 3, 4)),
        r"initial_states must be \(batch=2, nheads=4, headdim=3, dstate=5\); "
        r"got \(2, 4, 3, 4\)",
    ),
    "ssd-chunk-size": (
        lambda backend: ops.ssd_chunked(**{**ssd_inputs(), "chunk_size": 0}),
        r"chunk_size must be a positive integer; got 0",
    ),
    "conv-weight-dim": (
        _bad(ops.causal_conv1d, conv_inputs, weight=torch.zeros(4, 4)),
        r"weight \(dim, width\) with the same dim; got x \(2, 3, 9\), weight \(4, 4\)",
    ),
    "conv-bias": (
        _bad(ops.causal_conv1d, conv_inputs, bias=torch.zeros(4)),
        r"bias must be \(dim=3,\); got \(4,\)",
    ),
    "conv-activation": (
        _bad(ops.causal_conv1d, conv_inputs, activation="relu7"),
        r"activation must be one of: gelu, .*silu.*; got 'relu7'",
    ),
    "conv-update-weight": (  # a weight of 4 channels for x's 3 (a state longer than the
        # window is valid: causal-conv1d's state_len >= width - 1)
        lambda backend: ops.causal_conv1d_update(
            torch.zeros(2, 3), torch.zeros(2, 3, 4), torch.zeros(4, 2), backend=backend
        ),
        r"weight \(dim, width\); got x \(2, 3\), conv_state \(2, 3, 4\), weight \(4, 2\)",
    ),
    "norm-weight": (
        _bad(ops.rms_norm, lambda: norm_inputs(z=False), weight=torch.ones(7)),
        r"weight must be \(d=8,\)",
    ),
    "norm-gated-group-size": (
        _bad(ops.rms_norm_gated, lambda: norm_inputs(group_size=3)),
        r"group_size dividing d; .*group_size 3",
    ),
    "norm-gated-z-shape": (
        _bad(ops.rms_norm_gated, norm_inputs, z=torch.zeros(2, 5, 4)),
        r"expected x and z \(\.\.\., d\).*z \(2, 5, 4\)",
    ),
    "state-update-A": (
        lambda backend: ops.selective_state_update(
            torch.zeros(2, 4, 3),
            torch.zeros(2, 4),
            torch.zeros(2, 4),
            torch.zeros(3, 4),
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            backend=backend,
        ),
        r"\bA\b.*\(dim=4, dstate=3\)",
    ),
}


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_input_raises_value_error(case, backend):
    call, message = case
    with pytest.raises(ValueError, match=message):
        call(backend)


@pytest.mark.parametrize("seqlen", [1, 3, 17])
def test_causal_conv1d_channels_last_view_matches_reference(seqlen):
    """The mixers pass (batch, dim, seqlen) views of (batch, seqlen, dim) memory; the torch backend
    takes its shifted-rows path there and must keep that layout."""
    g = gen(11)
    x = randn(g, 2, seqlen, 6).transpose(1, 2).requires_grad_()
    weight, bias = randn(g, 6, 4).requires_grad_(), randn(g, 6).requires_grad_()
    inputs = dict(x=x, weight=weight, bias=bias, activation="silu")
    assert_same_forward_backward(
        ops.causal_conv1d_torch, ops.causal_conv1d_reference, inputs, REL_TOL
    )
    assert ops.causal_conv1d_torch(x, weight, bias).stride(1) == 1


def test_torch_threads_sets_and_restores_even_on_an_error():
    from ssmkit.env import torch_threads

    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"), torch_threads(1):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="integer >= 1"), torch_threads(bad):
            pass
