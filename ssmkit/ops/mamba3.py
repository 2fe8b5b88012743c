r"""Mamba-3's scan as chunks (the ``torch`` backend), its quadratic form, one-step generation and the
``cuda`` dispatch to mamba_ssm's kernels. The recurrence itself, the glossary and the shapes are in
:mod:`ssmkit.ops.mamba3_ref`.

Unrolling the recurrence, input s reaches the state at t >= s with weight

$$ h_t = \sum_{s \le t} \Big(\prod_{j=s+1}^{t} \alpha_j\Big)\, w_{ts}\; x_s k_s^\top, \qquad
   w_{ts} = \begin{cases} \lambda_t \Delta_t & s = t \\
                          \lambda_s \Delta_s + (1-\lambda_{s+1}) \Delta_{s+1} & s < t \end{cases} $$

(the previous-input term of step s+1 is input s again, one step late). So y = (L ∘ W ∘ q kᵀ) x: Mamba-2's
masked "attention" form, with a mask L ∘ W whose diagonal differs, on the rotated queries q (from C) and
keys k (from B) of each head. :func:`mamba3_chunked` evaluates it by chunks of Q steps as the SSD does
(quadratic inside a chunk, the state passed between chunks); :func:`mamba3_quadratic` is one chunk of the
whole sequence. MIMO adds a rank axis: the (t, s) block is a rank x rank matrix of q_{t,r}·k_{s,r'} under the
same weight, computed as a time axis (t r) of ``rank`` times the length, as mamba_ssm's kernels do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from . import backend as _backend
from .mamba3_ref import (
    TWO_PI,
    Mamba3States,
    angle_increments,
    check,
    finish,
    heads,
    mamba3_reference,
    project,
    rotate,
    step,
)

LOG2_E = 1.0 / math.log(2.0)

# The torch backend's chunk on CPUs, in positions x rank (the result does not depend on it, only the cost:
# per token the diagonal blocks cost ~Q·rank·(N + P) multiply-adds, the states passed between chunks
# ~2·P·N·rank; as for the SSD, 64 is where the per-chunk overhead stops paying). GPUs keep the model's.
CPU_CHUNK_SIZE = 64


def _angles(angles, dt, start, Q):
    """θ at every position, (batch, L, nheads, S), and the last one: increments summed within chunks of Q
    steps, plus the angle carried from the previous chunks, everything modulo 2π (a sum over the whole
    sequence would grow to thousands of radians and lose fp32 digits)."""
    b, L, h, S = angles.shape
    pad = (-L) % Q
    turn = F.pad(angle_increments(angles, dt), (0, 0, 0, 0, 0, pad))
    local = rearrange(turn, "b (c l) h s -> b c l h s", l=Q).cumsum(dim=2)
    carry = torch.zeros(b, h, S, device=angles.device) if start is None else start.float()
    offsets = []
    for total in local[:, :, -1].unbind(1):
        offsets.append(carry)
        carry = torch.remainder(carry + total, TWO_PI)
    theta = torch.remainder(torch.stack(offsets, dim=1)[:, :, None] + local, TWO_PI)
    return rearrange(theta, "b c l h s -> b (c l) h s")[:, :L], carry


def mamba3_chunked(x, dt, A, trap, B, C, angles, B_bias, C_bias, D=None, z=None, mimo_x=None, mimo_z=None,
                   mimo_o=None, chunk_size=64, initial_states=None, return_final_states=False):
    """Mamba-3 by chunks of ``chunk_size`` steps: the weighted quadratic form inside a chunk, the recurrence
    between chunks (the SSD's algorithm with Mamba-3's weights). Arguments and results as
    :func:`~ssmkit.ops.mamba3_ref.mamba3_reference`; differentiable in everything (autograd)."""
    check(x, dt, A, trap, B, C, angles, B_bias, C_bias, mimo_x, initial_states)
    b, L, h, p = x.shape
    r = B.shape[2]
    Q = int(chunk_size)
    if Q < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size}")
    pad = (-L) % Q
    pairwise = mimo_x is None
    dt, lam = dt.float(), torch.sigmoid(trap.float())
    theta, last_angle = _angles(angles, dt, None if initial_states is None else initial_states[0], Q)
    theta = theta[:, :, None]                                            # the same angle for every rank
    cos_sin = (theta.cos(), theta.sin())
    k = rotate(heads(B, h, B_bias), theta, pairwise, cos_sin)            # (b, L, r, h, n), rotated
    q = rotate(heads(C, h, C_bias), theta, pairwise, cos_sin)
    v = project(x, mimo_x)                                               # (b, L, r, h, p)

    gamma = lam * dt                                                     # λ_t Δ_t: input t at step t
    prev = (1 - lam) * dt                                                # (1-λ_t) Δ_t: input t-1 at step t
    scale = gamma + F.pad(prev[:, 1:], (0, 0, 0, 1))                     # w_{ts}, s < t (0 after the end)
    if initial_states is None:
        h0 = x.new_zeros(b, h, p, B.shape[4], dtype=torch.float32)
    else:   # the previous call's last input enters at our first step, decayed with it
        _, ssm0, k0, v0 = initial_states
        h0 = ssm0.float() + prev[:, 0, :, None, None] * torch.einsum(
            "brhp,brhn->bhpn", project(v0, mimo_x), k0.float())

    def chunks(t):   # (b, L, r, h, d) -> (b, h, c, Q·r, d): position-major, rank-minor
        return rearrange(F.pad(t, (0, 0, 0, 0, 0, 0, 0, pad)), "b (c l) r h d -> b h c (l r) d", l=Q)

    def per_step(t):  # (b, L, h) -> (b, h, c, Q); padded steps have Δ = 0: no input, no decay
        return rearrange(F.pad(t, (0, 0, 0, pad)), "b (c l) h -> b h c l", l=Q)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    cum = per_step(A.float() * dt).cumsum(dim=-1)                        # Σ log α within the chunk
    sc, gm = per_step(scale), per_step(gamma)
    ranks = lambda t: t.repeat_interleave(r, dim=-1) if r > 1 else t     # noqa: E731 (per step -> per (l r))

    # 1. inside each chunk: y = (L ∘ W ∘ q kᵀ) x, L_ts = exp(cum_t - cum_s) (as exp2, cheaper on CPUs)
    strict = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=x.device), diagonal=-1)
    cum2 = cum * LOG2_E
    decay = torch.exp2((cum2[..., :, None] - cum2[..., None, :]).masked_fill(~strict, -math.inf))
    W = decay * sc[..., None, :] + torch.diag_embed(gm)                   # (b, h, c, Q, Q)
    if r > 1:
        W = W.repeat_interleave(r, dim=-2).repeat_interleave(r, dim=-1)
    y = ((qc @ kc.transpose(-1, -2)) * W) @ vc                           # (b, h, c, Q·r, p)

    # 2. each chunk's own final state, as if it started from zero
    to_end = torch.exp(cum[..., -1:] - cum) * sc
    states = vc.transpose(-1, -2) @ (kc * ranks(to_end)[..., None])      # (b, h, c, p, n)

    # 3. the state entering each chunk: h_c = exp(Σ log α over chunk c-1) h_{c-1} + states_{c-1}
    hc, entering = h0, []
    for decay_c, state in zip(torch.exp(cum[..., -1]).unbind(2), states.unbind(2)):
        entering.append(hc)
        hc = decay_c[..., None, None] * hc + state
    entering = torch.stack(entering, dim=2)                              # (b, h, c, p, n)

    # 4. that state, decayed to each position, read by q
    y = y + (qc * ranks(torch.exp(cum))[..., None]) @ entering.transpose(-1, -2)
    y = rearrange(y, "b h c (l r) p -> b (c l) r h p", r=r)[:, :L]
    y = finish(y, v, D, z, mimo_z, mimo_o, siso=pairwise).to(x.dtype)
    if not return_final_states:
        return y
    return y, Mamba3States(last_angle, hc, k[:, -1], x[:, -1].float())


def mamba3_quadratic(x, dt, A, trap, B, C, angles, B_bias, C_bias, chunk_size=None, **kwargs):
    """y = (L ∘ W ∘ q kᵀ) x over the whole sequence at once: one chunk, O(seqlen²) memory, the "attention"
    view. ``chunk_size`` is ignored; other arguments as :func:`mamba3_chunked`."""
    return mamba3_chunked(x, dt, A, trap, B, C, angles, B_bias, C_bias, chunk_size=max(1, x.shape[1]),
                          **kwargs)


# --------------------------------------------------------------------------------------------
# cuda: mamba_ssm's Triton (SISO) and TileLang (MIMO) kernels
# --------------------------------------------------------------------------------------------


def _heads_first(t):
    """(batch, seqlen, nheads) -> the kernels' (batch, nheads, seqlen), contiguous."""
    return t.transpose(1, 2).contiguous()


def mamba3_cuda(x, dt, A, trap, B, C, angles, B_bias, C_bias, D=None, z=None, mimo_x=None, mimo_z=None,
                mimo_o=None, chunk_size=64, initial_states=None, return_final_states=False):
    """mamba_ssm's ``mamba3_siso_combined`` (rank 1) or ``mamba3_mimo`` (which takes no initial states)."""
    dt = dt.float()
    common = dict(ADT=_heads_first(A.float() * dt), DT=_heads_first(dt), Trap=_heads_first(trap),
                  Angles=angles.float(), D=D, Z=z, chunk_size=chunk_size)      # MIMO reads fp32 angles
    if mimo_x is None:
        fn = _backend.kernel_module("mamba3_siso").mamba3_siso_combined
        start = None if initial_states is None else (initial_states[0], initial_states[1],
                                                     initial_states[2][:, 0], initial_states[3])
        out = fn(Q=C[:, :, 0], K=B[:, :, 0], V=x, Q_bias=C_bias[:, 0], K_bias=B_bias[:, 0],
                 Input_States=start, return_final_states=return_final_states, **common)
        if not return_final_states:
            return out
        y, angle, ssm, k, v = out
        return y, Mamba3States(angle, ssm, k[:, None], v)
    if initial_states is not None:
        raise _backend.BackendError("mamba_ssm's Mamba-3 MIMO kernel takes no initial states; continue a "
                                    "sequence with backend='torch' (or one step at a time)")
    n, S = B.shape[4], angles.shape[3]
    if n % S or n // S not in (2, 4):
        raise _backend.BackendError(f"mamba_ssm's MIMO kernel rotates dstate/2 or dstate/4 pairs; "
                                    f"got {S} angles for dstate {n}")
    fn = _backend.kernel_module("mamba3_mimo").mamba3_mimo
    out = fn(Q=C, K=B, V=x, Q_bias=C_bias, K_bias=B_bias, MIMO_V=mimo_x, MIMO_Z=mimo_z, MIMO_Out=mimo_o,
             rotary_dim_divisor=n // S, dtype=x.dtype, return_state=return_final_states, **common)
    if not return_final_states:
        return out
    y, angle, ssm, k, v = out
    return y, Mamba3States(angle, ssm, k, v)


_IMPLS = {"reference": mamba3_reference, "torch": mamba3_chunked, "cuda": mamba3_cuda}


def mamba3_scan(x, dt, A, trap, B, C, angles, B_bias, C_bias, D=None, z=None, mimo_x=None, mimo_z=None,
                mimo_o=None, chunk_size=64, initial_states=None, return_final_states=False, backend=None):
    """The Mamba-3 scan, dispatched to a backend (op "mamba3_siso" for rank 1, "mamba3_mimo" with mimo_x).

    Args (see :mod:`ssmkit.ops.mamba3_ref`): x (batch, seqlen, nheads, headdim); dt, A, trap (batch, seqlen,
    nheads): Δ > 0, A < 0, λ before its sigmoid; B, C (batch, seqlen, rank, ngroups, dstate); angles (batch,
    seqlen, nheads, nangles); B_bias, C_bias (nheads, rank, dstate); D (nheads,) or None; z like x or None;
    mimo_x, mimo_z, mimo_o (nheads, rank, headdim) for MIMO; initial_states: (angle, ssm, k, v) or None.
    Returns y like x in x's dtype ((batch, seqlen, rank, nheads, headdim) for MIMO without mimo_o) and, with
    ``return_final_states``, the :class:`Mamba3States` after the last step (fp32 from the torch paths).

    ``chunk_size`` is the kernels' block length; the torch backend on a CPU uses chunks of at most
    :data:`CPU_CHUNK_SIZE` positions x rank (the same sums, fewer operations).
    """
    mimo = mimo_x is not None
    name = _backend.select("mamba3_mimo" if mimo else "mamba3_siso", x, backend=backend)
    forced = backend or _backend.forced_backend()
    if name == "cuda" and mimo and initial_states is not None and forced is None:
        name = "torch"                  # the MIMO kernel cannot continue a sequence: no error unless forced
    if name == "torch" and x.device.type == "cpu":
        chunk_size = max(1, min(int(chunk_size), CPU_CHUNK_SIZE // B.shape[2]))
    return _IMPLS[name](x, dt, A, trap, B, C, angles, B_bias, C_bias, D=D, z=z, mimo_x=mimo_x, mimo_z=mimo_z,
                        mimo_o=mimo_o, chunk_size=chunk_size, initial_states=initial_states,
                        return_final_states=return_final_states)


# --------------------------------------------------------------------------------------------
# one token (generation)
# --------------------------------------------------------------------------------------------


def mamba3_step(states, x, dt, A, trap, B, C, angles, B_bias, C_bias, D=None, z=None, mimo_x=None,
                mimo_z=None, mimo_o=None, backend=None):
    """One step of the recurrence for generation, O(1) in the length so far; ``states`` (angle, ssm, k, v),
    shaped as :class:`Mamba3States`, are updated in place.

    Shapes as :func:`mamba3_scan` without the time axis: x, z (batch, nheads, headdim); dt, A, trap (batch,
    nheads); B, C (batch, rank, ngroups, dstate); angles (batch, nheads, nangles). Returns y (batch, nheads,
    headdim) in x's dtype ((batch, rank, nheads, headdim) for MIMO without mimo_o). The ``cuda`` backend runs
    mamba_ssm's ``mamba3_step_fn`` (CuTe DSL) for the state update, as its ``Mamba3.step`` does."""
    angle, ssm, k_state, v_state = states
    h = x.shape[1]
    pairwise = mimo_x is None
    dt, A, lam = dt.float(), A.float(), torch.sigmoid(trap.float())
    Bh, Ch = heads(B, h, B_bias), heads(C, h, C_bias)
    turn = angle_increments(angles, dt)
    name = _backend.select("mamba3_step", ssm, backend=backend)
    if name == "cuda":
        new_angle = torch.remainder(angle + turn, TWO_PI)
        k = rotate(Bh, new_angle[:, None], pairwise).to(k_state.dtype)
        q = rotate(Ch, new_angle[:, None], pairwise).to(k_state.dtype)
        r, p = B.shape[1], x.shape[2]
        ones = torch.ones(r, h, p, device=x.device, dtype=x.dtype)
        xproj = ones if pairwise else mimo_x.transpose(0, 1).contiguous()
        outproj = ones if pairwise else None if mimo_o is None else mimo_o.transpose(0, 1).contiguous()
        zproj = None if z is None else ones if pairwise else mimo_z.transpose(0, 1).contiguous()
        out = torch.empty((x.shape[0], h, p) if outproj is not None else (x.shape[0], r, h, p),
                          device=x.device, dtype=x.dtype)
        fn = _backend.kernel_module("mamba3_step").mamba3_step_fn
        fn(ssm, k_state, v_state, A, k, q, torch.zeros(h, device=x.device) if D is None else D, x, dt, lam,
           xproj, outproj=outproj, out=out, z=z, zproj=zproj)
        angle.copy_(new_angle)
        k_state.copy_(k)
        v_state.copy_(x)
        return out
    y, xr, new = step(Mamba3States(angle.float(), ssm.float(), k_state.float(), v_state.float()), x, dt, A,
                      lam, Bh, Ch, turn, mimo_x, pairwise)
    for old, value in zip(states, new):
        old.copy_(value)
    return finish(y, xr, D, z, mimo_z, mimo_o, siso=pairwise).to(x.dtype)
