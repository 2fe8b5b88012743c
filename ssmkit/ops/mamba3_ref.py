r"""Mamba-3, "Improved Sequence Modeling using State Space Principles" (Lahoti, Li, Chen, Wang,
Bick, Kolter, Dao & Gu, 2026; arXiv 2603.15569): the recurrence, one step at a time, written to be
read.

Glossary (code name, paper symbol, [mamba_ssm's kernel name], meaning):

    x       x_t   [V]         input, (batch, seqlen, nheads, headdim): P = headdim channels per head
    dt      Δ_t   [DT]        step size per head and time, already positive (the mixer applies the
                              softplus)
    A       A_t   [ADT = A·Δ] data-dependent decay per head and time, A_t <= -A_floor < 0 (Mamba-2
                              has one A per head; Mamba-3's is computed from the input, like Δ)
    trap    λ_t   [Trap]      the trapezoid's weight, given before the sigmoid: λ = sigmoid(trap)
    B, C    B, C  [K, Q]      (batch, seqlen, rank, ngroups, dstate): head h reads group
                              h // (nheads/ngroups)
    B_bias  b_B   [K_bias]    (nheads, rank, dstate), added per head before the rotation (init 1)
    angles  θ̇_t   [Angles]    (batch, seqlen, nheads, nangles): rotation speeds; the angle advances
                              by π·tanh(angles)·Δ per step and is kept modulo 2π
    mimo_x  -     [MIMO_V]    (nheads, rank, headdim): MIMO's up-projection of x to ``rank`` inputs
    mimo_z  -     [MIMO_Z]    the same for the gate
    mimo_o  -     [MIMO_Out]  the same for the down-projection of the rank outputs
    h       h_t               state per head, (batch, nheads, headdim, dstate), fp32

The state update (exponential-trapezoidal rule): with α_t = exp(Δ_t A_t),

$$ h_t = \alpha_t h_{t-1} + (1-\lambda_t)\,\Delta_t\,\alpha_t\, x_{t-1} k_{t-1}^\top
        + \lambda_t\,\Delta_t\, x_t k_t^\top, \qquad y_t = h_t\, q_t + D\, x_t $$

with k_t = R(θ_t)(B_t + b_B), q_t = R(θ_t)(C_t + b_C): the "complex-valued" state is real pairs of
state dimensions rotated by the angle θ_t = θ_{t-1} + π tanh(θ̇_t) Δ_t (a data-dependent rotary
embedding). λ = 1 is Mamba-2's exponential-Euler step; λ = 1/2 the trapezoid rule. SISO (rank 1)
rotates adjacent pairs (2i, 2i+1); MIMO pairs i with i + N/2 (mamba_ssm's TileLang kernel): a
checkpoint only loads right with its own pairing. MIMO replaces the outer products by sums over
``rank`` of them (x_{t,r} = x_t ⊙ mimo_x[r]) and reads ``rank`` outputs, gated by silu(z ⊙
mimo_z[r]) and summed with weights mimo_o[r].

The state to continue a sequence is the 4-tuple (angle, ssm, k, v): θ (batch, nheads, nangles), h,
the last rotated k (batch, rank, nheads, dstate) and the last input x (batch, nheads, headdim): the
trapezoid needs the previous input. Shapes follow mamba_ssm's ``mamba3_siso_combined`` /
``mamba3_mimo`` but for the time axis, which comes second everywhere here (dt, A, trap: (batch,
seqlen, nheads), as in ``ssd_scan``).

Packed samples (``seq_idx`` (batch, seqlen), :mod:`ssmkit.ops.packing`): where a new sample starts,
the whole state (angle, ssm, k, v) is zeroed before the step, so the sample's first step sees no
memory, no previous input for the trapezoid and an angle starting from 0, as if it ran alone
(mamba_ssm's kernels do the same for each sequence of their varlen ``cu_seqlens`` form).
``initial_states`` reach sample 0 only. ``initial_sample_states`` instead start every sample from
its own (angle, ssm, k, v), each with leading dimension n_samples (numbered as
:func:`ssmkit.ops.packing.sample_numbers`), and ``return_sample_states`` returns every sample's
last (angle, ssm, k, v): what each sample gives run alone with that ``initial_states``, or stepped
with ``mamba3_step`` from it (the previous input and angle of its state enter its first step).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import sample_states as _samples
from .packing import check_sample_states, check_seq_idx, positions_in_sample, resets, sample_numbers
from .precision import wide_dtype, widen

TWO_PI = 2 * math.pi
A_ACTIVATIONS = ("heavy_tail", "softplus")


class Mamba3States(NamedTuple):
    angle: torch.Tensor  # θ, (batch, nheads, nangles), fp32, in [0, 2π)
    ssm: torch.Tensor  # h, (batch, nheads, headdim, dstate), fp32
    k: torch.Tensor  # the last rotated k, (batch, rank, nheads, dstate)
    v: torch.Tensor  # the last input x, (batch, nheads, headdim)


def heavy_tail(a: torch.Tensor) -> torch.Tensor:
    """f(a) = 1 + a for a >= 0, 1 / (1 - a) below: positive, continuous with its first derivative at
    0, and only slowly small for a -> -inf (softplus decays exponentially there): the default of
    mamba_ssm's current Mamba3. (Its ``clamp_min(0) + 1 / (1 - clamp_max(0))`` has the same values,
    but autograd gives it the slope 2 at exactly a = 0, both clamps passing the gradient; here the
    slope is f's, 1.)"""
    return torch.where(a >= 0, 1 + a.clamp(min=0), 1 / (1 - a.clamp(max=0)))


def a_activation(a: torch.Tensor, kind: str = "heavy_tail") -> torch.Tensor:
    """The positive magnitude of A_t = -f(a_t): ``"heavy_tail"`` (mamba_ssm's current Mamba3) or
    ``"softplus"`` (its earlier versions, and PyPI's mamba-ssm 2.3.2). The same weights give
    different models under the two."""
    if kind == "heavy_tail":
        return heavy_tail(a)
    if kind == "softplus":
        return F.softplus(a)
    raise ValueError(f"a_activation={kind!r} is not valid; valid: {', '.join(A_ACTIVATIONS)}")


def rope_angles(d_state: int, rope_fraction: float) -> int:
    """How many angles (rotated pairs) a state of ``d_state`` has: mamba_ssm's ``num_rope_angles``,
    the largest even count of dimensions within ``rope_fraction`` of the state, halved."""
    size = int(d_state * rope_fraction)
    return (size - size % 2) // 2


def rotate(v: torch.Tensor, theta: torch.Tensor, pairwise: bool, cos_sin=None) -> torch.Tensor:
    """v (..., n) with S = theta.shape[-1] pairs of its dimensions rotated by theta (..., S), S <=
    n/2: ``pairwise`` pairs (2i, 2i+1), else (i, i + n/2); the other dimensions pass unchanged.
    ``cos_sin``: (cos θ, sin θ) when already computed (q and k turn by the same angles)."""
    S, n = theta.shape[-1], v.shape[-1]
    cos, sin = (theta.cos(), theta.sin()) if cos_sin is None else cos_sin
    if pairwise:
        a, b = v[..., : 2 * S].unflatten(-1, (S, 2)).unbind(-1)
        turned = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        return torch.cat((turned, v[..., 2 * S :]), dim=-1)
    half = n // 2
    a, b = v[..., :S], v[..., half : half + S]
    return torch.cat(
        (a * cos - b * sin, v[..., S:half], a * sin + b * cos, v[..., half + S :]), dim=-1
    )


def angle_increments(angles: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """π tanh(θ̇_t) Δ_t: how far each angle turns at step t. angles (..., nheads, S), dt (...,
    nheads)."""
    return torch.tanh(widen(angles)) * math.pi * widen(dt)[..., None]


def heads(M: torch.Tensor, nheads: int, bias: torch.Tensor) -> torch.Tensor:
    """(..., rank, ngroups, dstate) -> (..., rank, nheads, dstate) in fp32: each head reads its
    group's vector, plus its own bias (nheads, rank, dstate)."""
    M = widen(M).repeat_interleave(nheads // M.shape[-2], dim=-2)
    return M + widen(bias).transpose(0, 1)


def project(x: torch.Tensor, mimo_x: torch.Tensor | None) -> torch.Tensor:
    """x (..., nheads, headdim) -> the rank inputs (..., rank, nheads, headdim): x ⊙ mimo_x[r]
    (SISO: x)."""
    x = widen(x)[..., None, :, :]
    return x if mimo_x is None else x * widen(mimo_x).transpose(0, 1)


def finish(y, v, D, z, mimo_z, mimo_o, siso: bool):
    """The rank outputs y (..., rank, nheads, headdim) -> the output: + D ⊙ x_r (v: the rank
    inputs), gated by silu(z ⊙ mimo_z[r]) when z is given, then the single output taken (SISO) or
    the rank outputs summed with weights mimo_o[r] (MIMO; without mimo_o they are returned as they
    are, (..., rank, nheads, headdim))."""
    if D is not None:
        y = y + v * widen(D)[:, None]
    if z is not None:
        zr = widen(z)[..., None, :, :]
        y = y * F.silu(zr if mimo_z is None else zr * widen(mimo_z).transpose(0, 1))
    if siso:
        return y.squeeze(-3)
    return y if mimo_o is None else (y * widen(mimo_o).transpose(0, 1)).sum(dim=-3)


def check(x, dt, A, trap, B, C, angles, B_bias, C_bias, mimo_x, initial_states, seq_idx=None):
    """Every shape against x's (batch, seqlen, nheads, headdim) and B's rank, groups and dstate."""
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seqlen, nheads, headdim); got {tuple(x.shape)}")
    b, L, h, p = x.shape
    if B.dim() != 5 or B.shape[:2] != (b, L) or C.shape != B.shape or h % B.shape[3]:
        raise ValueError(
            f"B and C must be (batch={b}, seqlen={L}, rank, ngroups, dstate) with ngroups "
            f"dividing nheads={h}; got B {tuple(B.shape)}, C {tuple(C.shape)}"
        )
    r, n = B.shape[2], B.shape[4]
    for name, t in (("dt", dt), ("A", A), ("trap", trap)):
        if tuple(t.shape) != (b, L, h):
            raise ValueError(
                f"{name} must be (batch={b}, seqlen={L}, nheads={h}); got {tuple(t.shape)}"
            )
    if angles.dim() != 4 or angles.shape[:3] != (b, L, h) or not 0 < angles.shape[3] <= n // 2:
        raise ValueError(
            f"angles must be (batch={b}, seqlen={L}, nheads={h}, nangles) with 0 < nangles <= "
            f"dstate/2 = {n // 2}; got {tuple(angles.shape)}"
        )
    for name, t in (("B_bias", B_bias), ("C_bias", C_bias)):
        if tuple(t.shape) != (h, r, n):
            raise ValueError(
                f"{name} must be (nheads={h}, rank={r}, dstate={n}); got {tuple(t.shape)}"
            )
    if (mimo_x is None and r != 1) or (mimo_x is not None and tuple(mimo_x.shape) != (h, r, p)):
        raise ValueError(
            f"rank {r} > 1 needs mimo_x (nheads={h}, rank={r}, headdim={p}); got "
            f"{None if mimo_x is None else tuple(mimo_x.shape)}"
        )
    if initial_states is not None:
        want = ((b, h, angles.shape[3]), (b, h, p, n), (b, r, h, n), (b, h, p))
        got = tuple(tuple(s.shape) for s in initial_states)
        if len(got) != 4 or got != want:
            raise ValueError(f"initial_states must be (angle, ssm, k, v) shaped {want}; got {got}")
    check_seq_idx(seq_idx, b, L)


def check_sample_tuple(states, n: int, x, B, angles) -> None:
    """``initial_sample_states`` must be (angle, ssm, k, v) with one state per packed sample each:
    (n, nheads, nangles), (n, nheads, headdim, dstate), (n, rank, nheads, dstate), (n, nheads,
    headdim); a ValueError names the part that is not."""
    h, p, r, dstate = x.shape[2], x.shape[3], B.shape[2], B.shape[4]
    if not isinstance(states, (tuple, list)) or len(states) != 4:
        raise ValueError(
            f"initial_sample_states must be the tuple (angle, ssm, k, v) with one state per packed "
            f"sample (n_samples={n}) in each; got {type(states).__name__}"
            + (f" of {len(states)}" if isinstance(states, (tuple, list)) else "")
        )
    shapes = ((h, angles.shape[3]), (h, p, dstate), (r, h, dstate), (h, p))
    for name, state, shape in zip(Mamba3States._fields, states, shapes):
        check_sample_states(state, n, shape, f"initial_sample_states.{name}")


def zero_states(x: torch.Tensor, rank: int, dstate: int, nangles: int) -> Mamba3States:
    """The state before the first token: no angle, no memory, no previous input (fp32)."""
    b, h, p = x.shape[0], x.shape[-2], x.shape[-1]
    new = lambda *shape: torch.zeros(shape, dtype=wide_dtype(x), device=x.device)  # noqa: E731
    return Mamba3States(
        new(b, h, nangles), new(b, h, p, dstate), new(b, rank, h, dstate), new(b, h, p)
    )


# --------------------------------------------------------------------------------------------
# one step of the recurrence (the reference loop and generation both use it)
# --------------------------------------------------------------------------------------------


def step(states: Mamba3States, x, dt, A, lam, Bh, Ch, turn, mimo_x, pairwise: bool):
    """One time step. x (b, h, p); dt, A, lam (b, h); Bh, Ch (b, r, h, n): biased, not yet rotated;
    turn (b, h, S): the angle increment. Returns (y (b, r, h, p) before D, gate and mimo_o; the rank
    inputs x_r (b, r, h, p); the next states)."""
    angle = torch.remainder(states.angle + turn, TWO_PI)  # θ_t = θ_{t-1} + π tanh(θ̇) Δ
    k = rotate(Bh, angle[:, None], pairwise)  # k_t = R(θ_t)(B_t + b_B)
    q = rotate(Ch, angle[:, None], pairwise)  # q_t = R(θ_t)(C_t + b_C)
    alpha = torch.exp(A * dt)  # α_t = exp(Δ_t A_t)
    beta = (1 - lam) * dt * alpha  # weight of x_{t-1} k_{t-1}ᵀ
    gamma = lam * dt  # weight of x_t k_tᵀ
    xr, xr_prev = project(x, mimo_x), project(states.v, mimo_x)
    h = (
        alpha[..., None, None] * states.ssm
        + beta[..., None, None] * torch.einsum("brhp,brhn->bhpn", xr_prev, states.k)
        + gamma[..., None, None] * torch.einsum("brhp,brhn->bhpn", xr, k)
    )
    y = torch.einsum("bhpn,brhn->brhp", h, q)  # y_t = h_t q_t (each rank)
    return y, xr, Mamba3States(angle, h, k, widen(x))


def mamba3_reference(
    x,
    dt,
    A,
    trap,
    B,
    C,
    angles,
    B_bias,
    C_bias,
    D=None,
    z=None,
    mimo_x=None,
    mimo_z=None,
    mimo_o=None,
    chunk_size=None,
    initial_states=None,
    return_final_states=False,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """The recurrence, one time step at a time (``chunk_size`` is ignored). Shapes: see the module
    docstring; returns y (batch, seqlen, nheads, headdim) in x's dtype ((batch, seqlen, rank,
    nheads, headdim) for MIMO without mimo_o), and with ``return_final_states`` the
    :class:`Mamba3States` after the last step. ``seq_idx`` (batch, seqlen) or None: the states are
    zeroed before each packed sample's first step, or set to the sample's own with
    ``initial_sample_states``; ``return_sample_states`` returns each sample's last states."""
    check(x, dt, A, trap, B, C, angles, B_bias, C_bias, mimo_x, initial_states, seq_idx)
    per_sample = _samples.check_mode(
        seq_idx, initial_states, initial_sample_states, return_sample_states, return_final_states
    )
    h, r, n = x.shape[2], B.shape[2], B.shape[4]
    pairwise = mimo_x is None
    dt, A, lam = widen(dt), widen(A), torch.sigmoid(widen(trap))
    Bh, Ch = heads(B, h, B_bias), heads(C, h, C_bias)
    turn = angle_increments(angles, dt)
    states = (
        zero_states(x[:, 0], r, n, angles.shape[3])
        if initial_states is None
        else Mamba3States(*(widen(s) for s in initial_states))
    )
    keep = None if seq_idx is None else (~resets(seq_idx)).float()  # 0 where a new sample starts
    if per_sample:  # every sample's own states (or zeros), set before its first step
        number = sample_numbers(seq_idx)
        n_samples = int(number[-1, -1]) + 1
        start = positions_in_sample(seq_idx) == 0
        ends = {}
        for row, t in F.pad(start[:, 1:], (0, 1), value=True).nonzero().tolist():
            ends.setdefault(t, []).append(row)
        if initial_sample_states is None:
            init = Mamba3States(*(s.new_zeros(n_samples, *s.shape[1:]) for s in states))
        else:
            check_sample_tuple(initial_sample_states, n_samples, x, B, angles)
            init = Mamba3States(*(widen(s) for s in initial_sample_states))
        finals = [None] * n_samples
    ys = []
    for t in range(x.shape[1]):
        if per_sample:
            first = start[:, t]
            states = Mamba3States(
                *(
                    torch.where(first.view(-1, *[1] * (s.dim() - 1)), s0[number[:, t]], s)
                    for s, s0 in zip(states, init)
                )
            )
        elif keep is not None:  # a new sample: no angle, no memory, no previous input
            states = Mamba3States(*(s * keep[:, t].view(-1, *[1] * (s.dim() - 1)) for s in states))
        y, xr, states = step(
            states,
            x[:, t],
            dt[:, t],
            A[:, t],
            lam[:, t],
            Bh[:, t],
            Ch[:, t],
            turn[:, t],
            mimo_x,
            pairwise,
        )
        ys.append(finish(y, xr, D, None if z is None else z[:, t], mimo_z, mimo_o, siso=pairwise))
        if per_sample:
            for row in ends.get(t, ()):
                finals[int(number[row, t])] = [s[row] for s in states]
    y = torch.stack(ys, dim=1).to(x.dtype)
    if per_sample and (return_sample_states or return_final_states):
        every = Mamba3States(*(torch.stack(s) for s in zip(*finals)))
        if return_final_states:
            last = _samples.row_last(seq_idx)
            every = Mamba3States(*(s[last] for s in every))
        return y, every
    return (y, states) if return_final_states else y
