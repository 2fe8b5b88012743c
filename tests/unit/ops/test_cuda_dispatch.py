"""The ``cuda`` backend's wiring, checked on CPU.

The kernels themselves need a GPU. What can be checked here is that every ``*_cuda`` function calls
the kernel that mamba_ssm / causal_conv1d export, under the right module path, with the argument
names and order of their documented signatures. Fake kernel modules stand in for them: each one
checks its call against the real signature and computes the answer with ssmkit's reference, so a
mis-wired argument changes the result.
"""

from __future__ import annotations

import pytest
import torch
from fake_kernels import CONV, MAMBA3, NORM, S6, SSD

from ssmkit import ops
from ssmkit.ops import backend


def g(seed):
    return torch.Generator().manual_seed(seed)


def test_selective_scan_cuda_wiring(fake_kernels):
    b, d, n, L = 2, 6, 4, 9
    u, delta, z = (torch.randn(b, d, L, generator=g(i)) for i in range(3))
    A = -torch.rand(d, n, generator=g(3))
    B, C = torch.randn(b, n, L, generator=g(4)), torch.randn(b, n, L, generator=g(5))
    D, bias = torch.randn(d, generator=g(6)), torch.randn(d, generator=g(7))
    kw = dict(D=D, z=z, delta_bias=bias, delta_softplus=True, return_final_state=True)
    y, h = S6.selective_scan_cuda(u, delta, A, B, C, **kw)
    y_ref, h_ref = ops.selective_scan_reference(u, delta, A, B, C, **kw)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(h, h_ref)
    name, args = fake_kernels[-1]
    assert name == "selective_scan_fn"
    assert args["return_last_state"] is True and args["delta_softplus"] is True
    with pytest.raises(ops.BackendError, match="initial_state"):
        S6.selective_scan_cuda(u, delta, A, B, C, initial_state=torch.zeros(b, d, n))


def test_ssd_cuda_wiring(fake_kernels):
    b, L, h, p, gr, n = 2, 11, 4, 3, 2, 5
    x = torch.randn(b, L, h, p, generator=g(0))
    dt, A = torch.randn(b, L, h, generator=g(1)), -torch.rand(h, generator=g(2))
    B, C = torch.randn(b, L, gr, n, generator=g(3)), torch.randn(b, L, gr, n, generator=g(4))
    kw = dict(
        D=torch.randn(h, generator=g(5)),
        z=torch.randn(b, L, h, p, generator=g(6)),
        dt_bias=torch.randn(h, generator=g(7)),
        dt_softplus=True,
        initial_states=torch.randn(b, h, p, n, generator=g(8)),
        return_final_states=True,
        dt_limit=(0.01, 2.0),
    )
    y, hf = SSD.ssd_cuda(x, dt, A, B, C, 4, **kw)
    y_ref, hf_ref = ops.ssd_reference(x, dt, A, B, C, 4, **kw)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(hf, hf_ref)
    name, args = fake_kernels[-1]
    assert name == "mamba_chunk_scan_combined"
    assert args["chunk_size"] == 4 and args["dt_limit"] == (0.01, 2.0)


def test_conv_norm_and_step_cuda_wiring(fake_kernels):
    x = torch.randn(2, 5, 7, generator=g(0))
    w, bias = torch.randn(5, 4, generator=g(1)), torch.randn(5, generator=g(2))
    torch.testing.assert_close(
        CONV.causal_conv1d_cuda(x, w, bias, "silu"), ops.causal_conv1d_reference(x, w, bias, "silu")
    )
    # route the dispatchers to "cuda" although the tensors are on CPU
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
        state = torch.randn(2, 5, 4, generator=g(3))
        expected_state = state.clone()
        want = ops.causal_conv1d_update(
            x[:, :, 0], expected_state, w, bias, "silu", backend="torch"
        )
        torch.testing.assert_close(
            CONV.causal_conv1d_update(x[:, :, 0], state, w, bias, "silu"), want
        )
        torch.testing.assert_close(state, expected_state)
        xs, wn = torch.randn(3, 8, generator=g(4)), torch.randn(8, generator=g(5))
        zs = torch.randn(3, 8, generator=g(6))
        torch.testing.assert_close(
            NORM.rms_norm(xs, wn, eps=1e-5), ops.rms_norm(xs, wn, eps=1e-5, backend="reference")
        )
        got = NORM.rms_norm_gated(xs, wn, zs, eps=1e-5, group_size=4, norm_before_gate=False)
        torch.testing.assert_close(
            got,
            ops.rms_norm_gated(
                xs, wn, zs, eps=1e-5, group_size=4, norm_before_gate=False, backend="reference"
            ),
        )
        ssm = torch.randn(2, 5, 3, generator=g(7))
        ref_state = ssm.clone()
        step = dict(
            D=torch.randn(5, generator=g(8)),
            dt_bias=torch.randn(5, generator=g(9)),
            dt_softplus=True,
        )
        args = (
            x[:, :, 1],
            torch.randn(2, 5, generator=g(10)),
            -torch.rand(5, 3, generator=g(11)),
            torch.randn(2, 3, generator=g(12)),
            torch.randn(2, 3, generator=g(13)),
        )
        y = ops.selective_state_update(ssm, *args, **step)
        torch.testing.assert_close(
            y, ops.selective_state_update(ref_state, *args, **step, backend="torch")
        )
        torch.testing.assert_close(ssm, ref_state)
    names = [name for name, _ in fake_kernels]
    assert names == [
        "causal_conv1d_fn",
        "causal_conv1d_update",
        "rms_norm_fn",
        "rmsnorm_fn",
        "selective_state_update",
    ]


def mamba3_inputs(rank, seqlen=7, mimo=None, init=False, b=2, h=4, p=3, gr=2, n=8, S=2):
    """ops.mamba3_scan's arguments: 2 groups of an 8-dimensional state, 2 angles (MIMO's divisor
    4)."""
    mimo = rank > 1 if mimo is None else mimo
    rnd = lambda seed, *shape: torch.randn(*shape, generator=g(seed))  # noqa: E731
    kw = dict(
        x=rnd(0, b, seqlen, h, p),
        dt=rnd(1, b, seqlen, h).abs() + 0.1,
        A=-rnd(2, b, seqlen, h).abs() - 0.1,
        trap=rnd(3, b, seqlen, h),
        angles=rnd(6, b, seqlen, h, S),
        B=rnd(4, b, seqlen, rank, gr, n),
        C=rnd(5, b, seqlen, rank, gr, n),
        B_bias=rnd(7, h, rank, n),
        C_bias=rnd(8, h, rank, n),
        D=rnd(9, h),
        z=rnd(10, b, seqlen, h, p),
    )
    if mimo:
        kw.update(
            mimo_x=rnd(11, h, rank, p), mimo_z=rnd(12, h, rank, p), mimo_o=rnd(13, h, rank, p)
        )
    if init:
        kw["initial_states"] = (
            rnd(20, b, h, S).abs(),
            rnd(21, b, h, p, n),
            rnd(22, b, rank, h, n),
            rnd(23, b, h, p),
        )
    return kw


@pytest.mark.parametrize("init", [False, True])
def test_mamba3_siso_cuda_wiring(fake_kernels, init):
    kw = mamba3_inputs(1, init=init)
    y, states = MAMBA3.mamba3_cuda(**kw, chunk_size=4, return_final_states=True)
    y_ref, states_ref = ops.mamba3_reference(**kw, return_final_states=True)
    torch.testing.assert_close(y, y_ref)
    for mine, ref in zip(states, states_ref):
        torch.testing.assert_close(mine, ref)
    name, args = fake_kernels[-1]
    assert (
        name == "mamba3_siso_combined"
        and args["chunk_size"] == 4
        and args["return_final_states"] is True
    )
    assert tuple(args["ADT"].shape) == (2, 4, 7) and tuple(args["K"].shape) == (2, 7, 2, 8)


@pytest.mark.parametrize("rank", [1, 3])
def test_mamba3_mimo_cuda_wiring(fake_kernels, rank):
    kw = mamba3_inputs(rank, mimo=True)
    y, states = MAMBA3.mamba3_cuda(**kw, chunk_size=8, return_final_states=True)
    y_ref, states_ref = ops.mamba3_reference(**kw, return_final_states=True)
    torch.testing.assert_close(y, y_ref)
    for mine, ref in zip(states, states_ref):
        torch.testing.assert_close(mine, ref)
    name, args = fake_kernels[-1]
    assert (
        name == "mamba3_mimo" and args["rotary_dim_divisor"] == 4 and args["return_state"] is True
    )
    # the MIMO kernel cannot continue a sequence: an error when forced, the torch path when chosen
    # on its own
    start = mamba3_inputs(rank, mimo=True, init=True)
    with pytest.raises(ops.BackendError, match="no initial states"):
        MAMBA3.mamba3_cuda(**start)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
        calls = len(fake_kernels)
        torch.testing.assert_close(ops.mamba3_scan(**start), ops.mamba3_reference(**start))
        assert len(fake_kernels) == calls


@pytest.mark.parametrize(
    "rank, mimo, gate, outproj",
    [
        (1, False, True, True),
        (1, False, False, True),
        (2, True, True, True),
        (3, True, False, False),
    ],
)
def test_mamba3_step_cuda_wiring(fake_kernels, rank, mimo, gate, outproj):
    kw = mamba3_inputs(rank, seqlen=1, mimo=mimo, init=True)
    states = [s.clone() for s in kw.pop("initial_states")]
    one = {
        k: v[:, 0] if k in ("x", "dt", "A", "trap", "B", "C", "angles", "z") else v
        for k, v in kw.items()
    }
    if not gate:
        one["z"] = None
    if not outproj:
        one["mimo_o"] = None
    ref_states = [s.clone() for s in states]
    want = ops.mamba3_step(ref_states, **one, backend="torch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
        got = ops.mamba3_step(states, **one)
    torch.testing.assert_close(got, want)
    for mine, ref in zip(states, ref_states):
        torch.testing.assert_close(mine, ref)
    assert fake_kernels[-1][0] == "mamba3_step_fn"
