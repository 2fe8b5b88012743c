"""Fake ``mamba_ssm`` / ``causal_conv1d`` kernel modules for CPU tests of the ``cuda`` backend's
wiring.

Each fake checks its call against the real kernel's signature (mamba_ssm 2.2.x, causal_conv1d 1.4.x)
and computes the answer with ssmkit's reference, so a mis-wired argument changes the result. The
fixture ``fake_kernels`` (tests/conftest.py) installs them and records every call.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn.functional as F

from ssmkit import ops
from ssmkit.ops import backend

S6 = sys.modules["ssmkit.ops.s6"]
SSD = sys.modules["ssmkit.ops.ssd"]
CONV = sys.modules["ssmkit.ops.conv"]
NORM = sys.modules["ssmkit.ops.norm"]
MAMBA3 = sys.modules["ssmkit.ops.mamba3"]


# The kernels' signatures as the packages define them (mamba_ssm 2.2.x, causal_conv1d 1.4.x).
def selective_scan_fn(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
):
    return ops.selective_scan_reference(
        u,
        delta,
        A,
        B,
        C,
        D=D,
        z=z,
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        return_final_state=return_last_state,
    )


def selective_state_update(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None
):
    # the kernel's own checks: one token (x (batch, dim) or (batch, nheads, dim), as the state),
    # and its tie_hdim test, which reads dt_bias.stride(-1) when A and dt are broadcast, None or not
    assert x.dim() == state.dim() - 1, f"one token only: state {state.shape}, x {x.shape}"
    A3, dt3 = (A if A.dim() == 3 else A[None]), (dt if dt.dim() == 3 else dt[:, None])
    _ = (
        A3.stride(-1) == 0
        and A3.stride(-2) == 0
        and dt3.stride(-1) == 0
        and dt_bias.stride(-1) == 0
    )
    return ops.selective_state_update(
        state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, backend="torch"
    )


def mamba_chunk_scan_combined(
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
    return ops.ssd_reference(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=D,
        z=z,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        initial_states=initial_states,
        return_final_states=return_final_states,
        dt_limit=dt_limit,
    )


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    _kernel_activation(activation)
    if seq_idx is not None:  # the kernel's conditions for seq_idx (csrc/causal_conv1d.cpp)
        assert x.stride(1) == 1 and x.stride(2) > 1, "seq_idx needs channels-last x"
        assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
        assert initial_states is None and not return_final_states, "not with seq_idx"
    return ops.causal_conv1d_reference(x, weight, bias, activation, seq_idx=seq_idx)


def causal_conv1d_update(
    x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None
):
    _kernel_activation(activation)
    # the kernel's TORCH_CHECKs (csrc/causal_conv1d.cpp): width 2..4, the state in x's dtype, int32
    # (batch,) cache_seqlens / conv_state_indices; x (batch, dim) or (batch, dim, seqlen)
    assert 2 <= weight.shape[1] <= 4 and conv_state.dtype == x.dtype and x.dim() in (2, 3)
    for t in (cache_seqlens, conv_state_indices):
        assert t is None or (
            t.dtype == torch.int32 and t.is_contiguous() and t.shape == x.shape[:1]
        )
    return ops.causal_conv1d_update(
        x,
        conv_state,
        weight,
        bias,
        activation,
        backend="reference",
        cache_seqlens=cache_seqlens,
        conv_state_indices=conv_state_indices,
    )


def _kernel_activation(activation):
    """causal_conv1d's own check: its kernels apply SiLU or nothing."""
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")


def rms_norm_fn(
    x,
    weight,
    bias,
    residual=None,
    x1=None,
    weight1=None,
    bias1=None,
    eps=1e-6,
    dropout_p=0.0,
    rowscale=None,
    prenorm=False,
    residual_in_fp32=False,
    return_dropout_mask=False,
):
    assert bias is None
    return ops.rms_norm(x, weight, eps=eps, backend="reference")


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    assert bias is None
    return ops.rms_norm_gated(
        x,
        weight,
        z,
        eps=eps,
        group_size=group_size,
        norm_before_gate=norm_before_gate,
        backend="reference",
    )


# Mamba-3's kernels (mamba_ssm's source tree after 2.3.2.post1): the signatures of
# ops/triton/mamba3/ mamba3_siso_combined.py, ops/tilelang/mamba3/mamba3_mimo.py and
# ops/cute/mamba3/mamba3_step_fn.py. Their conventions differ from ssmkit's: time after heads in
# ADT = A·Δ, DT, Trap (batch, nheads, seqlen); SISO's K state without the rank axis; the step takes
# B and C already biased and rotated, and λ after its sigmoid.
def _time_last(ADT, DT, Trap):
    """The kernels' (batch, nheads, seqlen) ADT, DT, Trap as ssmkit's dt, A, trap (batch, seqlen,
    nheads)."""
    return DT.transpose(1, 2), (ADT / DT).transpose(1, 2), Trap.transpose(1, 2)


def mamba3_siso_combined(
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
    start = (
        None
        if Input_States is None
        else (*Input_States[:2], Input_States[2][:, None], Input_States[3])
    )
    out = ops.mamba3_reference(
        V,
        *_time_last(ADT, DT, Trap),
        K[:, :, None],
        Q[:, :, None],
        Angles,
        K_bias[:, None],
        Q_bias[:, None],
        D=D,
        z=Z,
        initial_states=start,
        return_final_states=return_final_states,
    )
    if not return_final_states:
        return out
    y, (angle, ssm, k, v) = out
    return y, angle, ssm, k[:, 0], v


def mamba3_mimo(
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
    assert Angles.shape[-1] * rotary_dim_divisor == Q.shape[-1] and dtype == V.dtype
    out = ops.mamba3_reference(
        V,
        *_time_last(ADT, DT, Trap),
        K,
        Q,
        Angles,
        K_bias,
        Q_bias,
        D=D,
        z=Z,
        mimo_x=MIMO_V,
        mimo_z=MIMO_Z,
        mimo_o=MIMO_Out,
        return_final_states=return_state,
    )
    return (out[0], *out[1]) if return_state else out


def mamba3_step_fn(
    state,
    Bstate,
    Xstate,
    A,
    B,
    C,
    D,
    x,
    dt,
    trap,
    xproj,
    outproj=None,
    state_out=None,
    out=None,
    z=None,
    zproj=None,
    tile_D=64,
    num_warps=2,
):
    """The kernel's documented update (its selective_state_update_fused_ref_v2), in place."""
    assert x.dim() == 3 and dt.dim() == 2, f"one token only: x {x.shape} (B, H, D), dt {dt.shape}"
    alpha = torch.exp(A * dt)
    beta, gamma = (1 - trap) * dt * alpha, trap * dt
    xr, xr_prev = x[:, None] * xproj, Xstate[:, None] * xproj  # (b, r, h, p)
    new = (
        alpha[..., None, None] * state
        + torch.einsum("brhp,brhn->bhpn", xr * gamma[:, None, :, None], B)
        + torch.einsum("brhp,brhn->bhpn", xr_prev * beta[:, None, :, None], Bstate)
    )
    y = torch.einsum("bhpn,brhn->brhp", new, C) + xr * D[:, None]
    if z is not None:
        y = y * F.silu(z[:, None] * zproj)
    (state if state_out is None else state_out).copy_(new)
    out.copy_(y if outproj is None else (y * outproj).sum(1))


FAKES = {
    "mamba_ssm.ops.selective_scan_interface": {"selective_scan_fn": selective_scan_fn},
    "mamba_ssm.ops.triton.selective_state_update": {
        "selective_state_update": selective_state_update
    },
    "mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": mamba_chunk_scan_combined},
    "causal_conv1d": {
        "causal_conv1d_fn": causal_conv1d_fn,
        "causal_conv1d_update": causal_conv1d_update,
    },
    "mamba_ssm.ops.triton.layer_norm": {"rms_norm_fn": rms_norm_fn},
    "mamba_ssm.ops.triton.layernorm_gated": {"rmsnorm_fn": rmsnorm_fn},
    "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined": {
        "mamba3_siso_combined": mamba3_siso_combined
    },
    "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo": {"mamba3_mimo": mamba3_mimo},
    "mamba_ssm.ops.cute.mamba3.mamba3_step_fn": {"mamba3_step_fn": mamba3_step_fn},
}


def install_fake_kernels(monkeypatch):
    """Install the fake modules; record every call with its arguments bound to the real
    signature."""
    calls = []
    for module, fns in FAKES.items():
        fake = types.ModuleType(module)
        for name, fn in fns.items():

            def spy(*args, _fn=fn, _name=name, **kwargs):
                bound = inspect.signature(_fn).bind(*args, **kwargs)  # TypeError if mis-called
                calls.append((_name, bound.arguments))
                return _fn(*args, **kwargs)

            setattr(fake, name, spy)
        monkeypatch.setitem(sys.modules, module, fake)
    assert set(FAKES) == set(backend.KERNEL_MODULES.values())
    return calls
