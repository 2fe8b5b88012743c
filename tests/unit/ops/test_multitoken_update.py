"""The decode ops over k >= 1 new tokens in one call (speculative decoding's verification step).

Oracles, fp32, max |difference| <= TOL = 1e-5 on O(1) values (a different summation order costs
~1e-7; a dropped tap, a shifted slot or a state advanced once too often is far above it):

* the same op called once per token, k times in a row (outputs and the state left behind);
* an independent second path: the whole-sequence op (``causal_conv1d_reference`` over the cached
  inputs followed by the new ones; ``selective_scan_reference`` / ``ssd_reference`` /
  ``mamba3_reference`` from the cached state, with their final states);
* causal-conv1d's circular buffer (``cache_seqlens``) against its shifting form: the buffer rotated
  to start at slot cache_seqlens mod state_len is the shifting state, before and after;
* gradients (inputs, weights, the state carried in) of the k-token call against k calls;
* the ``cuda`` backend's wiring on CPU through tests/fake_kernels.py, whose fakes hold the kernels'
  own checks (one token for mamba_ssm's state updates, int32 ``cache_seqlens`` for causal-conv1d's).
"""

from __future__ import annotations

import re

import pytest
import torch
from fake_kernels import MAMBA3, causal_conv1d_update, selective_state_update

from ssmkit import ops
from ssmkit.ops import backend

TOL = 1e-5


def g(seed):
    return torch.Generator().manual_seed(seed)


def rnd(seed, *shape):
    return torch.randn(*shape, generator=g(seed))


def maxdiff(a, b):
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.detach().float() - b.detach().float()).abs().max().item()


def as_cuda(monkeypatch):
    """Route every dispatcher to the ``cuda`` backend although the tensors are on CPU."""
    monkeypatch.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")


# --------------------------------------------------------------------------------------------
# the conv update
# --------------------------------------------------------------------------------------------


def conv_case(k, state_len, width=4, batch=3, dim=5, bias=True, seed=0):
    return dict(
        x=rnd(seed, batch, dim, k),
        conv_state=rnd(seed + 1, batch, dim, state_len),
        weight=rnd(seed + 2, dim, width),
        bias=rnd(seed + 3, dim) if bias else None,
    )


def conv_one_by_one(x, conv_state, weight, bias, activation, **kw):
    """k one-token calls (x (batch, dim) each), the state updated in place."""
    ys = [
        ops.causal_conv1d_update(x[:, :, t], conv_state, weight, bias, activation, **kw)
        for t in range(x.shape[2])
    ]
    return torch.stack(ys, dim=-1)


def rotate(state, shifts):
    """Row b of a (batch, dim, state_len) state with its slots rolled by shifts[b]: slot i ->
    (i + shifts[b]) mod state_len."""
    return torch.stack([torch.roll(s, int(n), dims=-1) for s, n in zip(state, shifts)])


@pytest.mark.parametrize("backend_name", ["reference", "torch"])
@pytest.mark.parametrize(
    "k, state_len, width, activation, bias",
    [
        (1, 4, 4, "silu", True),  # the decode step, the models' state_len = width
        (4, 4, 4, "silu", True),  # a draft of 4
        (7, 3, 4, None, False),  # state_len = width - 1 (the minimum) and k > state_len
        (5, 9, 3, "swish", True),  # a longer state than the window
        (3, 1, 2, None, True),  # width 2
    ],
)
def test_conv_update_over_k_tokens_equals_k_steps(
    k, state_len, width, activation, bias, backend_name
):
    case = conv_case(k, state_len, width, bias=bias)
    start = case["conv_state"].clone()
    y = ops.causal_conv1d_update(**case, activation=activation, backend=backend_name)
    steps_state = start.clone()
    steps = conv_one_by_one(
        case["x"], steps_state, case["weight"], case["bias"], activation, backend="torch"
    )
    assert maxdiff(y, steps) <= TOL
    assert torch.equal(case["conv_state"], steps_state)  # the state is moved values, not sums
    # the second path: the whole-sequence conv over the cached inputs and the new ones
    history = torch.cat([start, case["x"]], dim=-1)
    full = ops.causal_conv1d_reference(history, case["weight"], case["bias"], activation)
    assert maxdiff(y, full[:, :, -k:]) <= TOL
    assert torch.equal(case["conv_state"], history[:, :, -state_len:])


@pytest.mark.parametrize("backend_name", ["reference", "torch"])
@pytest.mark.parametrize("k, state_len", [(1, 4), (3, 4), (6, 4), (2, 7)])
def test_circular_conv_state_equals_the_shifting_form(k, state_len, backend_name):
    case = conv_case(k, state_len)
    seen = torch.tensor([0, 2, 13], dtype=torch.int32)  # fresh, fewer than width - 1, wrapped
    shifting = case["conv_state"].clone()
    want = ops.causal_conv1d_update(**{**case, "conv_state": shifting}, activation="silu")
    # slot (seen - state_len + i) mod state_len holds the shifting state's slot i
    circular = rotate(case["conv_state"], seen)
    got = ops.causal_conv1d_update(
        **{**case, "conv_state": circular},
        activation="silu",
        backend=backend_name,
        cache_seqlens=seen,
    )
    assert maxdiff(got, want) <= TOL
    assert torch.equal(rotate(circular, -(seen.long() + k)), shifting)
    # k one-token calls, the caller advancing cache_seqlens by one each time, agree as well
    again, ys = rotate(case["conv_state"], seen), []
    for t in range(k):
        ys.append(
            ops.causal_conv1d_update(
                case["x"][:, :, t],
                again,
                case["weight"],
                case["bias"],
                "silu",
                cache_seqlens=seen + t,
            )
        )
    assert maxdiff(torch.stack(ys, -1), want) <= TOL and torch.equal(again, circular)


@pytest.mark.parametrize("backend_name", ["reference", "torch"])
def test_conv_state_indices_pick_pool_entries_and_skip_padding(backend_name):
    case = conv_case(3, 4)
    pool = rnd(9, 6, 5, 4)
    index = torch.tensor([4, -1, 1], dtype=torch.int32)  # row 1 is padding
    before = pool.clone()
    y = ops.causal_conv1d_update(
        case["x"],
        pool,
        case["weight"],
        case["bias"],
        "silu",
        backend=backend_name,
        conv_state_indices=index,
    )
    rows = before[[4, 0, 1]]  # row 1 reads some entry; its output is zeroed and nothing written
    want = ops.causal_conv1d_update(case["x"], rows, case["weight"], case["bias"], "silu")
    assert maxdiff(y[[0, 2]], want[[0, 2]]) <= TOL and torch.equal(y[1], torch.zeros_like(y[1]))
    assert torch.equal(pool[[4, 1]], rows[[0, 2]])
    untouched = [0, 2, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("backend_name", ["reference", "torch"])
def test_conv_update_gradients_equal_k_steps(backend_name):
    case = conv_case(4, 4)
    leaves = {n: t.clone().requires_grad_() for n, t in case.items()}
    upstream = rnd(7, 3, 5, 4)

    def grads(run):
        state = leaves["conv_state"].clone()  # the carried-in state, differentiable
        y = run(state)
        loss = (y * upstream).sum() + (state * rnd(8, *state.shape)).sum()
        return torch.autograd.grad(loss, list(leaves.values()))

    one_call = grads(
        lambda s: ops.causal_conv1d_update(
            leaves["x"], s, leaves["weight"], leaves["bias"], "silu", backend=backend_name
        )
    )
    steps = grads(
        lambda s: conv_one_by_one(leaves["x"], s, leaves["weight"], leaves["bias"], "silu")
    )
    for name, a, b in zip(leaves, one_call, steps):
        assert maxdiff(a, b) <= TOL, name


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(x=rnd(0, 3, 5, 2, 1)), "expected x (batch, dim) or (batch, dim, seqlen)"),
        (dict(x=rnd(0, 3, 5, 0)), "seqlen >= 1"),
        (dict(conv_state=rnd(0, 3, 5, 2)), "state_len >= width - 1"),
        (dict(conv_state=rnd(0, 2, 5, 4)), "conv_state (batch=3, dim, state_len)"),
        (dict(bias=rnd(0, 4)), "bias must be (dim=5,)"),
        (dict(cache_seqlens=torch.zeros(3)), "cache_seqlens must be an integer tensor (batch=3,)"),
        (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32)), "cache_seqlens must be"),
        (dict(cache_seqlens=torch.tensor([0, -1, 2])), "cache_seqlens must be non-negative"),
        (dict(conv_state_indices=torch.tensor([0, 1, 3])), "below n_entries=3"),
        (dict(activation="gelux"), "activation must be one of: gelu, "),
    ],
)
def test_conv_update_refuses_bad_input_and_leaves_the_state(change, message):
    case = {**conv_case(2, 4), "activation": "silu", **change}
    before = case["conv_state"].clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        ops.causal_conv1d_update(**case)
    assert torch.equal(case["conv_state"], before)


def test_conv_update_cuda_wiring(fake_kernels, monkeypatch):
    case = conv_case(3, 6)
    seen = torch.tensor([1, 5, 8])  # int64 here: the kernel gets int32
    index = torch.tensor([2, 0, 1])
    want_state = case["conv_state"].clone()
    want = ops.causal_conv1d_update(
        **{**case, "conv_state": want_state},
        activation="silu",
        backend="torch",
        cache_seqlens=seen,
        conv_state_indices=index,
    )
    as_cuda(monkeypatch)
    got = ops.causal_conv1d_update(
        **case, activation="silu", cache_seqlens=seen, conv_state_indices=index
    )
    assert maxdiff(got, want) <= TOL and torch.equal(case["conv_state"], want_state)
    name, args = fake_kernels[-1]
    assert name == "causal_conv1d_update" and tuple(args["x"].shape) == (3, 5, 3)
    assert args["cache_seqlens"].dtype == torch.int32
    assert args["conv_state_indices"].dtype == torch.int32
    # a width or state dtype the kernel refuses (its TORCH_CHECKs, which the fake holds): the torch
    # path runs instead, unless cuda is forced
    calls = len(fake_kernels)
    wide = conv_case(2, 5, width=5)
    ops.causal_conv1d_update(**wide, activation="silu")
    ops.causal_conv1d_update(**{**conv_case(2, 4), "conv_state": rnd(1, 3, 5, 4).double()})
    assert len(fake_kernels) == calls
    with pytest.raises(AssertionError):
        ops.causal_conv1d_update(**wide, backend="cuda")
    with pytest.raises(AssertionError):  # the fake checks the real kernel's int32 rule
        causal_conv1d_update(**conv_case(2, 4), cache_seqlens=torch.zeros(3, dtype=torch.long))


# --------------------------------------------------------------------------------------------
# the selective state update: Mamba-1 and Mamba-2 layouts
# --------------------------------------------------------------------------------------------


def step_case(layout, T, batch=2, seed=0):
    """selective_state_update's arguments with a token axis of T, plus the layout's scan oracle.
    mamba1: state (b, d, n), B/C shared by all channels; mamba1-groups: B/C per group of channels;
    mamba2: A, Δ, dt_bias, D one per head broadcast over headdim (the mixer's stride-0 layout)."""
    n = 4
    if layout.startswith("mamba1"):
        d = 6
        groups = layout == "mamba1-groups"
        BC = (batch, T, 2, n) if groups else (batch, T, n)
        return dict(
            state=rnd(seed, batch, d, n),
            x=rnd(seed + 1, batch, T, d),
            dt=rnd(seed + 2, batch, T, d),
            A=-rnd(seed + 3, d, n).abs() - 0.1,
            B=rnd(seed + 4, *BC),
            C=rnd(seed + 5, *BC),
            D=rnd(seed + 6, d),
            z=rnd(seed + 7, batch, T, d),
            dt_bias=rnd(seed + 8, d),
            dt_softplus=True,
        )
    h, p, gr = 4, 3, 2
    return dict(
        state=rnd(seed, batch, h, p, n),
        x=rnd(seed + 1, batch, T, h, p),
        dt=rnd(seed + 2, batch, T, h)[..., None].expand(batch, T, h, p),
        A=(-rnd(seed + 3, h).abs() - 0.1)[:, None, None].expand(h, p, n),
        B=rnd(seed + 4, batch, T, gr, n),
        C=rnd(seed + 5, batch, T, gr, n),
        D=rnd(seed + 6, h)[:, None].expand(h, p),
        z=rnd(seed + 7, batch, T, h, p),
        dt_bias=rnd(seed + 8, h)[:, None].expand(h, p),
        dt_softplus=True,
    )


def one_by_one(case, **kw):
    """T one-token calls of selective_state_update on case's state."""
    per_token = ("x", "dt", "B", "C", "z")
    T = case["x"].shape[1]
    ys = [
        ops.selective_state_update(
            **{k: (v[:, t] if k in per_token else v) for k, v in case.items()}, **kw
        )
        for t in range(T)
    ]
    return torch.stack(ys, dim=1)


def scan_oracle(layout, case):
    """The whole-sequence scan from case's state: (y (batch, T, ...), final state)."""
    c = case
    if layout.startswith("mamba1"):
        B, C = (c[k].movedim(1, -1) for k in ("B", "C"))  # (b, [g,] n, T)
        y, h = ops.selective_scan_reference(
            c["x"].transpose(1, 2),
            c["dt"].transpose(1, 2),
            c["A"],
            B,
            C,
            D=c["D"],
            z=c["z"].transpose(1, 2),
            delta_bias=c["dt_bias"],
            delta_softplus=True,
            initial_state=c["state"],
            return_final_state=True,
        )
        return y.transpose(1, 2), h
    y, h = ops.ssd_reference(
        c["x"],
        c["dt"][..., 0],
        c["A"][:, 0, 0],
        c["B"],
        c["C"],
        4,
        D=c["D"][:, 0],
        z=c["z"],
        dt_bias=c["dt_bias"][:, 0],
        dt_softplus=True,
        initial_states=c["state"],
        return_final_states=True,
    )
    return y, h


@pytest.mark.parametrize("grad", [False, True], ids=["in-place", "functional"])
@pytest.mark.parametrize("backend_name", ["reference", "torch"])
@pytest.mark.parametrize("layout", ["mamba1", "mamba1-groups", "mamba2"])
@pytest.mark.parametrize("T", [1, 4])
def test_state_update_over_T_tokens_equals_T_steps(layout, T, backend_name, grad):
    case = step_case(layout, T)
    start = case["state"].clone()
    with torch.set_grad_enabled(grad):
        y = ops.selective_state_update(**case, backend=backend_name)
        steps_case = dict(case, state=start.clone())
        steps = one_by_one(steps_case, backend="reference")
    assert y.shape == case["x"].shape
    assert maxdiff(y, steps) <= TOL and maxdiff(case["state"], steps_case["state"]) <= TOL
    y_scan, h_scan = scan_oracle(layout, dict(case, state=start))
    assert maxdiff(y, y_scan) <= TOL and maxdiff(case["state"], h_scan) <= TOL


@pytest.mark.parametrize("layout", ["mamba1", "mamba2"])
def test_state_update_gradients_equal_T_steps(layout):
    case = step_case(layout, 3)
    leaves = {k: case[k].clone().requires_grad_() for k in ("state", "x", "B", "C", "z")}
    upstream = rnd(11, *case["x"].shape)

    def grads(run):
        args = {**case, **leaves, "state": leaves["state"].clone()}  # the carried-in state
        y = run(args)
        loss = (y * upstream).sum() + args["state"].square().sum()
        return torch.autograd.grad(loss, list(leaves.values()))

    for name, a, b in zip(
        leaves, grads(lambda a: ops.selective_state_update(**a)), grads(one_by_one)
    ):
        assert maxdiff(a, b) <= TOL, name


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(B=rnd(0, 2, 4)), "B must be (batch=2, T=3, [ngroups,] dstate)"),
        (dict(dt=rnd(0, 2, 2, 6)), "dt must be shaped as x (2, 3, 6)"),
        (dict(D=rnd(0, 5)), "D must be (dim=6,) for Mamba-1"),
        (dict(x=rnd(0, 2, 0, 6), dt=rnd(0, 2, 0, 6), z=None), "x must hold at least one token"),
    ],
)
def test_state_update_refuses_bad_token_shapes(change, message):
    case = dict(step_case("mamba1", 3), **change)
    with pytest.raises(ValueError, match=re.escape(message)):
        ops.selective_state_update(**case)


def test_state_update_cuda_wiring(fake_kernels, monkeypatch):
    case = step_case("mamba2", 3)
    # dt_limit's path in the Mamba-2 mixer: Δ already discretized, dt_bias None, A and Δ broadcast
    case.update(dt_bias=None, dt_softplus=False, dt=case["dt"][..., :1].abs().expand_as(case["dt"]))
    want_case = dict(case, state=case["state"].clone())
    want = one_by_one(want_case, backend="torch")
    with pytest.raises(AttributeError):  # the kernel itself would fail here (its tie_hdim test)
        selective_state_update(
            **{k: (v[:, 0] if k in ("x", "dt", "B", "C", "z") else v) for k, v in case.items()}
        )
    as_cuda(monkeypatch)
    calls = len(fake_kernels)
    y = ops.selective_state_update(**case)
    assert maxdiff(y, want) <= TOL and maxdiff(case["state"], want_case["state"]) <= TOL
    made = fake_kernels[calls:]
    assert [n for n, _ in made] == ["selective_state_update"] * 3  # one kernel call per token
    assert all(tuple(a["x"].shape) == (2, 4, 3) for _, a in made)


# --------------------------------------------------------------------------------------------
# Mamba-3's step
# --------------------------------------------------------------------------------------------


def mamba3_case(rank, T, mimo_o=True, b=2, h=4, p=3, gr=2, n=8, S=2, seed=0):
    """mamba3_step's arguments with a token axis of T (the scan's layout) and a non-zero state."""
    kw = dict(
        x=rnd(seed, b, T, h, p),
        dt=rnd(seed + 1, b, T, h).abs() + 0.1,
        A=-rnd(seed + 2, b, T, h).abs() - 0.1,
        trap=rnd(seed + 3, b, T, h),
        B=rnd(seed + 4, b, T, rank, gr, n),
        C=rnd(seed + 5, b, T, rank, gr, n),
        angles=rnd(seed + 6, b, T, h, S),
        B_bias=rnd(seed + 7, h, rank, n),
        C_bias=rnd(seed + 8, h, rank, n),
        D=rnd(seed + 9, h),
        z=rnd(seed + 10, b, T, h, p),
    )
    if rank > 1:
        kw.update(mimo_x=rnd(seed + 11, h, rank, p), mimo_z=rnd(seed + 12, h, rank, p))
        if mimo_o:
            kw["mimo_o"] = rnd(seed + 13, h, rank, p)
    states = (
        rnd(seed + 20, b, h, S).abs(),
        rnd(seed + 21, b, h, p, n),
        rnd(seed + 22, b, rank, h, n),
        rnd(seed + 23, b, h, p),
    )
    return kw, states


TIMED = ("x", "dt", "A", "trap", "B", "C", "angles", "z")


@pytest.mark.parametrize(
    "rank, mimo_o", [(1, True), (2, True), (2, False)], ids=["siso", "mimo", "mimo-per-rank"]
)
@pytest.mark.parametrize("T", [1, 4])
def test_mamba3_step_over_T_tokens_equals_T_steps(rank, mimo_o, T):
    kw, start = mamba3_case(rank, T, mimo_o)
    states = [s.clone() for s in start]
    y = ops.mamba3_step(states, **kw)
    steps_states = [s.clone() for s in start]
    steps = torch.stack(
        [
            ops.mamba3_step(
                steps_states, **{k: (v[:, t] if k in TIMED else v) for k, v in kw.items()}
            )
            for t in range(T)
        ],
        dim=1,
    )
    assert maxdiff(y, steps) <= TOL
    y_ref, final = ops.mamba3_reference(**kw, initial_states=start, return_final_states=True)
    assert maxdiff(y, y_ref) <= TOL
    for mine, one_by_one_state, ref in zip(states, steps_states, final):
        assert maxdiff(mine, one_by_one_state) <= TOL and maxdiff(mine, ref) <= TOL


def test_mamba3_step_refuses_bad_shapes():
    kw, states = mamba3_case(1, 3)
    with pytest.raises(ValueError, match=re.escape("mamba3_step (T tokens: seqlen = T)")):
        ops.mamba3_step(states, **dict(kw, dt=kw["dt"][:, :2]))
    with pytest.raises(ValueError, match=re.escape("without seqlen): initial_states must be")):
        ops.mamba3_step(
            [s[:1] for s in states], **{k: (v[:, 0] if k in TIMED else v) for k, v in kw.items()}
        )
    with pytest.raises(ValueError, match=re.escape("x must be (batch, nheads, headdim)")):
        ops.mamba3_step(states, **dict(kw, x=kw["x"][0, 0]))


@pytest.mark.parametrize("rank", [1, 2])
def test_mamba3_step_cuda_wiring(fake_kernels, monkeypatch, rank):
    kw, start = mamba3_case(rank, 3)
    want_states = [s.clone() for s in start]
    want = ops.mamba3_step(want_states, **kw, backend="torch")
    states = [s.clone() for s in start]
    as_cuda(monkeypatch)
    calls = len(fake_kernels)
    y = MAMBA3.mamba3_step(states, **kw)
    assert maxdiff(y, want) <= TOL
    for mine, ref in zip(states, want_states):
        assert maxdiff(mine, ref) <= TOL
    assert [n for n, _ in fake_kernels[calls:]] == ["mamba3_step_fn"] * 3
