r"""The Mamba-1 selective scan (S6), "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces" (Gu & Dao, 2023), Algorithm 2 and equations (2a), (2b), (4).

Glossary (code name -> paper symbol):

    u      x        the input sequence, one scalar channel per d in D = d_inner
    delta  Δ        the input-dependent step size, Δ = softplus(Δ_raw + delta_bias)
    A      A        the (diagonal) state matrix, one row of N = d_state values per channel, A < 0
    B, C   B, C     input-dependent input / output projections of the state, N values per step
    D      D        the skip connection y += D * u
    z      z        the gate branch, y *= silu(z)
    h      h        the hidden state, (batch, D, N) per time step

Discretisation as in the official code: Ā = exp(Δ A) (zero-order hold, eq. 4) and
B̄ = Δ B (the simplification of section 3.5 / appendix C). The recurrence (eq. 2a, 2b):

$$ h_t = \bar A_t \odot h_{t-1} + \bar B_t\, x_t, \qquad y_t = C_t^\top h_t $$

Shapes follow mamba_ssm's ``selective_scan_fn``: ``u, delta, z: (batch, dim, seqlen)``,
``A: (dim, dstate)``, ``B, C: (batch, dstate, seqlen)`` or grouped ``(batch, ngroups, dstate,
seqlen)`` where channel d uses group ``d // (dim // ngroups)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend as _backend


def _check(u, delta, A, B, C, initial_state):
    if u.dim() != 3 or delta.shape != u.shape:
        raise ValueError(f"u and delta must both be (batch, dim, seqlen); got u {tuple(u.shape)}, delta {tuple(delta.shape)}")
    batch, dim, seqlen = u.shape
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must be (dim={dim}, dstate); got {tuple(A.shape)}")
    dstate = A.shape[1]
    for name, M in (("B", B), ("C", C)):
        ok3 = M.dim() == 3 and tuple(M.shape) == (batch, dstate, seqlen)
        ok4 = M.dim() == 4 and M.shape[0] == batch and M.shape[2:] == (dstate, seqlen) and dim % M.shape[1] == 0
        if not (ok3 or ok4):
            raise ValueError(
                f"{name} must be (batch={batch}, dstate={dstate}, seqlen={seqlen}) or "
                f"(batch, ngroups, dstate, seqlen) with ngroups dividing dim={dim}; got {tuple(M.shape)}"
            )
    if initial_state is not None and tuple(initial_state.shape) != (batch, dim, dstate):
        raise ValueError(f"initial_state must be (batch={batch}, dim={dim}, dstate={dstate}); got {tuple(initial_state.shape)}")


def _grouped(M: torch.Tensor) -> torch.Tensor:
    """(batch, dstate, seqlen) -> (batch, 1, dstate, seqlen); grouped input unchanged."""
    return M.unsqueeze(1) if M.dim() == 3 else M


def _discretize_delta(delta, delta_bias, delta_softplus):
    delta = delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)  # threshold 20, as the CUDA kernel
    return delta


def _skip_and_gate(y, u, D, z):
    if D is not None:
        y = y + u.float() * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y


# --------------------------------------------------------------------------------------------
# reference: Algorithm 2, one time step at a time, with autograd
# --------------------------------------------------------------------------------------------


def selective_scan_reference(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             initial_state=None, return_final_state=False):
    """The literal recurrence (Algorithm 2). Slow; the oracle for the other backends.

    Returns ``y: (batch, dim, seqlen)`` in u's dtype, and ``h_L: (batch, dim, dstate)`` (fp32)
    when ``return_final_state``.
    """
    _check(u, delta, A, B, C, initial_state)
    batch, dim, seqlen = u.shape
    delta = _discretize_delta(delta, delta_bias, delta_softplus)
    Bg, Cg = _grouped(B).float(), _grouped(C).float()
    heads_per_group = dim // Bg.shape[1]
    # give every channel its group's B_t and C_t: (batch, dim, dstate, seqlen)
    Bd = Bg.repeat_interleave(heads_per_group, dim=1)
    Cd = Cg.repeat_interleave(heads_per_group, dim=1)
    A, x = A.float(), u.float()
    h = x.new_zeros(batch, dim, A.shape[1]) if initial_state is None else initial_state.float()
    ys = []
    for t in range(seqlen):
        dA = torch.exp(delta[:, :, t, None] * A)                   # Ā_t = exp(Δ_t A)      (ZOH)
        dB = delta[:, :, t, None] * Bd[:, :, :, t]                 # B̄_t = Δ_t B_t
        h = dA * h + dB * x[:, :, t, None]                         # h_t = Ā_t h_{t-1} + B̄_t x_t
        ys.append((h * Cd[:, :, :, t]).sum(-1))                    # y_t = C_t^T h_t
    y = _skip_and_gate(torch.stack(ys, dim=-1), u, D, z).to(u.dtype)
    return (y, h) if return_final_state else y


# --------------------------------------------------------------------------------------------
# torch: the same recurrence as a custom autograd.Function
# --------------------------------------------------------------------------------------------
#
# Forward and backward loop over time with no autograd graph; everything that does not need the
# loop (Ā, B̄x, y = C h, and all gradients but dh) is computed for a whole chunk of time steps at
# once. Only the chunk-boundary states are kept; backward recomputes the states of one chunk at
# a time, so memory is O(batch * dim * dstate * (seqlen / T + T)), not O(... * seqlen).
#
# Internal layout is time-major, (seqlen, batch, ...), so one time step is one contiguous slice.

_CHUNK_ELEMENTS = 1 << 19  # aim for T * batch * dim * dstate ~ 512K floats (2 MiB) per chunk


def _chunk_len(batch, dim, dstate):
    return max(1, min(64, _CHUNK_ELEMENTS // max(1, batch * dim * dstate)))


def _chunk_inputs(delta, u, A, B, s, e):
    """Ā and B̄x for time steps s..e-1: both (T, batch, dim, dstate)."""
    T, batch, dim = delta[s:e].shape
    groups, dstate = B.shape[2], B.shape[3]
    dA = torch.exp(delta[s:e, :, :, None] * A)
    du = delta[s:e] * u[s:e]
    dBu = (du.view(T, batch, groups, dim // groups, 1) * B[s:e, :, :, None, :]).view(T, batch, dim, dstate)
    return dA, du, dBu


def _run_states(dA, dBu, h, out):
    """out[t] = dA[t] * h_{t-1} + dBu[t], starting from h; returns the last state."""
    for t in range(dA.shape[0]):
        h = torch.addcmul(dBu[t], dA[t], h, out=out[t])
    return h


def _contract_C(H, C):
    """y_t = C_t^T h_t for a chunk: H (T, batch, dim, dstate), C (T, batch, groups, dstate) -> (T, batch, dim)."""
    T, batch, dim, dstate = H.shape
    groups = C.shape[2]
    Hg = H.view(T, batch, groups, dim // groups, dstate)
    return (Hg * C[:, :, :, None, :]).sum(-1).view(T, batch, dim)


class SelectiveScanFn(torch.autograd.Function):
    """Core of the torch backend: (delta, u, A, B, C, h0) -> (y = C h, h_L), all fp32.

    delta, u: (L, batch, dim); A: (dim, dstate); B, C: (L, batch, groups, dstate);
    h0: (batch, dim, dstate). Returns y: (L, batch, dim) and h_L: (batch, dim, dstate).
    """

    @staticmethod
    def forward(ctx, delta, u, A, B, C, h0):
        L, batch, dim = u.shape
        dstate = A.shape[1]
        T = _chunk_len(batch, dim, dstate)
        y = u.new_empty(L, batch, dim)
        H = u.new_empty(min(T, L), batch, dim, dstate)
        starts = []  # the state entering each chunk
        h = h0
        for s in range(0, L, T):
            e = min(L, s + T)
            starts.append(h)
            dA, _, dBu = _chunk_inputs(delta, u, A, B, s, e)
            h = _run_states(dA, dBu, h, H[: e - s]).clone()
            y[s:e] = _contract_C(H[: e - s], C[s:e])
        ctx.save_for_backward(delta, u, A, B, C, *starts)
        ctx.T = T
        return y, h

    @staticmethod
    def backward(ctx, dy, dh_last):
        delta, u, A, B, C, *starts = ctx.saved_tensors
        T = ctx.T
        L, batch, dim = u.shape
        groups, dstate = B.shape[2], B.shape[3]
        dy = dy.contiguous() if dy is not None else torch.zeros_like(u)
        carry = dh_last.clone() if dh_last is not None else u.new_zeros(batch, dim, dstate)
        ddelta, du_out = torch.empty_like(delta), torch.empty_like(u)
        dB, dC, dA_param = torch.empty_like(B), torch.empty_like(C), torch.zeros_like(A)
        H = u.new_empty(min(T, L) + 1, batch, dim, dstate)
        for ci in reversed(range(len(starts))):
            s = ci * T
            e = min(L, s + T)
            n = e - s
            dA, du, dBu = _chunk_inputs(delta, u, A, B, s, e)
            H[0] = starts[ci]
            _run_states(dA, dBu, starts[ci], H[1 : n + 1])    # recompute h_{s..e-1}
            Hprev, Hc = H[:n], H[1 : n + 1]
            # dL/dh_t = C_t dy_t + Ā_{t+1} dL/dh_{t+1}  (the only sequential part)
            g = lambda M: M.view(n, batch, groups, dim // groups, -1)  # noqa: E731  channels by group
            dH = (g(dy[s:e]) * C[s:e, :, :, None, :]).view(n, batch, dim, dstate)
            dH[n - 1] += carry
            for t in range(n - 2, -1, -1):
                torch.addcmul(dH[t], dA[t + 1], dH[t + 1], out=dH[t])
            carry = dA[0] * dH[0]                                     # dL/dh_{s-1}
            # everything else is parallel over the chunk
            ddA = dH * Hprev * dA                                     # dL/d(Δ A), elementwise
            dBx = (g(dH) * B[s:e, :, :, None, :]).sum(-1).view(n, batch, dim)   # dL/d(Δ x)
            dB[s:e] = (g(dH) * g(du)).sum(3)
            dC[s:e] = (g(Hc) * g(dy[s:e])).sum(3)
            ddelta[s:e] = (ddA * A).sum(-1) + dBx * u[s:e]
            du_out[s:e] = dBx * delta[s:e]
            dA_param += (ddA * delta[s:e, :, :, None]).sum((0, 1))
        return ddelta, du_out, dA_param, dB, dC, carry


def selective_scan_torch(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                         initial_state=None, return_final_state=False):
    """Fast pure-PyTorch selective scan; same arguments and results as the reference."""
    _check(u, delta, A, B, C, initial_state)
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    delta_f = _discretize_delta(delta, delta_bias, delta_softplus)
    to_time_major = lambda M: _grouped(M).float().permute(3, 0, 1, 2).contiguous()  # noqa: E731
    h0 = u.new_zeros(batch, dim, dstate, dtype=torch.float32) if initial_state is None else initial_state.float()
    y, h = SelectiveScanFn.apply(
        delta_f.permute(2, 0, 1).contiguous(), u.float().permute(2, 0, 1).contiguous(), A.float().contiguous(),
        to_time_major(B), to_time_major(C), h0.contiguous(),
    )
    y = _skip_and_gate(y.permute(1, 2, 0).contiguous(), u, D, z).to(u.dtype)
    return (y, h) if return_final_state else y


# --------------------------------------------------------------------------------------------
# cuda: mamba_ssm's fused kernel
# --------------------------------------------------------------------------------------------


def selective_scan_cuda(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                        initial_state=None, return_final_state=False):
    """mamba_ssm's ``selective_scan_fn`` (no initial state support there)."""
    if initial_state is not None:
        raise _backend.BackendError("the cuda selective_scan kernel has no initial_state; use backend 'torch'")
    fn = _backend.kernel_module("selective_scan").selective_scan_fn
    out = fn(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
             return_last_state=return_final_state)
    if return_final_state:
        y, h = out
        return y, h.float()
    return out


_IMPLS = {"reference": selective_scan_reference, "torch": selective_scan_torch, "cuda": selective_scan_cuda}


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, return_final_state=False, backend=None):
    """The Mamba-1 selective scan (Algorithm 2), dispatched to a backend.

    Args:
        u, delta: (batch, dim, seqlen); A: (dim, dstate), negative;
        B, C: (batch, dstate, seqlen) or (batch, ngroups, dstate, seqlen);
        D: (dim,) or None; z: (batch, dim, seqlen) or None; delta_bias: (dim,) or None;
        initial_state: (batch, dim, dstate) or None.
    Returns:
        y: (batch, dim, seqlen) in u's dtype; with ``return_final_state`` also
        h_L: (batch, dim, dstate) in fp32.
    """
    name = _backend.select("selective_scan", u, backend=backend)
    if name == "cuda" and initial_state is not None and (backend or _backend.forced_backend()) != "cuda":
        name = "torch"  # the kernel cannot start from a state; the torch path can
    return _IMPLS[name](u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                        initial_state=initial_state, return_final_state=return_final_state)


# --------------------------------------------------------------------------------------------
# one step, for recurrent generation
# --------------------------------------------------------------------------------------------


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, backend=None):
    """One step of the recurrence, updating ``state`` in place (generation, O(1) per token).

    Mamba-1 shapes: state (batch, dim, dstate); x, dt, z (batch, dim); A (dim, dstate);
    B, C (batch, dstate) or (batch, ngroups, dstate); D, dt_bias (dim,).
    Mamba-2 shapes: state (batch, nheads, headdim, dstate); x, dt, z (batch, nheads, headdim);
    A (nheads, headdim, dstate); B, C (batch, ngroups, dstate); D, dt_bias (nheads, headdim).
    Returns y shaped like x.
    """
    name = _backend.select("selective_state_update", state, backend=backend)
    if name == "cuda":
        fn = _backend.kernel_module("selective_state_update").selective_state_update
        return fn(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
    heads = state.dim() == 4
    if not heads:  # view Mamba-1 as one "head" per channel group layout: (batch, 1, dim, dstate)
        state4, x, dt, A = state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0)
        z = z.unsqueeze(1) if z is not None else None
        D = D.unsqueeze(0) if D is not None else None
        dt_bias = dt_bias.unsqueeze(0) if dt_bias is not None else None
    else:
        state4 = state
    batch, nheads, hdim, dstate = state4.shape
    Bg = B if B.dim() == 3 else B.unsqueeze(1)
    Cg = C if C.dim() == 3 else C.unsqueeze(1)
    if heads:   # heads share their group's B, C
        Bh = Bg.float().repeat_interleave(nheads // Bg.shape[1], dim=1)[:, :, None, :]
        Ch = Cg.float().repeat_interleave(nheads // Cg.shape[1], dim=1)[:, :, None, :]
    else:       # channels share their group's B, C
        Bh = Bg.float().repeat_interleave(hdim // Bg.shape[1], dim=1)[:, None, :, :]
        Ch = Cg.float().repeat_interleave(hdim // Cg.shape[1], dim=1)[:, None, :, :]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    xf = x.float()
    h = torch.exp(dt[..., None] * A.float()) * state4.float() + (dt * xf)[..., None] * Bh
    state4.copy_(h.to(state4.dtype))
    y = (h * Ch).sum(-1)
    if D is not None:
        y = y + xf * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return y if heads else y.squeeze(1)
