"""Per-sample states in one packed call, SSD and Mamba-3: ``initial_sample_states`` /
``return_sample_states`` with ``seq_idx``.

The oracle: every sample run alone as a batch of one through the reference recurrence, from its own
initial state (``initial_states``) and with ``return_final_states``; its outputs concatenated in
place, its final states stacked in the numbering of ``ops.sample_numbers``. Every backend (the
reference itself, the quadratic and chunked views, the torch dispatch, the compiled path's wiring
and the cuda path's wiring with fake kernels bound to the real signatures) must give the same
outputs, final states and gradients of one random linear function of both with respect to every
input and every initial state: max |diff| <= 1e-5 x max(1, max |oracle|), fp32.

The rows hold samples of length 1 (at a row's start and end), 2, 3, 5, 7, 9 and a row that is one
sample; chunks of 1, 3, 4, 8 and 16 and of the whole row put sample boundaries inside chunks, on
their edges and samples across several of them.
"""

from __future__ import annotations

import inspect
import sys

import fake_kernels as dispatch
import pytest
import torch

from ssmkit import ops
from ssmkit.ops import backend, compiled, sample_states

SSD = sys.modules["ssmkit.ops.ssd"]
MAMBA3 = sys.modules["ssmkit.ops.mamba3"]

SEQ = torch.tensor(
    [
        [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3],  # 3, 2, 5, 2
        [0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2],  # 1, 7, 4
        [2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4],  # 2, 9, 1
        [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5],  # 12
    ],
    dtype=torch.int32,
)
B_, L_ = SEQ.shape


def spans(seq):
    """(row, start, end) of every sample, in the numbering of ops.sample_numbers."""
    return list(zip(*(t.tolist() for t in ops.sample_spans(seq))))


SPANS = spans(SEQ)
N_ = len(SPANS)


def random_rows(seed, rows=3, length=21):
    """Rows of random sample lengths (a new sample after each step with probability 0.3, so
    lengths of 1 come up), each starting at a random sample index."""
    g = torch.Generator().manual_seed(seed)
    cuts = (torch.rand(rows, length - 1, generator=g) < 0.3).int()
    first = torch.randint(0, 3, (rows, 1), generator=g, dtype=torch.int32)
    return torch.cat([first, first + cuts.cumsum(1, dtype=torch.int32)], 1)


def rnd(seed, *shape, grad=True, scale=1.0):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return t.requires_grad_(grad)


def close(a, b, tol=1e-5, what=""):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err, scale = (a.double() - b.double()).abs().max().item(), max(1.0, b.abs().max().item())
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol:g} x {scale:.3g}"
    return err / scale


def flat(out):
    y, states = out if isinstance(out, tuple) else (out, None)
    if states is None:
        return [y]
    return [y, *(states if isinstance(states, tuple) else (states,))]


_ORACLES = {}


def same_with_grads(got, want, inputs, key=None):
    """Values and the gradients of one random linear function of all outputs agree; returns the
    largest relative difference seen. ``want``: the oracle's outputs, or a function making them;
    with ``key`` its values and gradients are made once and serve every test of that key (which
    builds the same seeded inputs, in the same order)."""
    got = flat(got)
    if key is None or key not in _ORACLES:
        outs = flat(want() if callable(want) else want)
        weights = [
            torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
            for i, t in enumerate(outs)
        ]
        loss = sum((w * t).sum() for w, t in zip(weights, outs))
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        entry = [t.detach() for t in outs], weights, grads
        if key is not None:
            _ORACLES[key] = entry
    values, weights, grads_want = _ORACLES[key] if key is not None else entry
    worst = max(close(a, b, what=f"output {i}") for i, (a, b) in enumerate(zip(got, values)))
    loss = sum((w * t).sum() for w, t in zip(weights, got))
    grads_got = torch.autograd.grad(loss, inputs, allow_unused=True)
    for i, (a, b) in enumerate(zip(grads_got, grads_want)):
        if b is None:
            assert a is None or not a.any(), f"gradient of input {i}: the oracle's is 0"
            continue
        a = torch.zeros_like(b) if a is None else a
        worst = max(worst, close(a, b, what=f"gradient of input {i}"))
    return worst


def alone(run, states, seq=SEQ):
    """``run(row, start, end, i) -> (y, final)`` for every sample i: the ys in place (rows along
    dim 0, time along dim 1) and the finals stacked (a tuple of stacks for Mamba-3)."""
    where = spans(seq)
    outs = [run(r, s, e, i) for i, (r, s, e) in enumerate(where)]
    y = torch.cat(
        [
            torch.cat([o[0] for o, (r, _, _) in zip(outs, where) if r == row], 1)
            for row in range(seq.shape[0])
        ]
    )
    if not states:
        return y
    finals = [o[1] for o in outs]
    if isinstance(finals[0], torch.Tensor):
        return y, torch.cat(finals)
    return y, ops.Mamba3States(*map(torch.cat, zip(*finals)))


# ---------------------------------------------------------------------------------------------
# fake kernels that take the varlen form (cu_seqlens) and per-sequence states
# ---------------------------------------------------------------------------------------------


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def _pieces(seq_idx_row):
    vals, out, start = seq_idx_row.tolist(), [], 0
    for t in range(1, len(vals) + 1):
        if t == len(vals) or vals[t] != vals[t - 1]:
            out.append((start, t))
            start = t
    return out


def fake_ssd(
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
    """mamba_chunk_scan_combined with seq_idx (each sample from zero: no initial states are passed
    in per-sample mode) and the varlen states (batch 1, cu_seqlens), which have no backward."""
    assert seq_idx is not None and seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
    assert initial_states is None and not return_final_states
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if return_varlen_states:
        assert x.shape[0] == 1 and cu_seqlens.dtype == torch.int32
        assert not _needs_grad(x, dt, A, B, C, D, z, dt_bias), (
            "return_varlen_states is not supported in backward"
        )
    ys, finals = [], []
    for r in range(x.shape[0]):
        row = []
        for s, e in _pieces(seq_idx[r]):
            cut = lambda t: None if t is None else t[r : r + 1, s:e]  # noqa: E731
            y, h = ops.ssd_reference(
                cut(x), cut(dt), A, cut(B), cut(C), z=cut(z), return_final_states=True, **kw
            )
            row.append(y)
            finals.append(h)
        ys.append(torch.cat(row, 1))
    y = torch.cat(ys)
    if not return_varlen_states:
        return y
    assert [0, *torch.tensor([e - s for s, e in _pieces(seq_idx[0])]).cumsum(0).tolist()] == (
        cu_seqlens.tolist()
    )
    return y, torch.cat(finals)


def _varlen(cu_seqlens, total, run):
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1
    assert int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == total
    cuts = cu_seqlens.tolist()
    return [run(i, s, e) for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:]))]


def fake_siso(
    Q,
    K,
    V,
    ADT,
    DT,
    Trap,
    Q_bias,
    K_bias,
    Angles,
    D=None,
    Z=None,
    Input_States=None,
    chunk_size=64,
    return_final_states=False,
    cu_seqlens=None,
):
    """mamba3_siso_combined's varlen form: batch 1, one initial and one final state per sequence
    (its documented Input_States / return_final_states with cu_seqlens), differentiable."""
    assert cu_seqlens is not None and Q.shape[0] == 1

    def one(i, s, e):
        return dispatch.mamba3_siso_combined(
            Q[:, s:e],
            K[:, s:e],
            V[:, s:e],
            ADT[..., s:e],
            DT[..., s:e],
            Trap[..., s:e],
            Q_bias,
            K_bias,
            Angles[:, s:e],
            D,
            None if Z is None else Z[:, s:e],
            None if Input_States is None else tuple(t[i : i + 1] for t in Input_States),
            chunk_size,
            True,
        )

    outs = _varlen(cu_seqlens, Q.shape[1], one)
    y = torch.cat([o[0] for o in outs], 1)
    if not return_final_states:
        return y
    return (y, *(torch.cat(parts) for parts in zip(*(o[1:] for o in outs))))


def fake_mimo(
    Q,
    K,
    V,
    ADT,
    DT,
    Trap,
    Q_bias,
    K_bias,
    MIMO_V,
    MIMO_Z,
    MIMO_Out,
    Angles,
    D,
    Z,
    chunk_size,
    rotary_dim_divisor,
    dtype,
    return_state=False,
    cu_seqlens=None,
    fuse_pregate_headwise_rms_norm=False,
    outproj_norm_weight=None,
    outproj_norm_eps=1e-5,
):
    """mamba3_mimo's varlen form: batch 1, no initial states; its final states are per sequence but
    carry no gradient, and its last V is the batch's (V[:, -1]), as mamba_ssm's code returns."""
    assert cu_seqlens is not None and Q.shape[0] == 1
    if return_state:
        assert not _needs_grad(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, D, Z)

    def one(i, s, e):
        return dispatch.mamba3_mimo(
            Q[:, s:e],
            K[:, s:e],
            V[:, s:e],
            ADT[..., s:e],
            DT[..., s:e],
            Trap[..., s:e],
            Q_bias,
            K_bias,
            MIMO_V,
            MIMO_Z,
            MIMO_Out,
            Angles[:, s:e],
            D,
            None if Z is None else Z[:, s:e],
            chunk_size,
            rotary_dim_divisor,
            dtype,
            True,
        )

    outs = _varlen(cu_seqlens, Q.shape[1], one)
    y = torch.cat([o[0] for o in outs], 1)
    if not return_state:
        return y
    angle, ssm, k = (torch.cat(parts).detach() for parts in zip(*(o[1:4] for o in outs)))
    return y, angle, ssm, k, V[:, -1].detach()


VARLEN_FAKES = {
    "mamba_ssm.ops.triton.ssd_combined": ("mamba_chunk_scan_combined", fake_ssd),
    "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined": ("mamba3_siso_combined", fake_siso),
    "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo": ("mamba3_mimo", fake_mimo),
}


@pytest.fixture
def varlen_kernels(request, monkeypatch):
    """tests/fake_kernels.py's modules installed, the SSD and Mamba-3 scans replaced by the fakes
    above (each call bound to the real signature and recorded), every op routed to cuda."""
    calls = request.getfixturevalue("fake_kernels")
    for module, (name, fn) in VARLEN_FAKES.items():
        signature = inspect.signature(getattr(dispatch, name))

        def spy(*args, _fn=fn, _name=name, _sig=signature, **kwargs):
            calls.append((_name, _sig.bind(*args, **kwargs).arguments))
            return _fn(*args, **kwargs)

        monkeypatch.setattr(sys.modules[module], name, spy)
    monkeypatch.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
    return calls


# ---------------------------------------------------------------------------------------------
# the two passes over the tokens
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_tokens, matmul_tokens", [(1, 8), (3, 2), (4, 4), (None, 100)])
@pytest.mark.parametrize("rank", [1, 2])
def test_read_and_sum_by_pieces_equal_the_dense_sums(
    monkeypatch, block_tokens, matmul_tokens, rank
):
    """Samples of at least ``matmul_tokens`` positions as one matmul each, shorter ones gathered per
    token in runs of at most ``block_tokens`` (every mix of the two, down to all gathered in one
    run) give the dense einsums, and so do their gradients; ``rank`` > 1 interleaves r positions
    per token (Mamba-3's MIMO layout)."""
    G, M, N = 2, 3, 4
    monkeypatch.setattr(sample_states, "MATMUL_TOKENS", matmul_tokens)
    if block_tokens:
        monkeypatch.setattr(sample_states, "BLOCK_ELEMENTS", block_tokens * G * M * N)
    smp = sample_states.samples(SEQ).repeat(rank)
    idx = ops.sample_numbers(SEQ).reshape(-1).repeat_interleave(rank)
    assert smp.idx.tolist() == idx.tolist() and smp.cu[-1] == idx.numel()
    assert all(idx[f] == i and idx[la] == i for i, (f, la) in enumerate(zip(smp.first, smp.last)))
    assert (smp.first[1:] == smp.last[:-1] + 1).all()
    T = idx.numel()
    q, v, k, S = rnd(0, T, G, N), rnd(1, T, G, M), rnd(2, T, G, N), rnd(3, N_, G, M, N)
    got = sample_states.read_states(q, S, smp), sample_states.sum_outer(v, k, smp)
    want = (
        torch.einsum("tgn,tgmn->tgm", q, S[idx]),
        torch.zeros(N_, G, M, N).index_add(0, idx, torch.einsum("tgm,tgn->tgmn", v, k)),
    )
    same_with_grads(got, want, [q, S, v, k])


def test_decays_are_the_products_over_each_sample():
    log_a = -torch.rand(B_ * L_, 3, generator=torch.Generator().manual_seed(0))
    smp = sample_states.samples(SEQ)
    w, u, w_end = sample_states.decays(log_a, smp)
    for i, (r, s, e) in enumerate(SPANS):
        span = log_a[r * L_ + s : r * L_ + e]
        close(w[r * L_ + s : r * L_ + e], span.cumsum(0).exp(), 1e-6)
        tail = span.flip(0).cumsum(0).flip(0) - span  # a_{t+1} ... a_e
        close(u[r * L_ + s : r * L_ + e], tail.exp(), 1e-6)
        close(w_end[i], span.sum(0).exp(), 1e-6)


# ---------------------------------------------------------------------------------------------
# SSD
# ---------------------------------------------------------------------------------------------


def ssd_args(ngroups, D_per_channel=False, h=4, p=3, n=5, seq=SEQ):
    (B_, L_), N_ = seq.shape, len(spans(seq))
    x, dt = rnd(0, B_, L_, h, p), rnd(1, B_, L_, h)
    A = (-torch.rand(h, generator=torch.Generator().manual_seed(2)) - 0.2).requires_grad_()
    B, C = rnd(3, B_, L_, ngroups, n), rnd(4, B_, L_, ngroups, n)
    kw = dict(
        D=rnd(5, h, p) if D_per_channel else rnd(5, h),
        z=rnd(6, B_, L_, h, p),
        dt_bias=rnd(7, h),
        dt_softplus=True,
        dt_limit=(0.01, 5.0),
    )
    return (x, dt, A, B, C), kw, rnd(8, N_, h, p, n)


def ssd_alone(args, kw, h0, states=True, seq=SEQ):
    x, dt, A, B, C = args

    def one(r, s, e, i):
        cut = lambda t: t[r : r + 1, s:e]  # noqa: E731
        return ops.ssd_reference(
            cut(x),
            cut(dt),
            A,
            cut(B),
            cut(C),
            **{**kw, "z": cut(kw["z"])},
            initial_states=None if h0 is None else h0[i : i + 1],
            return_final_states=True,
        )

    return alone(one, states, seq)


SSD_IMPLS = {
    "reference": ops.ssd_reference,
    "quadratic": ops.ssd_quadratic,
    **{
        f"chunked-{q}": (lambda q: lambda *a, **k: ops.ssd_chunked(*a, q, **k))(q)
        for q in (1, 3, 16)
    },
    "ssd_scan-torch": lambda *a, **k: ops.ssd_scan(*a, 4, backend="torch", **k),
}


@pytest.mark.parametrize("impl", SSD_IMPLS)
@pytest.mark.parametrize("ngroups", [1, 2])
def test_ssd_sample_states_equal_each_sample_alone(impl, ngroups):
    args, kw, h0 = ssd_args(ngroups, D_per_channel=impl == "quadratic")
    got = SSD_IMPLS[impl](
        *args, **kw, seq_idx=SEQ, initial_sample_states=h0, return_sample_states=True
    )
    inputs = [*args, kw["D"], kw["z"], kw["dt_bias"], h0]
    want = lambda: ssd_alone(args, kw, h0)  # noqa: E731
    same_with_grads(got, want, inputs, ("ssd", ngroups, impl == "quadratic"))


@pytest.mark.parametrize("impl", ["reference", "chunked-3"])
def test_ssd_sample_states_one_at_a_time(impl):
    """Initial states without final ones (y alone); final states from zero initial states; and the
    rows' final states (each row's last sample's) with per-sample initial states."""
    args, kw, h0 = ssd_args(2)
    inputs = [*args, kw["D"], kw["z"], kw["dt_bias"], h0]
    fn = SSD_IMPLS[impl]
    got = fn(*args, **kw, seq_idx=SEQ, initial_sample_states=h0)
    same_with_grads(got, lambda: ssd_alone(args, kw, h0, states=False), inputs, ("ssd-y", 2))
    got = fn(*args, **kw, seq_idx=SEQ, return_sample_states=True)
    same_with_grads(got, lambda: ssd_alone(args, kw, None), inputs[:-1], ("ssd-from-0", 2))
    y, rows = fn(*args, **kw, seq_idx=SEQ, initial_sample_states=h0, return_final_states=True)
    last = [max(i for i, (r, _, _) in enumerate(SPANS) if r == row) for row in range(B_)]

    def want():
        y_want, every = ssd_alone(args, kw, h0)
        return y_want, every[last]

    same_with_grads((y, rows), want, inputs, ("ssd-rows", 2))


@pytest.mark.parametrize("grad", [True, False])
def test_ssd_cuda_wiring(varlen_kernels, grad):
    """The kernel runs the samples from zero states and the initial states are added by linearity;
    without autograd the final states come from its varlen form, under autograd (which that form
    cannot backpropagate) from torch."""
    args, kw, h0 = ssd_args(2)
    inputs = [*args, kw["D"], kw["z"], kw["dt_bias"], h0]
    want = lambda: ssd_alone(args, kw, h0)  # noqa: E731
    with torch.set_grad_enabled(grad):
        got = ops.ssd_scan(
            *args, 4, **kw, seq_idx=SEQ.long(), initial_sample_states=h0, return_sample_states=True
        )
    name, call = varlen_kernels[-1]
    assert name == "mamba_chunk_scan_combined" and call["z"] is None  # gated after the h0 term
    assert call.get("return_varlen_states", False) is not grad
    if grad:
        same_with_grads(got, want, inputs, ("ssd", 2, False))
    else:
        for a, b in zip(flat(got), flat(want())):
            close(a, b)
        assert tuple(call["x"].shape[:2]) == (1, B_ * L_)
    with torch.no_grad():  # no initial states: the gate z goes to the kernel
        y, states = ops.ssd_scan(*args, 4, **kw, seq_idx=SEQ, return_sample_states=True)
    assert varlen_kernels[-1][1]["z"] is not None
    y_want, every = ssd_alone(args, kw, None)
    close(y, y_want)
    close(states, every)


def test_ssd_compiled_path_wiring(monkeypatch):
    """With the compiled scan on, the zero-state packed scan goes through compiled.run (here a spy
    running it eagerly: test_compiled_scan.py checks what inductor makes of ssd_chunked) and the
    samples' terms run around it."""
    calls = []
    monkeypatch.setattr(compiled, "_ENABLED", True)
    monkeypatch.setattr(compiled, "run", lambda fn, *a, **k: calls.append(k) or fn(*a, **k))
    args, kw, h0 = ssd_args(1)
    got = ops.ssd_scan(
        *args, 4, **kw, seq_idx=SEQ, initial_sample_states=h0, return_sample_states=True
    )
    assert len(calls) == 1 and "initial_sample_states" not in calls[0]
    same_with_grads(got, lambda: ssd_alone(args, kw, h0), [*args, h0], ("ssd-some", 1))


def test_ssd_names_bad_sample_states():
    args, kw, h0 = ssd_args(1)
    cases = [
        (dict(seq_idx=SEQ, initial_sample_states=h0[:-1]), rf"\({N_}, 4, 3, 5\).*got \({N_ - 1}, "),
        (dict(initial_sample_states=h0), "needs seq_idx"),
        (dict(return_sample_states=True), "needs seq_idx"),
        (
            dict(seq_idx=SEQ, initial_sample_states=h0, initial_states=h0[:B_]),
            "initial_states and initial_sample_states cannot both be given",
        ),
        (
            dict(seq_idx=SEQ, return_sample_states=True, return_final_states=True),
            "return_final_states and return_sample_states are exclusive",
        ),
    ]
    for backend_name in ("reference", "torch"):
        for extra, match in cases:
            with pytest.raises(ValueError, match=match):
                ops.ssd_scan(*args, 4, **kw, **extra, backend=backend_name)


# ---------------------------------------------------------------------------------------------
# Mamba-3
# ---------------------------------------------------------------------------------------------

TIMED = ("x", "dt", "A", "trap", "B", "C", "angles", "z")


def mamba3_args(rank, h=4, p=3, g=2, n=8, S=2, seq=SEQ):
    (B_, L_), N_ = seq.shape, len(spans(seq))
    kw = dict(
        x=rnd(0, B_, L_, h, p),
        dt=(rnd(1, B_, L_, h, grad=False).abs() + 0.1).requires_grad_(),
        A=(-rnd(2, B_, L_, h, grad=False).abs() - 0.1).requires_grad_(),
        trap=rnd(3, B_, L_, h),
        B=rnd(4, B_, L_, rank, g, n),
        C=rnd(5, B_, L_, rank, g, n),
        angles=rnd(6, B_, L_, h, S),
        B_bias=rnd(7, h, rank, n),
        C_bias=rnd(8, h, rank, n),
        D=rnd(9, h),
        z=rnd(10, B_, L_, h, p),
    )
    if rank > 1:
        kw.update(
            mimo_x=rnd(11, h, rank, p), mimo_z=rnd(12, h, rank, p), mimo_o=rnd(13, h, rank, p)
        )
    h0 = ops.Mamba3States(
        (rnd(20, N_, h, S, grad=False).abs() * 2).requires_grad_(),
        rnd(21, N_, h, p, n),
        rnd(22, N_, rank, h, n),
        rnd(23, N_, h, p),
    )
    return kw, h0


def mamba3_alone(kw, h0, states=True, seq=SEQ):
    def one(r, s, e, i):
        return ops.mamba3_reference(
            **{k: v[r : r + 1, s:e] if k in TIMED else v for k, v in kw.items()},
            initial_states=None if h0 is None else tuple(t[i : i + 1] for t in h0),
            return_final_states=True,
        )

    return alone(one, states, seq)


MAMBA3_IMPLS = {
    "reference": ops.mamba3_reference,
    "quadratic": ops.mamba3_quadratic,
    **{
        f"chunked-{q}": (lambda q: lambda **k: ops.mamba3_chunked(chunk_size=q, **k))(q)
        for q in (1, 3)
    },
    "mamba3_scan-torch": lambda **k: ops.mamba3_scan(**k, chunk_size=4, backend="torch"),
}


@pytest.mark.parametrize("impl", MAMBA3_IMPLS)
@pytest.mark.parametrize("rank", [1, 2])
def test_mamba3_sample_states_equal_each_sample_alone(impl, rank):
    """Each sample's angle, memory, last k and last input enter its first step as in a batch-1 call
    with initial_states; its final (angle, ssm, k, v) come back."""
    kw, h0 = mamba3_args(rank)
    got = MAMBA3_IMPLS[impl](**kw, seq_idx=SEQ, initial_sample_states=h0, return_sample_states=True)
    want = lambda: mamba3_alone(kw, h0)  # noqa: E731
    same_with_grads(got, want, [*kw.values(), *h0], ("mamba3", rank))


@pytest.mark.parametrize("impl", ["reference", "chunked-3"])
def test_mamba3_sample_states_one_at_a_time(impl):
    kw, h0 = mamba3_args(2)
    inputs = [*kw.values(), *h0]
    fn = MAMBA3_IMPLS[impl]
    got = fn(**kw, seq_idx=SEQ, initial_sample_states=h0)
    same_with_grads(got, lambda: mamba3_alone(kw, h0, False), inputs, ("mamba3-y", 2))
    got = fn(**kw, seq_idx=SEQ, return_sample_states=True)
    same_with_grads(got, lambda: mamba3_alone(kw, None), inputs[:-4], ("mamba3-from-0", 2))
    y, rows = fn(**kw, seq_idx=SEQ, initial_sample_states=h0, return_final_states=True)
    last = [max(i for i, (r, _, _) in enumerate(SPANS) if r == row) for row in range(B_)]

    def want():
        y_want, every = mamba3_alone(kw, h0)
        return y_want, ops.Mamba3States(*(s[last] for s in every))

    same_with_grads((y, rows), want, inputs, ("mamba3-rows", 2))


@pytest.mark.parametrize("rank", [1, 2])
def test_mamba3_sample_states_continue_as_mamba3_step(rank):
    """A packed call from per-sample states, then one more token per sample stepped with
    mamba3_step from the returned states, equals the packed call over one more token."""
    kw, h0 = mamba3_args(rank)
    kw = {k: v.detach() for k, v in kw.items()}
    h0 = ops.Mamba3States(*(s.detach() for s in h0))
    # the sample of row 3 (the whole row): its first 11 tokens packed, the 12th stepped
    i = N_ - 1
    part = {k: v[3:4, :11] if k in TIMED else v for k, v in kw.items()}
    one = tuple(s[i : i + 1] for s in h0)
    _, states = ops.mamba3_chunked(
        **part,
        chunk_size=4,
        seq_idx=SEQ[3:4, :11],
        initial_sample_states=one,
        return_sample_states=True,
    )
    states = [s.clone() for s in states]
    nxt = {k: v[3:4, 11] if k in TIMED else v for k, v in kw.items()}
    y_step = ops.mamba3_step(states, **nxt, backend="torch")
    y_all, every = ops.mamba3_chunked(
        **{k: v[3:4] if k in TIMED else v for k, v in kw.items()},
        chunk_size=4,
        seq_idx=SEQ[3:4],
        initial_sample_states=one,
        return_sample_states=True,
    )
    close(y_step, y_all[:, 11])
    for mine, want in zip(states, every):
        close(mine, want)


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("grad", [True, False])
def test_mamba3_cuda_wiring(varlen_kernels, rank, grad):
    """SISO: the varlen kernel takes and returns the per-sample states itself. MIMO: its varlen
    kernel runs the samples from zero states (no initial states, no gate before the h0 term) and
    gives the final memory only without autograd."""
    kw, h0 = mamba3_args(rank)
    want = lambda: mamba3_alone(kw, h0)  # noqa: E731
    with torch.set_grad_enabled(grad):
        got = ops.mamba3_scan(
            **kw, chunk_size=8, seq_idx=SEQ, initial_sample_states=h0, return_sample_states=True
        )
    name, call = varlen_kernels[-1]
    assert call["cu_seqlens"].tolist() == ops.cu_seqlens(SEQ).tolist()
    if rank == 1:
        assert name == "mamba3_siso_combined" and call["Input_States"][0].shape[0] == N_
        assert call["return_final_states"] is True
    else:
        assert name == "mamba3_mimo" and call["MIMO_Out"] is None and call["Z"] is None
        assert call["return_state"] is not grad
    if grad:
        same_with_grads(got, want, [*kw.values(), *h0], ("mamba3", rank))
    else:
        for a, b in zip(flat(got), flat(want())):
            close(a, b)


def test_mamba3_names_bad_sample_states():
    kw, h0 = mamba3_args(1)
    short = ops.Mamba3States(h0.angle, h0.ssm[:-1], h0.k, h0.v)
    cases = [
        (dict(seq_idx=SEQ, initial_sample_states=short), rf"initial_sample_states.ssm.*\({N_}, "),
        (dict(seq_idx=SEQ, initial_sample_states=h0[:3]), r"\(angle, ssm, k, v\).*got tuple of 3"),
        (dict(initial_sample_states=h0), "needs seq_idx"),
        (dict(return_sample_states=True), "needs seq_idx"),
        (
            dict(seq_idx=SEQ, initial_sample_states=h0, initial_states=[s[:B_] for s in h0]),
            "initial_states and initial_sample_states cannot both be given",
        ),
        (
            dict(seq_idx=SEQ, return_sample_states=True, return_final_states=True),
            "return_final_states and return_sample_states are exclusive",
        ),
    ]
    for backend_name in ("reference", "torch"):
        for extra, match in cases:
            with pytest.raises(ValueError, match=match):
                ops.mamba3_scan(**kw, **extra, backend=backend_name)


# ---------------------------------------------------------------------------------------------
# both scans: random rows, small pieces
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0])
def test_random_rows_chunked(seed):
    """Random sample lengths through both chunked scans (chunks of 4, MIMO for Mamba-3)."""
    seq = random_rows(seed)
    args, kw, h0 = ssd_args(2, seq=seq)
    got = ops.ssd_chunked(
        *args, 4, **kw, seq_idx=seq, initial_sample_states=h0, return_sample_states=True
    )
    same_with_grads(
        got, ssd_alone(args, kw, h0, seq=seq), [*args, kw["D"], kw["z"], kw["dt_bias"], h0]
    )
    kw, h0 = mamba3_args(2, seq=seq)
    got = ops.mamba3_chunked(
        **kw, chunk_size=4, seq_idx=seq, initial_sample_states=h0, return_sample_states=True
    )
    same_with_grads(got, mamba3_alone(kw, h0, seq=seq), [*kw.values(), *h0])


def test_ssd_and_mamba3_sample_states_by_small_pieces(monkeypatch):
    """The two passes with samples of 3 positions or more as matmuls, shorter ones gathered in runs
    of at most 2 tokens (1 for Mamba-3's larger states)."""
    monkeypatch.setattr(sample_states, "BLOCK_ELEMENTS", 2 * 2 * 6 * 5)  # G·M·N of ssd_args(2)
    monkeypatch.setattr(sample_states, "MATMUL_TOKENS", 3)
    args, kw, h0 = ssd_args(2)
    got = ops.ssd_chunked(
        *args, 4, **kw, seq_idx=SEQ, initial_sample_states=h0, return_sample_states=True
    )
    inputs = [*args, kw["D"], kw["z"], kw["dt_bias"], h0]
    same_with_grads(got, lambda: ssd_alone(args, kw, h0), inputs, ("ssd", 2, False))
    kw, h0 = mamba3_args(2)
    got = ops.mamba3_chunked(
        **kw, chunk_size=4, seq_idx=SEQ, initial_sample_states=h0, return_sample_states=True
    )
    same_with_grads(got, lambda: mamba3_alone(kw, h0), [*kw.values(), *h0], ("mamba3", 2))
