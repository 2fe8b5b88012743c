"""Per-sample states in one packed call: ``initial_sample_states`` and ``return_sample_states`` of
``ops.causal_conv1d`` and ``ops.selective_scan`` (the SSD and Mamba-3 have their own file).

The oracle is every sample run alone, as its own batch-1 call WITHOUT seq_idx, from its initial
state: for the conv, causal-conv1d's definition of ``initial_states`` (the state's W-1 inputs put
before the sample, their outputs dropped; the final state the last W-1 of that extended input), for
the S6 scan the reference recurrence with ``initial_state``. Outputs, final states and the gradients
of one random linear function of both with respect to every input, the initial states included,
agree in fp32 to max |diff| <= 1e-5 x max(1, max |oracle|) (:func:`close`).

The packed rows hold samples of length 1, 2 and 3 (the last two shorter than the conv's width - 1 =
3, so their final conv state keeps part of the initial one), a row that starts with seq_idx 4 and a
row that is one sample; with chunks of 3 steps (``torch-chunks-3``) samples start inside, at the
edge of and across the S6 scan's chunks. The ``cuda`` backend runs on CPU with the fake kernels of
tests/fake_kernels.py (each bound to the real signature; see test_cuda_dispatch.py). The compiled
S6 path is tested in test_compiled_scan.py, which shares its compiled graphs.
"""

from __future__ import annotations

import sys

import pytest
import torch

from ssmkit import ops
from ssmkit.ops import backend

S6 = sys.modules["ssmkit.ops.s6"]

SEQ = torch.tensor(
    [
        [0, 0, 0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 3],  # 5, 1, 2, 5
        [4, 4, 4, 5, 6, 6, 6, 6, 6, 6, 6, 7, 7],  # 3, 1, 7, 2: no sample 0
        [0] * 13,  # one sample
    ],
    dtype=torch.int32,
)


def samples(seq):
    """[(row, start, end)] of every sample, row-major: the numbering of per-sample states, found
    here without ssmkit.ops.packing."""
    out = []
    for r, row in enumerate(seq.tolist()):
        start = 0
        for t in range(1, len(row) + 1):
            if t == len(row) or row[t] != row[t - 1]:
                out.append((r, start, t))
                start = t
    return out


N = len(samples(SEQ))  # 9


def rnd(seed, *shape, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).requires_grad_()


def close(a, b, what, tol=1e-5):
    """max |a - b| <= tol x max(1, max |b|)."""
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err, scale = (a.double() - b.double()).abs().max().item(), max(1.0, b.abs().max().item())
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol:g} x {scale:.3g}"
    return err


def check(got, want, inputs, names, tol=1e-5):
    """got, want: lists of output tensors. Values agree, and so do the gradients of one random
    linear function of all outputs with respect to every input. Returns the largest difference."""
    g = torch.Generator().manual_seed(123)
    weights = [torch.randn(t.shape, generator=g) for t in want]
    worst = max(close(a, b, f"output {i}", tol) for i, (a, b) in enumerate(zip(got, want)))
    grads = [
        torch.autograd.grad(
            sum((w * t).sum() for w, t in zip(weights, outs)), inputs, retain_graph=True
        )
        for outs in (got, want)
    ]
    for name, a, b in zip(names, *grads):
        worst = max(worst, close(a, b, f"gradient of {name}", tol))
    return worst


@pytest.fixture
def on_cuda(fake_kernels, monkeypatch):
    """Every op routed to its cuda path (the fake kernels) although the tensors are on CPU."""
    monkeypatch.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
    return fake_kernels


# ---------------------------------------------------------------------------------------------
# the conv
# ---------------------------------------------------------------------------------------------


def conv_alone(x, w, bias, activation, states, seq=SEQ):
    """Each sample alone, its initial state's W-1 inputs before it (zeros without states)."""
    before = w.shape[1] - 1
    rows, finals = [[] for _ in range(seq.shape[0])], []
    for i, (r, s, e) in enumerate(samples(seq)):
        left = states[i] if states is not None else x.new_zeros(x.shape[1], before)
        ext = torch.cat([left[None], x[r : r + 1, :, s:e]], dim=2)
        rows[r].append(ops.causal_conv1d_reference(ext, w, bias, activation)[:, :, before:])
        finals.append(ext[0, :, ext.shape[2] - before :])
    return torch.cat([torch.cat(parts, dim=2) for parts in rows]), torch.stack(finals)


@pytest.mark.parametrize("backend_name", ["reference", "torch", "cuda"])
@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("width", [4, 2])
def test_conv_sample_states_equal_samples_alone(request, backend_name, layout, activation, width):
    calls = request.getfixturevalue("on_cuda") if backend_name == "cuda" else None
    (b, L), dim = SEQ.shape, 5
    x0 = rnd(0, b, dim, L) if layout == "contiguous" else rnd(0, b, L, dim)
    x = x0 if layout == "contiguous" else x0.transpose(1, 2)
    w, bias, states = rnd(1, dim, width), rnd(2, dim), rnd(3, N, dim, width - 1)
    kw = dict(backend=None if calls is not None else backend_name, seq_idx=SEQ)
    y, finals = ops.causal_conv1d(
        x, w, bias, activation, initial_sample_states=states, return_sample_states=True, **kw
    )
    assert finals.shape == (N, dim, width - 1)
    assert backend_name != "torch" or y.stride() == x.stride()  # the torch path keeps x's layout
    names = ["x", "weight", "bias", "initial_sample_states"]
    check(
        [y, finals], list(conv_alone(x, w, bias, activation, states)), [x0, w, bias, states], names
    )
    # only one of the two: from zeros with final states, or from states without
    y, finals = ops.causal_conv1d(x, w, bias, activation, return_sample_states=True, **kw)
    check([y, finals], list(conv_alone(x, w, bias, activation, None)), [x0, w, bias], names)
    y = ops.causal_conv1d(x, w, bias, activation, initial_sample_states=states, **kw)
    check([y], [conv_alone(x, w, bias, activation, states)[0]], [x0, w, bias, states], names)
    if calls is not None:  # the kernel ran, with seq_idx and without the states it refuses
        args = [a for name, a in calls if name == "causal_conv1d_fn"][-1]
        assert args["seq_idx"] is not None and "initial_states" not in args


def test_conv_width_one_has_empty_states():
    x, w = rnd(0, 3, 2, 13), rnd(1, 2, 1)
    y, finals = ops.causal_conv1d(x, w, seq_idx=SEQ, return_sample_states=True)
    assert finals.shape == (N, 2, 0)
    close(y, ops.causal_conv1d_reference(x, w), "y")


# ---------------------------------------------------------------------------------------------
# the S6 scan
# ---------------------------------------------------------------------------------------------


def s6_inputs(grouped, seq=SEQ, d=6, n=4, seed=0):
    b, L = seq.shape
    shape = (b, 2, n, L) if grouped else (b, n, L)
    return dict(
        u=rnd(seed, b, d, L),
        delta=rnd(seed + 1, b, d, L),
        A=(
            -torch.rand(d, n, generator=torch.Generator().manual_seed(seed + 2)) - 0.2
        ).requires_grad_(),
        B=rnd(seed + 3, *shape),
        C=rnd(seed + 4, *shape),
        D=rnd(seed + 5, d),
        z=rnd(seed + 6, b, d, L),
        delta_bias=rnd(seed + 7, d),
    )


def s6_alone(inputs, states, seq=SEQ, scan=ops.selective_scan_reference):
    """Each sample alone (through ``scan``, the reference) from its state: y (packed back into rows)
    and the samples' final states."""
    rows, finals = [[] for _ in range(seq.shape[0])], []
    for i, (r, s, e) in enumerate(samples(seq)):
        cut = {k: v[r : r + 1, ..., s:e] if v.dim() > 2 else v for k, v in inputs.items()}
        y, h = scan(
            **cut,
            delta_softplus=True,
            initial_state=None if states[i] is None else states[i][None],
            return_final_state=True,
        )
        rows[r].append(y)
        finals.append(h[0])
    return torch.cat([torch.cat(parts, dim=2) for parts in rows]), torch.stack(finals)


S6_BACKENDS = ["reference", "torch", "torch-chunks-3", "cuda"]


def s6_backend(request, monkeypatch, name, batch_dim_state):
    """The backend argument for ``name``; torch-chunks-3 makes SelectiveScanFn's chunks 3 steps
    long (its backward then recomputes chunks), cuda installs the fakes."""
    if name == "torch-chunks-3":
        monkeypatch.setattr(S6, "_CHUNK_ELEMENTS", 3 * batch_dim_state)
        return "torch"
    if name == "cuda":
        request.getfixturevalue("on_cuda")
        return None
    return name


@pytest.mark.parametrize("backend_name", S6_BACKENDS)
@pytest.mark.parametrize("grouped", [False, True])
def test_selective_scan_sample_states_equal_samples_alone(
    request, monkeypatch, backend_name, grouped
):
    name = s6_backend(request, monkeypatch, backend_name, 3 * 6 * 4)
    inputs, states = s6_inputs(grouped), rnd(9, N, 6, 4)
    names = [*inputs, "initial_sample_states"]
    kw = dict(delta_softplus=True, backend=name, seq_idx=SEQ)
    y, finals = ops.selective_scan(
        **inputs, initial_sample_states=states, return_sample_states=True, **kw
    )
    assert finals.dtype == torch.float32 and finals.shape == (N, 6, 4)
    want = s6_alone(inputs, states.unbind(0))
    check([y, finals], list(want), [*inputs.values(), states], names)
    # from zeros, final states returned; from states, none returned
    y, finals = ops.selective_scan(**inputs, return_sample_states=True, **kw)
    check([y, finals], list(s6_alone(inputs, [None] * N)), list(inputs.values()), names)
    y = ops.selective_scan(**inputs, initial_sample_states=states, **kw)
    check([y], [want[0]], [*inputs.values(), states], names)
    if backend_name == "cuda":  # mamba_ssm's selective_scan_fn cannot reset: never called
        assert not [c for c in request.getfixturevalue("fake_kernels") if "scan" in c[0]]


@pytest.mark.parametrize("backend_name", ["reference", "torch-chunks-3"])
def test_the_row_initial_state_starts_sample_zero_and_final_states_come_last(
    request, monkeypatch, backend_name
):
    """Without initial_sample_states, ``initial_state`` (per row) starts the first sample of each
    row that begins with seq_idx 0 (rows 0 and 2 here, not row 1), as without per-sample states;
    ``return_final_state`` gives each row's last sample's state, and asking for it next to
    ``return_sample_states`` is refused (it is sample_states[sample_numbers(seq_idx)[:, -1]])."""
    name = s6_backend(request, monkeypatch, backend_name, 3 * 6 * 4)
    inputs, h0 = s6_inputs(False), rnd(9, 3, 6, 4)
    y, finals = ops.selective_scan(
        **inputs,
        delta_softplus=True,
        initial_state=h0,
        return_sample_states=True,
        backend=name,
        seq_idx=SEQ,
    )
    with pytest.raises(ValueError, match="return_final_state and return_sample_states are exclu"):
        ops.selective_scan(
            **inputs, return_final_state=True, return_sample_states=True, seq_idx=SEQ
        )
    starts = [None] * N
    starts[0], starts[8] = h0[0], h0[2]  # the first samples of rows 0 and 2
    want = s6_alone(inputs, starts)
    check([y, finals], list(want), [*inputs.values(), h0], [*inputs, "initial_state"])
    y_plain, h_plain = ops.selective_scan(
        **inputs,
        delta_softplus=True,
        initial_state=h0,
        return_final_state=True,
        backend=name,
        seq_idx=SEQ,
    )
    close(y_plain, y, "y without per-sample states")
    close(h_plain, finals[[3, 7, 8]], "h_L: each row's last sample's state")


def test_a_long_sample_keeps_fp32_accuracy():
    """A sample of 2100 steps between two short ones, with slow decay (A ΣΔ between -0.85 and -0.1
    over the sample, so its initial state still matters at its end): outputs and final states of
    the torch path against the fp64 reference on each sample alone (the truth), gradients against
    the torch path on each sample alone (no per-sample states there; the reference's autograd
    through 2100 steps is the slow part of this file, and the short tests hold the gradients to
    the reference); all 1e-5."""
    lengths = [3, 2100, 1]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    d, n, L = 4, 3, seq.shape[1]
    inputs = s6_inputs(False, seq=seq, d=d, n=n)
    with torch.no_grad():
        inputs["delta"].mul_(0.1).sub_(5.0)  # Δ = softplus(δ + bias) ~ 0.007
        inputs["A"].mul_(0.05)
        inputs["delta_bias"].mul_(0.1)
    states = rnd(9, 3, d, n)
    y, finals = ops.selective_scan(
        **inputs,
        delta_softplus=True,
        initial_sample_states=states,
        return_sample_states=True,
        backend="torch",
        seq_idx=seq,
    )
    assert L >= 2048
    names = [*inputs, "initial_sample_states"]
    alone = lambda *a, **k: ops.selective_scan(*a, **k, backend="torch")  # noqa: E731
    want = s6_alone(inputs, states.unbind(0), seq=seq, scan=alone)
    check([y, finals], list(want), [*inputs.values(), states], names)
    # the initial state's share of the long sample's final state, exp(A ΣΔ) h0, is not negligible
    with torch.no_grad():
        dt = torch.nn.functional.softplus(inputs["delta"] + inputs["delta_bias"][:, None])
        decay = torch.exp(inputs["A"] * dt[0, :, 3:2103].sum(-1, keepdim=True))
        assert (decay * states[1]).abs().max() > 0.1
    exact = {k: v.detach().double() for k, v in inputs.items()}
    truth = s6_alone(exact, states.detach().double().unbind(0), seq=seq)
    close(y.detach(), truth[0], "y against fp64")
    close(finals.detach(), truth[1], "final states against fp64")


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", ["reference", "torch", "cuda"])
def test_bad_sample_state_arguments_are_clear_errors(request, backend_name):
    if backend_name == "cuda":
        request.getfixturevalue("on_cuda")
    kw = dict(backend=None if backend_name == "cuda" else backend_name)
    x, w = torch.randn(3, 5, 13), torch.randn(5, 4)
    inputs = {k: v.detach() for k, v in s6_inputs(False).items()}
    conv = lambda **k: ops.causal_conv1d(x, w, **kw, **k)  # noqa: E731
    scan = lambda **k: ops.selective_scan(**inputs, **kw, **k)  # noqa: E731
    for run, state in ((conv, (5, 3)), (scan, (6, 4))):
        with pytest.raises(ValueError, match=rf"one state per packed sample, \(9, {state[0]}"):
            run(seq_idx=SEQ, initial_sample_states=torch.zeros(8, *state))
        with pytest.raises(ValueError, match="initial_sample_states needs seq_idx"):
            run(initial_sample_states=torch.zeros(N, *state))
        with pytest.raises(ValueError, match="return_sample_states needs seq_idx"):
            run(return_sample_states=True)
        with pytest.raises(ValueError, match="floating-point"):
            run(seq_idx=SEQ, initial_sample_states=torch.zeros(N, *state, dtype=torch.long))
    with pytest.raises(ValueError, match="initial_state and initial_sample_states cannot both"):
        scan(
            seq_idx=SEQ,
            initial_state=torch.zeros(3, 6, 4),
            initial_sample_states=torch.zeros(N, 6, 4),
        )
