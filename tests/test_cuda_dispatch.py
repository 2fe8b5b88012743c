"""The ``cuda`` backend's wiring, checked on CPU.

The kernels themselves need a GPU. What can be checked here is that every ``*_cuda`` function calls
the kernel that mamba_ssm / causal_conv1d export, under the right module path, with the argument
names and order of their documented signatures. Fake kernel modules stand in for them: each one
checks its call against the real signature and computes the answer with ssmkit's reference, so a
mis-wired argument changes the result.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from ssmkit import ops
from ssmkit.ops import backend

S6 = sys.modules["ssmkit.ops.s6"]
SSD = sys.modules["ssmkit.ops.ssd"]
CONV = sys.modules["ssmkit.ops.conv"]
NORM = sys.modules["ssmkit.ops.norm"]


# The kernels' signatures as the packages define them (mamba_ssm 2.2.x, causal_conv1d 1.4.x).
def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    return ops.selective_scan_reference(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                        delta_softplus=delta_softplus, return_final_state=return_last_state)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    return ops.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                      dt_softplus=dt_softplus, backend="torch")


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    return ops.ssd_reference(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                             initial_states=initial_states, return_final_states=return_final_states,
                             dt_limit=dt_limit)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    return ops.causal_conv1d_reference(x, weight, bias, activation)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    return ops.causal_conv1d_update(x, conv_state, weight, bias, activation, backend="torch")


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    assert bias is None
    return ops.rms_norm(x, weight, eps=eps, backend="reference")


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    assert bias is None
    return ops.rms_norm_gated(x, weight, z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate,
                              backend="reference")


FAKES = {
    "mamba_ssm.ops.selective_scan_interface": {"selective_scan_fn": selective_scan_fn},
    "mamba_ssm.ops.triton.selective_state_update": {"selective_state_update": selective_state_update},
    "mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": mamba_chunk_scan_combined},
    "causal_conv1d": {"causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update},
    "mamba_ssm.ops.triton.layer_norm": {"rms_norm_fn": rms_norm_fn},
    "mamba_ssm.ops.triton.layernorm_gated": {"rmsnorm_fn": rmsnorm_fn},
}


@pytest.fixture
def fake_kernels(monkeypatch):
    """Install the fake modules; record every call with its arguments bound to the real signature."""
    calls = []
    for module, fns in FAKES.items():
        fake = types.ModuleType(module)
        for name, fn in fns.items():
            def spy(*args, _fn=fn, _name=name, **kwargs):
                bound = inspect.signature(_fn).bind(*args, **kwargs)       # TypeError if mis-called
                calls.append((_name, bound.arguments))
                return _fn(*args, **kwargs)
            setattr(fake, name, spy)
        monkeypatch.setitem(sys.modules, module, fake)
    assert set(FAKES) == set(backend.KERNEL_MODULES.values())
    return calls


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
    kw = dict(D=torch.randn(h, generator=g(5)), z=torch.randn(b, L, h, p, generator=g(6)),
              dt_bias=torch.randn(h, generator=g(7)), dt_softplus=True,
              initial_states=torch.randn(b, h, p, n, generator=g(8)),
              return_final_states=True, dt_limit=(0.01, 2.0))
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
    torch.testing.assert_close(CONV.causal_conv1d_cuda(x, w, bias, "silu"),
                               ops.causal_conv1d_reference(x, w, bias, "silu"))
    # route the dispatchers to "cuda" although the tensors are on CPU
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
        state = torch.randn(2, 5, 4, generator=g(3))
        expected_state = state.clone()
        want = ops.causal_conv1d_update(x[:, :, 0], expected_state, w, bias, "silu", backend="torch")
        torch.testing.assert_close(CONV.causal_conv1d_update(x[:, :, 0], state, w, bias, "silu"), want)
        torch.testing.assert_close(state, expected_state)
        xs, wn = torch.randn(3, 8, generator=g(4)), torch.randn(8, generator=g(5))
        zs = torch.randn(3, 8, generator=g(6))
        torch.testing.assert_close(NORM.rms_norm(xs, wn, eps=1e-5),
                                   ops.rms_norm(xs, wn, eps=1e-5, backend="reference"))
        got = NORM.rms_norm_gated(xs, wn, zs, eps=1e-5, group_size=4, norm_before_gate=False)
        torch.testing.assert_close(got, ops.rms_norm_gated(xs, wn, zs, eps=1e-5, group_size=4,
                                                           norm_before_gate=False, backend="reference"))
        ssm = torch.randn(2, 5, 3, generator=g(7))
        ref_state = ssm.clone()
        step = dict(D=torch.randn(5, generator=g(8)), dt_bias=torch.randn(5, generator=g(9)),
                    dt_softplus=True)
        args = (x[:, :, 1], torch.randn(2, 5, generator=g(10)), -torch.rand(5, 3, generator=g(11)),
                torch.randn(2, 3, generator=g(12)), torch.randn(2, 3, generator=g(13)))
        y = ops.selective_state_update(ssm, *args, **step)
        torch.testing.assert_close(y, ops.selective_state_update(ref_state, *args, **step, backend="torch"))
        torch.testing.assert_close(ssm, ref_state)
    names = [name for name, _ in fake_kernels]
    assert names == ["causal_conv1d_fn", "causal_conv1d_update", "rms_norm_fn", "rmsnorm_fn",
                     "selective_state_update"]
