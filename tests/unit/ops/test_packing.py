"""Packed samples (``seq_idx``): a packed row gives every sample the outputs, final states and
gradients it gets when it runs alone.

The oracle is always the samples run one by one WITHOUT seq_idx: the reference recurrence of each op
on each sample's slice (with the initial state for a row's sample 0 only, mamba_ssm's convention),
or the model on each sample alone. Everything is fp32 and compared by :func:`close`: max |diff| <=
1e-5 x max(1, max |oracle|), for the ops' outputs, final states and gradients as for the models'
logits, losses, input gradients and parameter gradients.

The rows below cover samples of length 1, 2, 3, 5, 7, a row that starts with sample 2 (no initial
state reaches it), and boundaries both inside and exactly at the edges of chunks of 2, 3, 4 and 5
steps.
"""

from __future__ import annotations

import sys

import fake_kernels as dispatch
import pytest
import torch
import torch.nn.functional as F
from helpers import perturb_

from ssmkit import ops
from ssmkit.models import MambaLM, ModelConfig
from ssmkit.models.zamba2_config import TINY_ZAMBA2
from ssmkit.ops import backend, packing

SEQ = torch.tensor(
    [
        [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3],  # 3, 2, 5, 2: boundaries at 3, 5, 10
        [0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2],  # 1, 7, 4: boundaries at 1, 8
        [2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4],
    ],  # 2, 9, 1 and no sample 0
    dtype=torch.int32,
)
B_, L_ = SEQ.shape


def pieces(row: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) of each sample of one row of seq_idx, found independently of
    ssmkit.ops.packing."""
    values, out, start = row.tolist(), [], 0
    for t in range(1, len(values) + 1):
        if t == len(values) or values[t] != values[t - 1]:
            out.append((start, t))
            start = t
    return out


def alone(seq, run, time_dim):
    """Run ``run(row, start, end, gets_initial_state) -> (y, final or None)`` on every sample; the
    samples' y concatenated along ``time_dim`` per row, rows along dim 0, and each row's last final
    state."""
    ys, finals = [], []
    for r in range(seq.shape[0]):
        outs = [
            run(r, s, e, i == 0 and int(seq[r, 0]) == 0) for i, (s, e) in enumerate(pieces(seq[r]))
        ]
        ys.append(torch.cat([y for y, _ in outs], dim=time_dim))
        finals.append(outs[-1][1])
    if finals[0] is None or isinstance(finals[0], torch.Tensor):
        final = None if finals[0] is None else torch.cat(finals)
    else:  # a tuple of states (Mamba-3)
        final = type(finals[0])(*map(torch.cat, zip(*finals)))
    return torch.cat(ys), final


def close(a, b, tol=1e-5, what=""):
    """max |a - b| <= tol x max(1, max |b|): fp32 agreement at the scale of the tensor (an exact
    zero in b, such as the gradient of an angle rate at a sample's first step, which only relative
    angles reach, is matched to tol times that scale, not to tol times 0)."""
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err, scale = (a.double() - b.double()).abs().max().item(), max(1.0, b.abs().max().item())
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol:g} x {scale:.3g}"


def assert_same_with_grads(packed, reference, inputs, seed=0, tol=1e-5):
    """packed and reference: (y, final state or None). Their values agree, and so do the gradients
    of one random linear function of (y, final) with respect to every input."""

    def flat(out):
        return [
            t
            for t in (out[0], *(out[1] if isinstance(out[1], tuple) else (out[1],)))
            if t is not None
        ]

    got, want = flat(packed), flat(reference)
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(t.shape, generator=g) for t in want]
    for i, (a, b) in enumerate(zip(got, want)):
        close(a, b, tol, f"output {i}")
    grads_got = torch.autograd.grad(
        sum((w * t).sum() for w, t in zip(weights, got)), inputs, allow_unused=True
    )
    grads_want = torch.autograd.grad(
        sum((w * t).sum() for w, t in zip(weights, want)), inputs, allow_unused=True
    )
    for i, (a, b) in enumerate(zip(grads_got, grads_want)):
        close(torch.zeros_like(b) if a is None else a, b, tol, f"gradient of input {i}")


def rnd(seed, *shape, grad=True):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_(grad)


# ---------------------------------------------------------------------------------------------
# the helpers of ssmkit.ops.packing
# ---------------------------------------------------------------------------------------------


def test_resets_segments_positions_and_cu_seqlens():
    assert packing.resets(SEQ)[:, [0, 1, 2, 3]].tolist() == [
        [False, False, False, True],
        [False, True, False, False],
        [True, False, True, False],
    ]
    assert packing.segments(SEQ)[2].tolist() == [1, 1] + [2] * 9 + [3]
    assert packing.positions_in_sample(SEQ)[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1]
    starts = [r * L_ + s for r in range(B_) for s, _ in pieces(SEQ[r])]
    cu = ops.cu_seqlens(SEQ)
    assert cu.dtype == torch.int32 and cu.tolist() == starts + [B_ * L_]


def test_sample_numbers_and_spans_follow_cu_seqlens():
    spans = [(r, s, e) for r in range(B_) for s, e in pieces(SEQ[r])]
    row, start, end = ops.sample_spans(SEQ)
    assert list(zip(row.tolist(), start.tolist(), end.tolist())) == spans
    numbers = ops.sample_numbers(SEQ)
    for i, (r, s, e) in enumerate(spans):
        assert numbers[r, s:e].eq(i).all()
    assert int(numbers.max()) + 1 == len(spans) == len(ops.cu_seqlens(SEQ)) - 1
    with pytest.raises(ValueError, match=r"one state per packed sample, \(5, 3\).*got \(4, 3\)"):
        packing.check_sample_states(torch.zeros(4, 3), 5, (3,))


def test_seq_idx_from_position_ids_matches_transformers_collator():
    from transformers import DataCollatorWithFlattening

    features = [{"input_ids": list(range(n))} for n in (3, 1, 5, 2)]
    batch = DataCollatorWithFlattening(return_seq_idx=True, return_tensors="pt")(features)
    got = ops.seq_idx_from_position_ids(batch["position_ids"])
    assert got.dtype == torch.int32 and got.tolist() == batch["seq_idx"].tolist()
    assert ops.seq_idx_from_position_ids(torch.tensor([5, 6, 0, 1, 0])).tolist() == [
        [0, 0, 1, 1, 2]
    ]
    assert ops.seq_idx_from_position_ids(torch.tensor([[2, 3, 2]]), start=2).tolist() == [[0, 0, 1]]
    with pytest.raises(ValueError, match="position_ids must be an integer tensor"):
        ops.seq_idx_from_position_ids(torch.zeros(2, 3))


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(3, 12), "integer sample indices"),
        (torch.zeros(3, 11, dtype=torch.int32), r"\(batch=3, seqlen=12\)"),
        ([0, 1], "integer tensor"),
    ],
)
def test_ops_name_a_bad_seq_idx(bad, match):
    x = torch.randn(3, 4, 12)
    with pytest.raises(ValueError, match=match):
        ops.causal_conv1d(x, torch.randn(4, 4), seq_idx=bad)
    with pytest.raises(ValueError, match=match):
        ops.ssd_scan(
            torch.randn(3, 12, 2, 2),
            torch.rand(3, 12, 2),
            -torch.rand(2),
            torch.randn(3, 12, 1, 4),
            torch.randn(3, 12, 1, 4),
            4,
            seq_idx=bad,
        )
    with pytest.raises(ValueError, match=match):
        ops.selective_scan(
            x, x, -torch.rand(4, 3), torch.randn(3, 3, 12), torch.randn(3, 3, 12), seq_idx=bad
        )


# ---------------------------------------------------------------------------------------------
# ops: packed == each sample alone, reference and torch backends
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", ["reference", "torch"])
@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_packed_equals_samples_alone(backend_name, layout, activation):
    x0 = rnd(0, B_, 6, L_) if layout == "contiguous" else rnd(0, B_, L_, 6)
    x = x0 if layout == "contiguous" else x0.transpose(1, 2)
    w, bias = rnd(1, 6, 4), rnd(2, 6)
    packed = ops.causal_conv1d(x, w, bias, activation, backend=backend_name, seq_idx=SEQ), None
    want = alone(
        SEQ,
        lambda r, s, e, _: (
            ops.causal_conv1d_reference(x[r : r + 1, :, s:e], w, bias, activation),
            None,
        ),
        time_dim=2,
    )
    assert_same_with_grads(packed, want, [x0, w, bias])


SSD_IMPLS = {
    "reference": ops.ssd_reference,
    "quadratic": ops.ssd_quadratic,
    **{
        f"chunked-{q}": (lambda q: lambda *a, **k: ops.ssd_chunked(*a[:5], q, **k))(q)
        for q in (1, 2, 3, 4, 5, 16)
    },
    "ssd_scan-torch": lambda *a, **k: ops.ssd_scan(*a[:5], 4, backend="torch", **k),
}


@pytest.mark.parametrize("impl", SSD_IMPLS)
@pytest.mark.parametrize("ngroups", [1, 2])
def test_ssd_packed_equals_samples_alone(impl, ngroups):
    h, p, n = 4, 3, 5
    x, dt, A = rnd(0, B_, L_, h, p), rnd(1, B_, L_, h), (-torch.rand(h) - 0.2).requires_grad_()
    B, C = rnd(3, B_, L_, ngroups, n), rnd(4, B_, L_, ngroups, n)
    D, z, dt_bias, h0 = rnd(5, h), rnd(6, B_, L_, h, p), rnd(7, h), rnd(8, B_, h, p, n)
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.01, 5.0))
    packed = SSD_IMPLS[impl](
        x, dt, A, B, C, None, z=z, initial_states=h0, return_final_states=True, seq_idx=SEQ, **kw
    )

    def one(r, s, e, first):
        cut = lambda t: t[r : r + 1, s:e]  # noqa: E731
        return ops.ssd_reference(
            cut(x),
            cut(dt),
            A,
            cut(B),
            cut(C),
            z=cut(z),
            return_final_states=True,
            initial_states=h0[r : r + 1] if first else None,
            **kw,
        )

    assert_same_with_grads(packed, alone(SEQ, one, time_dim=1), [x, dt, A, B, C, D, z, dt_bias, h0])


@pytest.mark.parametrize(
    "backend_name, chunk_elements",
    [("reference", None), ("torch", None), ("torch", 3 * 6 * 4 * 3), ("torch", 3 * 6 * 4 * 5)],
)
@pytest.mark.parametrize("grouped", [False, True])
def test_selective_scan_packed_equals_samples_alone(
    monkeypatch, backend_name, chunk_elements, grouped
):
    """chunk_elements: the torch path's chunks of 3 or 5 steps, so its backward recomputes chunks
    and boundaries fall inside and at the edges of them."""
    if chunk_elements:
        monkeypatch.setattr(sys.modules["ssmkit.ops.s6"], "_CHUNK_ELEMENTS", chunk_elements)
    d, n = 6, 4
    u, delta, A = rnd(0, B_, d, L_), rnd(1, B_, d, L_), (-torch.rand(d, n) - 0.2).requires_grad_()
    shape = (B_, 2, n, L_) if grouped else (B_, n, L_)
    B, C, z = rnd(3, *shape), rnd(4, *shape), rnd(5, B_, d, L_)
    D, bias, h0 = rnd(6, d), rnd(7, d), rnd(8, B_, d, n)
    kw = dict(D=D, delta_bias=bias, delta_softplus=True)
    packed = ops.selective_scan(
        u,
        delta,
        A,
        B,
        C,
        z=z,
        initial_state=h0,
        return_final_state=True,
        backend=backend_name,
        seq_idx=SEQ,
        **kw,
    )

    def one(r, s, e, first):
        cut = lambda t: t[r : r + 1, ..., s:e]  # noqa: E731
        return ops.selective_scan_reference(
            cut(u),
            cut(delta),
            A,
            cut(B),
            cut(C),
            z=cut(z),
            initial_state=h0[r : r + 1] if first else None,
            return_final_state=True,
            **kw,
        )

    assert_same_with_grads(packed, alone(SEQ, one, time_dim=2), [u, delta, A, B, C, z, D, bias, h0])


def mamba3_args(rank, b=B_, L=L_, h=4, p=3, g=2, n=8, S=2):
    mimo = rank > 1
    kw = dict(
        x=rnd(0, b, L, h, p),
        dt=(rnd(1, b, L, h, grad=False).abs() + 0.1).requires_grad_(),
        A=(-rnd(2, b, L, h, grad=False).abs() - 0.1).requires_grad_(),
        trap=rnd(3, b, L, h),
        B=rnd(4, b, L, rank, g, n),
        C=rnd(5, b, L, rank, g, n),
        angles=rnd(6, b, L, h, S),
        B_bias=rnd(7, h, rank, n),
        C_bias=rnd(8, h, rank, n),
        D=rnd(9, h),
        z=rnd(10, b, L, h, p),
    )
    if mimo:
        kw.update(
            mimo_x=rnd(11, h, rank, p), mimo_z=rnd(12, h, rank, p), mimo_o=rnd(13, h, rank, p)
        )
    states = (
        rnd(20, b, h, S, grad=False).abs().requires_grad_(),
        rnd(21, b, h, p, n),
        rnd(22, b, rank, h, n),
        rnd(23, b, h, p),
    )
    return kw, states


TIMED = ("x", "dt", "A", "trap", "B", "C", "angles", "z")
MAMBA3_IMPLS = {
    "reference": ops.mamba3_reference,
    "quadratic": ops.mamba3_quadratic,
    **{
        f"chunked-{q}": (lambda q: lambda **k: ops.mamba3_chunked(chunk_size=q, **k))(q)
        for q in (1, 2, 3, 5, 16)
    },
}


@pytest.mark.parametrize("impl", MAMBA3_IMPLS)
@pytest.mark.parametrize("rank", [1, 2])
def test_mamba3_packed_equals_samples_alone(impl, rank):
    """The whole state restarts at a sample: memory, the trapezoid's previous input and the
    angle."""
    kw, h0 = mamba3_args(rank)
    packed = MAMBA3_IMPLS[impl](**kw, initial_states=h0, return_final_states=True, seq_idx=SEQ)

    def one(r, s, e, first):
        cut = {k: v[r : r + 1, s:e] if k in TIMED else v for k, v in kw.items()}
        return ops.mamba3_reference(
            **cut,
            return_final_states=True,
            initial_states=tuple(t[r : r + 1] for t in h0) if first else None,
        )

    inputs = [*kw.values(), *h0]
    assert_same_with_grads(packed, alone(SEQ, one, time_dim=1), inputs)


def test_an_all_zero_seq_idx_changes_nothing():
    """One sample per row: every torch path gives what it gives without seq_idx."""
    zeros = torch.zeros(B_, L_, dtype=torch.int64)
    x, w = torch.randn(B_, L_, 6).transpose(1, 2), torch.randn(6, 4)
    assert torch.equal(ops.causal_conv1d(x, w, seq_idx=zeros), ops.causal_conv1d(x, w))
    args = (
        torch.randn(B_, L_, 4, 3),
        torch.rand(B_, L_, 4),
        -torch.rand(4),
        torch.randn(B_, L_, 1, 5),
        torch.randn(B_, L_, 1, 5),
        4,
    )
    close(ops.ssd_scan(*args, seq_idx=zeros), ops.ssd_scan(*args))
    s6 = (
        torch.randn(B_, 6, L_),
        torch.rand(B_, 6, L_),
        -torch.rand(6, 4),
        torch.randn(B_, 4, L_),
        torch.randn(B_, 4, L_),
    )
    assert torch.equal(ops.selective_scan(*s6, seq_idx=zeros), ops.selective_scan(*s6))
    kw, _ = mamba3_args(1)
    close(ops.mamba3_scan(**kw, seq_idx=zeros), ops.mamba3_scan(**kw))


# ---------------------------------------------------------------------------------------------
# the cuda wiring, with fake kernel modules bound to the real signatures (see test_cuda_dispatch.py)
# ---------------------------------------------------------------------------------------------


def _by_sample(seq_idx, x, time_dim, run):
    """Kernel semantics written out: ``run(row, start, end)`` for each sample, concatenated."""
    rows = [
        torch.cat([run(r, s, e) for s, e in pieces(seq_idx[r])], dim=time_dim)
        for r in range(x.shape[0])
    ]
    return torch.cat(rows)


def fake_conv(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    if seq_idx is None:
        return ops.causal_conv1d_reference(x, weight, bias, activation)
    # causal-conv1d's csrc/causal_conv1d.cpp and its interface: seq_idx int32, contiguous, (batch,
    # seqlen), only for channels-last x (stride(1) == 1 and stride(2) > 1), never with initial or
    # final states
    assert x.stride(1) == 1 and x.stride(2) > 1, "seq_idx needs channels-last x"
    assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
    assert tuple(seq_idx.shape) == (x.shape[0], x.shape[2])
    assert initial_states is None and not return_final_states
    return _by_sample(
        seq_idx,
        x,
        2,
        lambda r, s, e: ops.causal_conv1d_reference(x[r : r + 1, :, s:e], weight, bias, activation),
    )


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
    kw = dict(
        D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True
    )
    if seq_idx is None:
        out = ops.ssd_reference(x, dt, A, B, C, z=z, initial_states=initial_states, **kw)
        return out if return_final_states else out[0]
    assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == x.shape[:2]
    finals = []

    def one(
        r, s, e
    ):  # the initial state is the state of sample 0 (state passing starts at seq_idx 0)
        cut = lambda t: None if t is None else t[r : r + 1, s:e]  # noqa: E731
        init = (
            initial_states[r : r + 1]
            if initial_states is not None and s == 0 and int(seq_idx[r, 0]) == 0
            else None
        )
        y, h = ops.ssd_reference(
            cut(x), cut(dt), A, cut(B), cut(C), z=cut(z), initial_states=init, **kw
        )
        if e == x.shape[1]:
            finals.append(h)
        return y

    y = _by_sample(seq_idx, x, 1, one)
    return (y, torch.cat(finals)) if return_final_states else y


def _varlen(run, cu_seqlens, total):
    """mamba_ssm's varlen form: batch 1, int32 cu_seqlens from 0 to the length; each sequence from
    zero."""
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1
    assert int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == total
    cuts = cu_seqlens.tolist()
    return torch.cat([run(s, e) for s, e in zip(cuts[:-1], cuts[1:])], dim=1)


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
    real = dispatch.mamba3_siso_combined
    if cu_seqlens is None:
        return real(
            Q,
            K,
            V,
            ADT,
            DT,
            Trap,
            Q_bias,
            K_bias,
            Angles,
            D,
            Z,
            Input_States,
            chunk_size,
            return_final_states,
        )
    assert Q.shape[0] == 1 and Input_States is None and not return_final_states
    return _varlen(
        lambda s, e: real(
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
            chunk_size=chunk_size,
        ),
        cu_seqlens,
        Q.shape[1],
    )


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
    real = dispatch.mamba3_mimo
    if cu_seqlens is None:
        return real(
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
            return_state,
        )
    assert Q.shape[0] == 1 and not return_state
    return _varlen(
        lambda s, e: real(
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
        ),
        cu_seqlens,
        Q.shape[1],
    )


PACKED_FAKES = {
    "causal_conv1d": ("causal_conv1d_fn", fake_conv),
    "mamba_ssm.ops.triton.ssd_combined": ("mamba_chunk_scan_combined", fake_ssd),
    "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined": ("mamba3_siso_combined", fake_siso),
    "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo": ("mamba3_mimo", fake_mimo),
}


@pytest.fixture
def packed_kernels(request, monkeypatch):
    """test_cuda_dispatch's fake kernels, those that take packed samples replaced by fakes that
    honour seq_idx / cu_seqlens (each call still bound to the real signature and recorded); every op
    routed to its cuda path although the tensors are on CPU."""
    import inspect

    calls = request.getfixturevalue("fake_kernels")

    for module, (name, fn) in PACKED_FAKES.items():
        real_signature = inspect.signature(getattr(dispatch, name))

        def spy(*args, _fn=fn, _name=name, _sig=real_signature, **kwargs):
            calls.append((_name, _sig.bind(*args, **kwargs).arguments))
            return _fn(*args, **kwargs)

        monkeypatch.setattr(sys.modules[module], name, spy)
    monkeypatch.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
    return calls


def test_conv_and_ssd_cuda_wiring(packed_kernels):
    """seq_idx reaches both kernels as int32, contiguous, with x channels-last for the conv,
    whatever the caller passes (int64 here, x contiguous)."""
    seq = SEQ.long()
    x, w, bias = rnd(0, B_, 6, L_), rnd(1, 6, 4), rnd(2, 6)
    packed = ops.causal_conv1d(x, w, bias, "silu", seq_idx=seq), None
    want = alone(
        SEQ,
        lambda r, s, e, _: (
            ops.causal_conv1d_reference(x[r : r + 1, :, s:e], w, bias, "silu"),
            None,
        ),
        time_dim=2,
    )
    assert_same_with_grads(packed, want, [x, w, bias])
    name, args = packed_kernels[-1]
    assert name == "causal_conv1d_fn" and args["seq_idx"].dtype == torch.int32

    h, p, n = 4, 3, 5
    x, dt, A = rnd(0, B_, L_, h, p), rnd(1, B_, L_, h), (-torch.rand(h) - 0.2).requires_grad_()
    B, C, h0 = rnd(3, B_, L_, 2, n), rnd(4, B_, L_, 2, n), rnd(8, B_, h, p, n)
    kw = dict(D=rnd(5, h), dt_bias=rnd(7, h), dt_softplus=True)
    packed = ops.ssd_scan(
        x, dt, A, B, C, 4, initial_states=h0, return_final_states=True, seq_idx=seq, **kw
    )
    name, args = packed_kernels[-1]
    assert name == "mamba_chunk_scan_combined" and args["seq_idx"].dtype == torch.int32

    def one(r, s, e, first):
        cut = lambda t: t[r : r + 1, s:e]  # noqa: E731
        return ops.ssd_reference(
            cut(x),
            cut(dt),
            A,
            cut(B),
            cut(C),
            return_final_states=True,
            initial_states=h0[r : r + 1] if first else None,
            **kw,
        )

    assert_same_with_grads(packed, alone(SEQ, one, time_dim=1), [x, dt, A, B, C, h0])


def test_selective_scan_with_seq_idx_takes_the_torch_path_on_cuda(packed_kernels):
    u, delta, A = torch.randn(B_, 6, L_), torch.rand(B_, 6, L_), -torch.rand(6, 4)
    B, C = torch.randn(B_, 4, L_), torch.randn(B_, 4, L_)
    calls = len(packed_kernels)
    for forced in (None, "cuda"):
        y = ops.selective_scan(u, delta, A, B, C, seq_idx=SEQ, backend=forced)
        close(y, ops.selective_scan_reference(u, delta, A, B, C, seq_idx=SEQ))
    assert len(packed_kernels) == calls  # the kernel was never called with a reset to drop
    with pytest.raises(ops.BackendError, match="cannot take seq_idx"):
        sys.modules["ssmkit.ops.s6"].selective_scan_cuda(u, delta, A, B, C, seq_idx=SEQ)


@pytest.mark.parametrize("rank", [1, 2])
def test_mamba3_cuda_wiring_runs_the_varlen_kernels(packed_kernels, rank):
    kw, h0 = mamba3_args(rank, n=8, S=2)
    packed = ops.mamba3_scan(**kw, chunk_size=8, seq_idx=SEQ), None
    name, args = packed_kernels[-1]
    assert name == ("mamba3_mimo" if rank > 1 else "mamba3_siso_combined")
    assert args["cu_seqlens"].tolist() == ops.cu_seqlens(SEQ).tolist() and args["Q"].shape[:2] == (
        1,
        B_ * L_,
    )

    def one(r, s, e, first):
        return ops.mamba3_reference(
            **{k: v[r : r + 1, s:e] if k in TIMED else v for k, v in kw.items()}
        ), None

    assert_same_with_grads(packed, alone(SEQ, one, time_dim=1), list(kw.values()))
    # no states in the varlen form: the torch path when chosen automatically, an error when forced
    calls = len(packed_kernels)
    y, _ = ops.mamba3_scan(**kw, initial_states=h0, return_final_states=True, seq_idx=SEQ)
    assert len(packed_kernels) == calls
    close(y, ops.mamba3_reference(**kw, initial_states=h0, seq_idx=SEQ))
    with pytest.raises(ops.BackendError, match="varlen"):
        ops.mamba3_scan(**kw, return_final_states=True, seq_idx=SEQ, backend="cuda")


# ---------------------------------------------------------------------------------------------
# models: a packed batch == its samples run one by one
# ---------------------------------------------------------------------------------------------

VOCAB = 64
HYBRID_ATTN = dict(num_heads=4, num_heads_kv=2, rotary_emb_dim=8, d_conv=3, window_size=3)
MODELS = {
    "mamba1": dict(mixer="mamba1", d_state=8),
    "mamba2": dict(mixer="mamba2", d_state=8, headdim=8, chunk_size=4),
    "mamba3": dict(mixer="mamba3", d_state=8, headdim=8, chunk_size=4),
    "mamba3-mimo": dict(
        mixer="mamba3",
        d_state=8,
        headdim=8,
        chunk_size=2,
        is_mimo=True,
        mimo_rank=2,
        is_outproj_norm=True,
    ),
    # Jamba-style: Mamba-1 around full and sliding-window attention (rotary, conv and GQA on), MLPs
    "hybrid": dict(
        layout=["mamba1", "attn", "mamba1", "swa"],
        d_state=8,
        d_intermediate=48,
        attn_cfg=HYBRID_ATTN,
    ),
    "zamba2": dict(
        TINY_ZAMBA2,
        n_layer=4,
        d_state=8,
        headdim=8,
        chunk_size=4,
        zamba2=dict(
            TINY_ZAMBA2["zamba2"],
            hybrid_layer_ids=[0, 2, 3],
            num_key_value_heads=2,
            intermediate_size=48,
            adapter_rank=4,
        ),
    ),
}


def build(kind, seed=0):
    torch.manual_seed(seed)
    fields = dict(MODELS[kind])
    layers = fields.pop("n_layer", 4 if kind == "hybrid" else 2)
    cfg = ModelConfig(**{**fields, "d_model": 32, "n_layer": layers, "vocab_size": VOCAB})
    return perturb_(MambaLM(cfg), seed)


def run_and_grad(model, ids, seq_idx=None):
    """Logits, each position's next-token loss, d(their sum)/d(embedding output) (the model's input
    gradient) and the parameter gradients. No target crosses a sample boundary; a length-1 sample
    has none."""
    captured = {}

    def keep(module, inputs, out):
        out.retain_grad()
        captured["emb"] = out

    handle = model.backbone.embedding.register_forward_hook(keep)
    try:
        logits = model(ids, seq_idx=seq_idx).logits.float()
    finally:
        handle.remove()
    ce = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)
    same = (
        torch.ones_like(ce, dtype=torch.bool)
        if seq_idx is None
        else seq_idx[:, 1:] == seq_idx[:, :-1]
    )
    ce = ce * same
    model.zero_grad(set_to_none=True)
    ce.sum().backward()
    params = {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }
    return logits.detach(), ce.detach(), captured["emb"].grad, params


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_batch_equals_samples_one_by_one(kind, checkpointing):
    model = build(kind)
    model.train(checkpointing)  # dropout-free; train() turns the checkpointing path on
    model.backbone.gradient_checkpointing = checkpointing
    ids = torch.randint(0, VOCAB, SEQ.shape, generator=torch.Generator().manual_seed(1))
    logits, ce, emb_grad, params = run_and_grad(model, ids, SEQ)
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for r in range(B_):
        for s, e in pieces(SEQ[r]):
            one_logits, one_ce, one_emb, one_params = run_and_grad(model, ids[r : r + 1, s:e])
            what = f"{kind} row {r} sample [{s}:{e}]"
            close(logits[r : r + 1, s:e], one_logits, what=f"{what} logits")
            close(ce[r, s : e - 1].sum(), one_ce.sum(), what=f"{what} loss")
            close(emb_grad[r : r + 1, s:e], one_emb, what=f"{what} input gradient")
            for n in total:
                total[n] += one_params[n]
    for n, g in params.items():
        close(g, total[n], what=f"{kind} gradient of {n}")


@pytest.mark.parametrize("kind", ["mamba1", "mamba2", "mamba3", "hybrid"])
def test_packed_batch_through_the_cuda_wiring(packed_kernels, kind):
    """The same through every op's cuda path (fake kernels): conv and SSD get seq_idx, Mamba-3
    cu_seqlens, the S6 scan takes the torch path."""
    model = build(kind).eval()
    ids = torch.randint(0, VOCAB, SEQ.shape, generator=torch.Generator().manual_seed(2))
    logits, _, emb_grad, _ = run_and_grad(model, ids, SEQ)
    used = {name for name, _ in packed_kernels}  # by the packed run
    want = {
        "mamba1": {"causal_conv1d_fn"},
        "mamba2": {"causal_conv1d_fn", "mamba_chunk_scan_combined"},
        "mamba3": {"mamba3_siso_combined"},
        "hybrid": {"causal_conv1d_fn"},
    }[kind]
    assert want <= used and "selective_scan_fn" not in used  # the S6 kernel cannot reset
    for r in range(B_):
        for s, e in pieces(SEQ[r]):
            one_logits, _, one_emb, _ = run_and_grad(model, ids[r : r + 1, s:e])
            close(logits[r : r + 1, s:e], one_logits, what=f"{kind} [{r}, {s}:{e}] logits")
            close(emb_grad[r : r + 1, s:e], one_emb, what=f"{kind} [{r}, {s}:{e}] input gradient")


def test_the_loss_of_a_packed_batch_is_that_of_its_samples():
    """labels=input_ids with seq_idx: no target crosses a boundary (set to -100 there by the model),
    so the loss is the token-weighted mean of the samples' own losses."""
    model = build("mamba2").eval()
    ids = torch.randint(0, VOCAB, SEQ.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        loss = model(ids, labels=ids, seq_idx=SEQ).loss
        sums, count = 0.0, 0
        for r in range(B_):
            for s, e in pieces(SEQ[r]):
                if e - s > 1:
                    sums += model(ids[r : r + 1, s:e], labels=ids[r : r + 1, s:e]).loss * (
                        e - s - 1
                    )
                    count += e - s - 1
    close(loss, sums / count, what="packed loss")


def test_model_names_bad_seq_idx_and_conflicts():
    model = build("mamba1").eval()
    ids = torch.randint(0, VOCAB, (2, 6))
    cases = [
        (torch.zeros(2, 5, dtype=torch.long), {}, "shape of input_ids"),
        (torch.zeros(2, 6), {}, "integer sample indices"),
        (
            torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 1, 0, 2, 2]]),
            {},
            "row 1 decreases at position 3",
        ),
        (
            torch.tensor([[0, 0, 1, 1, 2, 2], [-2, 0, 0, 0, 0, 0]]),
            {},
            "row 1 holds -2 at position 0",
        ),
        (
            torch.zeros(2, 6, dtype=torch.long),
            {"attention_mask": torch.ones(2, 6)},
            "attention_mask",
        ),
        (  # a packed prefill: one cache row per sample (tests/unit/models/test_packed_generation)
            torch.zeros(2, 6, dtype=torch.long),
            {"cache": model.allocate_cache(3)},
            "the cache has 3 rows but seq_idx packs 2 samples",
        ),
    ]
    for seq_idx, extra, match in cases:
        with pytest.raises(ValueError, match=match):
            model(ids, seq_idx=seq_idx, **extra)
    with pytest.raises(ValueError, match="cannot be combined with a padding mask"):
        model.backbone.layers[0].mixer(
            torch.randn(2, 6, 32),
            None,
            torch.ones(2, 6),
            seq_idx=torch.zeros(2, 6, dtype=torch.long),
        )
