r"""Mamba-3's scan as chunks (the ``torch`` backend), its quadratic form, one-step generation and
the ``cuda`` dispatch to mamba_ssm's kernels. The recurrence itself, the glossary and the shapes are
in :mod:`ssmkit.ops.mamba3_ref`.

Unrolling the recurrence, input s reaches the state at t >= s with weight

$$ h_t = \sum_{s \le t} \Big(\prod_{j=s+1}^{t} \alpha_j\Big)\, w_{ts}\; x_s k_s^\top, \qquad
   w_{ts} = \begin{cases} \lambda_t \Delta_t & s = t \\
                          \lambda_s \Delta_s + (1-\lambda_{s+1}) \Delta_{s+1} & s < t \end{cases} $$

(the previous-input term of step s+1 is input s again, one step late). So y = (L ∘ W ∘ q kᵀ) x:
Mamba-2's masked "attention" form, with a mask L ∘ W whose diagonal differs, on the rotated queries
q (from C) and keys k (from B) of each head. :func:`mamba3_chunked` evaluates it by chunks of Q
steps as the SSD does (quadratic inside a chunk, the state passed between chunks);
:func:`mamba3_quadratic` is one chunk of the whole sequence. MIMO adds a rank axis: the (t, s) block
is a rank x rank matrix of q_{t,r}·k_{s,r'} under the same weight, computed as a time axis (t r) of
``rank`` times the length, as mamba_ssm's kernels do.

Packed samples (``seq_idx``): every term is masked to one sample as in the SSD, the previous-input
weight (1-λ_t) Δ_t is 0 at a sample's first step and the angle restarts there; see
:mod:`ssmkit.ops.mamba3_ref`.

Per-sample states (``initial_sample_states`` / ``return_sample_states``): the scan is linear in the
memory h, and a sample's angle θ_0 turns its q and k alike, so within the sample q_t·k_s does not
depend on it. So the zero-state packed scan gives every sample's own output, and the states add
by linearity (:mod:`ssmkit.ops.sample_states`): the state entering a sample is h_0 + (1-λ_s) Δ_s
x_{-1} k_{-1}ᵀ (its previous input enters its first step, as in :func:`mamba3_step`), decayed from
the sample's first step and read by the q_t rotated from θ_0; the final memory sums the sample's
inputs with the trapezoid's weights w_{ts}, and the final angle, k and v are those of its last step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from . import backend as _backend
from . import sample_states as _samples
from .mamba3_ref import (
    TWO_PI,
    Mamba3States,
    angle_increments,
    check,
    check_sample_tuple,
    finish,
    heads,
    mamba3_reference,
    project,
    rotate,
    step,
)
from .packing import cu_seqlens, resets
from .precision import wide_dtype, widen

LOG2_E = 1.0 / math.log(2.0)

# The torch backend's chunk on CPUs, in positions x rank (the result does not depend on it, only the
# cost: per token the diagonal blocks cost ~Q·rank·(N + P) multiply-adds, the states passed between
# chunks ~2·P·N·rank; as for the SSD, 64 is where the per-chunk overhead stops paying). GPUs keep
# the model's.
CPU_CHUNK_SIZE = 64


def _angles(angles, dt, start, Q, reset=None):
    """θ at every position, (batch, L, nheads, S), and the last one: increments summed within chunks
    of Q steps, plus the angle carried from the previous chunks, everything modulo 2π (a sum over
    the whole sequence would grow to thousands of radians and lose fp32 digits). reset: (batch, L)
    bool or None, the angle restarts from 0 there (a packed sample's first step)."""
    b, L, h, S = angles.shape
    pad = (-L) % Q
    turn = F.pad(angle_increments(angles, dt), (0, 0, 0, 0, 0, pad))
    local = rearrange(turn, "b (c l) h s -> b c l h s", l=Q).cumsum(dim=2)
    carry = (
        torch.zeros(b, h, S, dtype=wide_dtype(angles), device=angles.device)
        if start is None
        else widen(start)
    )
    if reset is not None:
        return _angles_packed(
            local, carry, rearrange(F.pad(reset, (0, pad)), "b (c l) -> b c l", l=Q), L
        )
    offsets = []
    for total in local[:, :, -1].unbind(1):
        offsets.append(carry)
        carry = torch.remainder(carry + total, TWO_PI)
    theta = torch.remainder(torch.stack(offsets, dim=1)[:, :, None] + local, TWO_PI)
    return rearrange(theta, "b c l h s -> b (c l) h s")[:, :L], carry


def _angles_packed(local, carry, reset, L):
    """:func:`_angles` with restarts. local: (b, c, Q, h, S) in-chunk prefix sums of the turns;
    carry: the start angle; reset: (b, c, Q) bool. Within a chunk, a step after a restart turned by
    local - (local just before the restart); a step before any restart in its chunk adds the angle
    carried in."""
    b, c, Q, h, S = local.shape
    steps = torch.arange(Q, device=local.device).expand_as(reset)
    last = torch.where(reset, steps, -1).cummax(dim=2).values  # the last restart <= l, or -1
    before = F.pad(local, (0, 0, 0, 0, 1, 0))  # before[:, :, j] = local[:, :, j-1]
    base = before.gather(2, last.clamp(min=0)[..., None, None].expand(b, c, Q, h, S))
    fresh = (last >= 0)[..., None, None]  # (b, c, Q, 1, 1)
    since = local - base  # turned since the restart
    offsets = []
    for since_c, local_c, fresh_c in zip(
        since[:, :, -1].unbind(1), local[:, :, -1].unbind(1), fresh[:, :, -1].unbind(1)
    ):
        offsets.append(carry)
        carry = torch.remainder(torch.where(fresh_c, since_c, carry + local_c), TWO_PI)
    theta = torch.where(fresh, since, torch.stack(offsets, dim=1)[:, :, None] + local)
    return rearrange(torch.remainder(theta, TWO_PI), "b c l h s -> b (c l) h s")[:, :L], carry


def _with_sample_states(run, kw, initial_sample_states, return_sample_states, return_final_states):
    """Per-sample states by linearity around a zero-state packed scan (the module docstring):
    ``run(gated, ssm) -> (y0, the samples' final memory from zero states, angle 0 included, or
    None)`` runs the backend
    with the op's arguments ``kw`` (x ... mimo_o, chunk_size, seq_idx: :func:`_op_arguments`); with
    ``gated`` False it leaves out z and mimo_o (y0 per rank: the initial states' term is added
    before the gate). Returns what :func:`mamba3_scan` returns."""
    x, dt, A, trap, B, C, angles = (kw[k] for k in ("x", "dt", "A", "trap", "B", "C", "angles"))
    z, mimo_x, seq_idx = kw["z"], kw["mimo_x"], kw["seq_idx"]
    b, L, h, p = x.shape
    r, n_state = B.shape[2], B.shape[4]
    T, h0, pairwise = b * L, initial_sample_states, mimo_x is None
    smp = _samples.samples(seq_idx)
    if h0 is not None:
        check_sample_tuple(h0, smp.n, x, B, angles)
        h0 = Mamba3States(*(widen(s) for s in h0))
    want = return_sample_states or return_final_states
    y, ssm = run(h0 is None, want)

    dt, lam = widen(dt).reshape(T, h), torch.sigmoid(widen(trap)).reshape(T, h)
    w, u, w_end = _samples.decays(widen(A).reshape(T, h) * dt, smp, dt.dtype)
    # θ_t = θ_0 + the turns since the sample's first step (in fp64, as the decays)
    theta = _samples.since_start(angle_increments(angles.reshape(T, h, -1), dt), smp)
    if h0 is not None:
        theta = theta + h0.angle.to(theta)[smp.idx.to(theta.device)]
    theta = torch.remainder(theta, TWO_PI).to(dt)[:, None]  # (T, 1, h, S): every rank
    cos_sin = (theta.cos(), theta.sin())
    k = rotate(heads(B.reshape(T, *B.shape[2:]), h, kw["B_bias"]), theta, pairwise, cos_sin)
    prev = (1 - lam) * dt  # (T, h): the weight of the previous input at each step
    if h0 is not None:  # h_0 + (1-λ_s) Δ_s x_{-1} k_{-1}ᵀ, decayed from the first step s on
        enter = h0.ssm + prev[smp.first][..., None, None] * torch.einsum(
            "brhp,brhn->bhpn", project(h0.v, mimo_x), h0.k
        )
        q = rotate(heads(C.reshape(T, *C.shape[2:]), h, kw["C_bias"]), theta, pairwise, cos_sin)
        read = _samples.read_states(q.reshape(T * r, h, n_state), enter, smp.repeat(r))
        y = widen(y).reshape(T, r, h, p) + read.reshape(T, r, h, p) * w[:, None, :, None]
        zf = None if z is None else z.reshape(T, h, p)
        y = finish(y, None, None, zf, kw["mimo_z"], kw["mimo_o"], siso=pairwise)
        y = y.reshape(b, L, *y.shape[1:]).to(x.dtype)
    if not want:
        return y
    if ssm is None:  # Σ_s w_{e s} (α_{s+1}···α_e) x_s k_sᵀ over each sample and rank
        first = torch.zeros(T, dtype=torch.bool, device=x.device)
        first[smp.first] = True  # no previous input at a sample's first step
        weight = u * (lam * dt + F.pad(prev.masked_fill(first[:, None], 0.0)[1:], (0, 0, 0, 1)))
        v = project(x.reshape(T, h, p), mimo_x) * weight[:, None, :, None]
        ssm = _samples.sum_outer(
            v.reshape(T * r, h, p), k.reshape(T * r, h, n_state), smp.repeat(r)
        )
    elif h0 is not None:  # the backend's samples started from angle 0: turn their keys by θ_0
        ssm = rotate(widen(ssm), h0.angle[:, :, None], pairwise)
    if h0 is not None:
        ssm = ssm + w_end[..., None, None] * enter
    last = smp.last
    states = Mamba3States(theta[last, 0], ssm, k[last], widen(x).reshape(T, h, p)[last])
    if return_final_states:
        rows = _samples.row_last(seq_idx)
        states = Mamba3States(*(s[rows] for s in states))
    return y, states


def _torch_run(impl, kw):
    """:func:`_with_sample_states`'s ``run`` for a torch path ``impl`` (mamba3_chunked's
    signature)."""

    def run(gated, ssm):
        return impl(**(kw if gated else {**kw, "z": None, "mimo_o": None})), None

    return run


_OP_ARGUMENTS = (
    *("x", "dt", "A", "trap", "B", "C", "angles", "B_bias", "C_bias", "D", "z"),
    *("mimo_x", "mimo_z", "mimo_o", "chunk_size", "seq_idx"),
)


def _op_arguments(scope: dict) -> dict:
    """The op's arguments but the state ones, from the caller's ``locals()``."""
    return {k: scope[k] for k in _OP_ARGUMENTS}


def mamba3_chunked(
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
    chunk_size=64,
    initial_states=None,
    return_final_states=False,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """Mamba-3 by chunks of ``chunk_size`` steps: the weighted quadratic form inside a chunk, the
    recurrence between chunks (the SSD's algorithm with Mamba-3's weights). Arguments and results as
    :func:`~ssmkit.ops.mamba3_ref.mamba3_reference`; differentiable in everything (autograd).
    Per-sample states are added by linearity (the module docstring)."""
    check(x, dt, A, trap, B, C, angles, B_bias, C_bias, mimo_x, initial_states, seq_idx)
    if _samples.check_mode(
        seq_idx, initial_states, initial_sample_states, return_sample_states, return_final_states
    ):
        kw = _op_arguments(locals())
        return _with_sample_states(
            _torch_run(mamba3_chunked, kw),
            kw,
            initial_sample_states,
            return_sample_states,
            return_final_states,
        )
    b, L, h, p = x.shape
    r = B.shape[2]
    Q = int(chunk_size)
    if Q < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size}")
    pad = (-L) % Q
    pairwise = mimo_x is None
    dt, lam = widen(dt), torch.sigmoid(widen(trap))
    reset = None if seq_idx is None else resets(seq_idx)  # (b, L): a sample starts at t
    theta, last_angle = _angles(
        angles, dt, None if initial_states is None else initial_states[0], Q, reset
    )
    theta = theta[:, :, None]  # the same angle for every rank
    cos_sin = (theta.cos(), theta.sin())
    k = rotate(heads(B, h, B_bias), theta, pairwise, cos_sin)  # (b, L, r, h, n), rotated
    q = rotate(heads(C, h, C_bias), theta, pairwise, cos_sin)
    v = project(x, mimo_x)  # (b, L, r, h, p)

    gamma = lam * dt  # λ_t Δ_t: input t at step t
    prev = (1 - lam) * dt  # (1-λ_t) Δ_t: input t-1 at step t
    if reset is not None:
        prev = prev.masked_fill(reset[..., None], 0.0)  # a sample's first step: no x_{t-1}
    scale = gamma + F.pad(prev[:, 1:], (0, 0, 0, 1))  # w_{ts}, s < t (0 after the end)
    if initial_states is None:
        h0 = x.new_zeros(b, h, p, B.shape[4], dtype=wide_dtype(x))
    else:  # the previous call's last input enters at our first step, decayed with it
        _, ssm0, k0, v0 = initial_states
        h0 = widen(ssm0) + prev[:, 0, :, None, None] * torch.einsum(
            "brhp,brhn->bhpn", project(v0, mimo_x), widen(k0)
        )
        if reset is not None:  # the initial state is sample 0's
            h0 = h0 * (~reset[:, 0]).float()[:, None, None, None]

    def chunks(t):  # (b, L, r, h, d) -> (b, h, c, Q·r, d): position-major, rank-minor
        return rearrange(
            F.pad(t, (0, 0, 0, 0, 0, 0, 0, pad)), "b (c l) r h d -> b h c (l r) d", l=Q
        )

    def per_step(t):  # (b, L, h) -> (b, h, c, Q); padded steps have Δ = 0: no input, no decay
        return rearrange(F.pad(t, (0, 0, 0, pad)), "b (c l) h -> b h c l", l=Q)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    cum = per_step(widen(A) * dt).cumsum(dim=-1)  # Σ log α within the chunk
    sc, gm = per_step(scale), per_step(gamma)
    ranks = lambda t: t.repeat_interleave(r, dim=-1) if r > 1 else t  # noqa: E731 (per step -> per (l r))
    if (
        reset is not None
    ):  # segc (b, 1, c, Q): each step's sample (padded: the last's); enter: the entering
        seg = reset.long().cumsum(dim=1)
        segc = rearrange(
            torch.cat([seg, seg[:, -1:].expand(-1, pad)], dim=1), "b (c l) -> b 1 c l", l=Q
        )
        enter = F.pad(segc[..., :-1, -1], (1, 0), value=0)  # (b, 1, c); chunk 0: sample 0

    # 1. inside each chunk: y = (L ∘ W ∘ q kᵀ) x, L_ts = exp(cum_t - cum_s) (as exp2, cheaper on
    #    CPUs)
    strict = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=x.device), diagonal=-1)
    if reset is not None:  # (s, t) of one sample only
        strict = strict & (segc[..., :, None] == segc[..., None, :])
    cum2 = cum * LOG2_E
    decay = torch.exp2((cum2[..., :, None] - cum2[..., None, :]).masked_fill(~strict, -math.inf))
    W = decay * sc[..., None, :] + torch.diag_embed(gm)  # (b, h, c, Q, Q)
    if r > 1:
        W = W.repeat_interleave(r, dim=-2).repeat_interleave(r, dim=-1)
    y = ((qc @ kc.transpose(-1, -2)) * W) @ vc  # (b, h, c, Q·r, p)

    # 2. each chunk's own final state, as if it started from zero
    to_end = torch.exp(cum[..., -1:] - cum) * sc
    if reset is not None:  # the chunk's last sample only
        to_end = to_end * (segc == segc[..., -1:])
    states = vc.transpose(-1, -2) @ (kc * ranks(to_end)[..., None])  # (b, h, c, p, n)

    # 3. the state entering each chunk: h_c = exp(Σ log α over chunk c-1) h_{c-1} + states_{c-1}
    chunk_decay, decay_in = torch.exp(cum[..., -1]), torch.exp(cum)
    if (
        reset is not None
    ):  # a sample starting inside a chunk cuts the chain; the entering state: its sample
        chunk_decay = chunk_decay * (segc[..., -1] == enter)
        decay_in = decay_in * (segc == enter[..., None])
    hc, entering = h0, []
    for decay_c, state in zip(chunk_decay.unbind(2), states.unbind(2)):
        entering.append(hc)
        hc = decay_c[..., None, None] * hc + state
    entering = torch.stack(entering, dim=2)  # (b, h, c, p, n)

    # 4. that state, decayed to each position, read by q
    y = y + (qc * ranks(decay_in)[..., None]) @ entering.transpose(-1, -2)
    y = rearrange(y, "b h c (l r) p -> b (c l) r h p", r=r)[:, :L]
    y = finish(y, v, D, z, mimo_z, mimo_o, siso=pairwise).to(x.dtype)
    if not return_final_states:
        return y
    return y, Mamba3States(last_angle, hc, k[:, -1], widen(x[:, -1]))


def mamba3_quadratic(x, dt, A, trap, B, C, angles, B_bias, C_bias, chunk_size=None, **kwargs):
    """y = (L ∘ W ∘ q kᵀ) x over the whole sequence at once: one chunk, O(seqlen²) memory, the
    "attention" view. ``chunk_size`` is ignored; other arguments as :func:`mamba3_chunked`."""
    return mamba3_chunked(
        x, dt, A, trap, B, C, angles, B_bias, C_bias, chunk_size=max(1, x.shape[1]), **kwargs
    )


# --------------------------------------------------------------------------------------------
# cuda: mamba_ssm's Triton (SISO) and TileLang (MIMO) kernels
# --------------------------------------------------------------------------------------------


def _heads_first(t):
    """(batch, seqlen, nheads) -> the kernels' (batch, nheads, seqlen), contiguous."""
    return t.transpose(1, 2).contiguous()


def mamba3_cuda(
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
    chunk_size=64,
    initial_states=None,
    return_final_states=False,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """mamba_ssm's ``mamba3_siso_combined`` (rank 1) or ``mamba3_mimo`` (which takes no initial
    states).

    The kernels take packed samples in their varlen form only: batch 1 and ``cu_seqlens``, each
    sequence run from a zero state (angle, memory and previous input). So with ``seq_idx`` the rows
    are flattened into one sequence of batch·seqlen steps cut at every row start and sample start
    (:func:`ssmkit.ops.packing.cu_seqlens`, which reads seq_idx: a GPU sync). States are per sample
    in that form: no batch initial or final states then (:func:`mamba3_scan` takes the torch path
    for those), but per-sample ones: SISO's kernel takes and returns one state per sequence
    (differentiable); MIMO's takes none and returns its memory without a gradient, so its samples'
    states are added by linearity in torch (the module docstring), the memory taken from the kernel
    when no gradient is needed."""
    if _samples.check_mode(
        seq_idx, initial_states, initial_sample_states, return_sample_states, return_final_states
    ):
        kw = _op_arguments(locals())
        return _cuda_sample_states(
            kw, initial_sample_states, return_sample_states, return_final_states
        )
    if seq_idx is None:
        return _kernels(
            x,
            dt,
            A,
            trap,
            B,
            C,
            angles,
            B_bias,
            C_bias,
            D,
            z,
            mimo_x,
            mimo_z,
            mimo_o,
            chunk_size,
            initial_states,
            return_final_states,
        )
    if initial_states is not None or return_final_states:
        raise _backend.BackendError(
            "mamba_ssm's Mamba-3 kernels take packed samples (seq_idx) only in their "
            "varlen form, whose states are per sample: no initial_states or "
            "return_final_states with seq_idx; use backend='torch' for those"
        )
    b, L = x.shape[:2]
    flat = lambda t: None if t is None else t.reshape(1, b * L, *t.shape[2:])  # noqa: E731
    y = _kernels(
        flat(x),
        flat(dt),
        flat(A),
        flat(trap),
        flat(B),
        flat(C),
        flat(angles),
        B_bias,
        C_bias,
        D,
        flat(z),
        mimo_x,
        mimo_z,
        mimo_o,
        chunk_size,
        None,
        False,
        cu_seqlens(seq_idx),
    )
    return y.reshape(b, L, *y.shape[2:])


def _cuda_sample_states(kw, initial_sample_states, return_sample_states, return_final_states):
    """:func:`mamba3_cuda` with per-sample states: the rows flattened to the kernels' varlen
    form."""
    x, B, angles, seq_idx = kw["x"], kw["B"], kw["angles"], kw["seq_idx"]
    b, L = x.shape[:2]
    cu = cu_seqlens(seq_idx)
    flat = lambda t: None if t is None else t.reshape(1, b * L, *t.shape[2:])  # noqa: E731
    timed = [flat(kw[k]) for k in ("x", "dt", "A", "trap", "B", "C", "angles")]
    biases, zf = (kw["B_bias"], kw["C_bias"], kw["D"]), flat(kw["z"])
    want = return_sample_states or return_final_states
    if kw["mimo_x"] is None:  # the kernel's own per-sequence states
        h0 = initial_sample_states
        if h0 is not None:
            check_sample_tuple(h0, len(cu) - 1, x, B, angles)
        out = _kernels(*timed, *biases, zf, None, None, None, kw["chunk_size"], h0, want, cu)
        y, states = out if want else (out, None)
        y = y.reshape(x.shape)
        if not want:
            return y
        if return_final_states:
            rows = _samples.row_last(seq_idx)
            states = Mamba3States(*(s[rows] for s in states))
        return y, states
    inputs = [t for k, t in kw.items() if isinstance(t, torch.Tensor) and k != "seq_idx"]
    inputs += list(initial_sample_states or ())
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    mimo = (kw["mimo_x"], kw["mimo_z"], kw["mimo_o"])

    def run(gated, ssm):
        memory = ssm and not grad  # the kernel's final states have no backward
        ungated = (zf, *mimo) if gated else (None, *mimo[:2], None)
        out = _kernels(*timed, *biases, *ungated, kw["chunk_size"], None, memory, cu)
        y, states = out if memory else (out, None)
        return y.reshape(b, L, *y.shape[2:]), None if states is None else states.ssm

    return _with_sample_states(
        run, kw, initial_sample_states, return_sample_states, return_final_states
    )


def _kernels(
    x,
    dt,
    A,
    trap,
    B,
    C,
    angles,
    B_bias,
    C_bias,
    D,
    z,
    mimo_x,
    mimo_z,
    mimo_o,
    chunk_size,
    initial_states,
    return_final_states,
    cu=None,
):
    """The kernel calls of :func:`mamba3_cuda`; ``cu``: the varlen cu_seqlens (batch 1) or None."""
    dt = widen(dt)
    common = dict(
        ADT=_heads_first(widen(A) * dt),
        DT=_heads_first(dt),
        Trap=_heads_first(trap),
        Angles=widen(angles),
        D=D,
        Z=z,
        chunk_size=chunk_size,
    )  # MIMO reads fp32 angles
    if cu is not None:
        common["cu_seqlens"] = cu
    if mimo_x is None:
        fn = _backend.kernel_module("mamba3_siso").mamba3_siso_combined
        start = (
            None
            if initial_states is None
            else (initial_states[0], initial_states[1], initial_states[2][:, 0], initial_states[3])
        )
        out = fn(
            Q=C[:, :, 0],
            K=B[:, :, 0],
            V=x,
            Q_bias=C_bias[:, 0],
            K_bias=B_bias[:, 0],
            Input_States=start,
            return_final_states=return_final_states,
            **common,
        )
        if not return_final_states:
            return out
        y, angle, ssm, k, v = out
        return y, Mamba3States(angle, ssm, k[:, None], v)
    if initial_states is not None:
        raise _backend.BackendError(
            "mamba_ssm's Mamba-3 MIMO kernel takes no initial states; continue a "
            "sequence with backend='torch' (or one step at a time)"
        )
    n, S = B.shape[4], angles.shape[3]
    if n % S or n // S not in (2, 4):
        raise _backend.BackendError(
            f"mamba_ssm's MIMO kernel rotates dstate/2 or dstate/4 pairs; "
            f"got {S} angles for dstate {n}"
        )
    fn = _backend.kernel_module("mamba3_mimo").mamba3_mimo
    out = fn(
        Q=C,
        K=B,
        V=x,
        Q_bias=C_bias,
        K_bias=B_bias,
        MIMO_V=mimo_x,
        MIMO_Z=mimo_z,
        MIMO_Out=mimo_o,
        rotary_dim_divisor=n // S,
        dtype=x.dtype,
        return_state=return_final_states,
        **common,
    )
    if not return_final_states:
        return out
    y, angle, ssm, k, v = out
    return y, Mamba3States(angle, ssm, k, v)


_IMPLS = {"reference": mamba3_reference, "torch": mamba3_chunked, "cuda": mamba3_cuda}


def mamba3_scan(
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
    chunk_size=64,
    initial_states=None,
    return_final_states=False,
    backend=None,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """The Mamba-3 scan, dispatched to a backend (op "mamba3_siso" for rank 1, "mamba3_mimo" with
    mimo_x).

    Args (see :mod:`ssmkit.ops.mamba3_ref`): x (batch, seqlen, nheads, headdim); dt, A, trap (batch,
    seqlen, nheads): Δ > 0, A < 0, λ before its sigmoid; B, C (batch, seqlen, rank, ngroups,
    dstate); angles (batch, seqlen, nheads, nangles); B_bias, C_bias (nheads, rank, dstate); D
    (nheads,) or None; z like x or None; mimo_x, mimo_z, mimo_o (nheads, rank, headdim) for MIMO;
    initial_states: (angle, ssm, k, v) or None; seq_idx: (batch, seqlen) integer sample index of
    every position of packed rows, non-decreasing along each row, or None: every sample starts from
    a zero state (:mod:`ssmkit.ops.packing`); initial_sample_states: with seq_idx only and instead
    of initial_states, (angle, ssm, k, v) shaped as initial_states but with n_samples in place of
    batch: every packed sample starts from its own state (samples numbered row-major as
    :func:`ssmkit.ops.packing.sample_numbers`), as if it ran alone as a batch of one with that
    initial_states.
    Returns y like x in x's dtype ((batch, seqlen, rank, nheads, headdim) for MIMO without mimo_o)
    and, with ``return_final_states``, the :class:`Mamba3States` after the last step (fp32 from the
    torch paths); with ``return_sample_states`` (seq_idx only, not with return_final_states)
    instead every sample's last states, each with leading dimension n_samples.

    ``chunk_size`` is the kernels' block length; the torch backend on a CPU uses chunks of at most
    :data:`CPU_CHUNK_SIZE` positions x rank (the same sums, fewer operations).

    With ``seq_idx`` the ``cuda`` backend runs the kernels' varlen form (see :func:`mamba3_cuda`);
    combined with initial_states or return_final_states an automatic choice takes the torch path, a
    forced cuda backend raises :class:`~ssmkit.ops.BackendError`. Per-sample states run on every
    backend.
    """
    mimo = mimo_x is not None
    name = _backend.select("mamba3_mimo" if mimo else "mamba3_siso", x, backend=backend)
    forced = backend or _backend.forced_backend()
    per_sample = initial_sample_states is not None or return_sample_states
    if name == "cuda" and mimo and initial_states is not None and forced is None:
        name = "torch"  # the MIMO kernel cannot continue a sequence: no error unless forced
    if (
        name == "cuda"
        and seq_idx is not None
        and (initial_states is not None or return_final_states)
        and not per_sample
        and forced is None
    ):
        name = "torch"  # the varlen kernels keep states per sample: no error unless forced
    if name == "torch" and x.device.type == "cpu":
        chunk_size = max(1, min(int(chunk_size), CPU_CHUNK_SIZE // B.shape[2]))
    extra = {} if seq_idx is None else {"seq_idx": seq_idx}
    if per_sample:
        extra.update(
            initial_sample_states=initial_sample_states, return_sample_states=return_sample_states
        )
    return _IMPLS[name](
        x,
        dt,
        A,
        trap,
        B,
        C,
        angles,
        B_bias,
        C_bias,
        D=D,
        z=z,
        mimo_x=mimo_x,
        mimo_z=mimo_z,
        mimo_o=mimo_o,
        chunk_size=chunk_size,
        initial_states=initial_states,
        return_final_states=return_final_states,
        **extra,
    )


# --------------------------------------------------------------------------------------------
# one token (generation)
# --------------------------------------------------------------------------------------------


def mamba3_step(
    states,
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
    backend=None,
):
    """One step of the recurrence for generation, O(1) in the length so far, or T steps in one call
    (speculative decoding's verification step); ``states`` (angle, ssm, k, v), shaped as
    :class:`Mamba3States`, are updated in place.

    One token: the shapes of :func:`mamba3_scan` without the time axis: x, z (batch, nheads,
    headdim); dt, A, trap (batch, nheads); B, C (batch, rank, ngroups, dstate); angles (batch,
    nheads, nangles). Returns y (batch, nheads, headdim) in x's dtype ((batch, rank, nheads,
    headdim) for MIMO without mimo_o).
    T tokens: the shapes of :func:`mamba3_scan` with seqlen = T (x (batch, T, nheads, headdim),
    ...), the time axis second as there and in FlashInfer's multi-token state update (mamba_ssm's
    step kernel takes one token). Returns y (batch, T, ...), the same as T one-token calls.

    The ``cuda`` backend runs mamba_ssm's ``mamba3_step_fn`` (CuTe DSL) for the state update, as its
    ``Mamba3.step`` does: once per token."""
    one = _check_step(states, x, dt, A, trap, B, C, angles, B_bias, C_bias, mimo_x)
    h, pairwise = x.shape[-2], mimo_x is None
    # what does not depend on the state, for every token at once
    dt, A, lam = widen(dt), widen(A), torch.sigmoid(widen(trap))
    Bh, Ch = heads(B, h, B_bias), heads(C, h, C_bias)
    turn = angle_increments(angles, dt)
    if _backend.select("mamba3_step", states[1], backend=backend) == "cuda":
        args = (states, D, mimo_x, mimo_z, mimo_o)
        if one:
            return _kernel_step(x, dt, A, lam, Bh, Ch, turn, z, *args)
        at = lambda t, i: None if t is None else t[:, i]  # noqa: E731
        ys = [
            _kernel_step(
                x[:, i],
                dt[:, i],
                A[:, i],
                lam[:, i],
                Bh[:, i],
                Ch[:, i],
                turn[:, i],
                at(z, i),
                *args,
            )
            for i in range(x.shape[1])
        ]  # one kernel call per token
        return torch.stack(ys, dim=1)
    timed = [t if t is None or not one else t[:, None] for t in (x, dt, A, lam, Bh, Ch, turn, z)]
    x, dt, A, lam, Bh, Ch, turn, z = timed
    current = Mamba3States(*(widen(s) for s in states))
    ys = []
    for i in range(x.shape[1]):
        y, xr, current = step(
            current,
            x[:, i],
            dt[:, i],
            A[:, i],
            lam[:, i],
            Bh[:, i],
            Ch[:, i],
            turn[:, i],
            mimo_x,
            pairwise,
        )
        zi = None if z is None else z[:, i]
        ys.append(finish(y, xr, D, zi, mimo_z, mimo_o, siso=pairwise).to(x.dtype))
    for old, value in zip(states, current):
        old.copy_(value)
    return ys[0] if one else torch.stack(ys, dim=1)


def _check_step(states, x, dt, A, trap, B, C, angles, B_bias, C_bias, mimo_x) -> bool:
    """The shapes of :func:`mamba3_step`'s arguments, those of the scan without (one token) or with
    (T tokens) the time axis. Returns True for one token."""
    if (
        not isinstance(x, torch.Tensor)
        or x.dim() not in (3, 4)
        or (x.dim() == 4 and not x.shape[1])
    ):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            "mamba3_step: x must be (batch, nheads, headdim) for one token or (batch, T >= 1, "
            f"nheads, headdim) for T tokens; got {got}"
        )
    one = x.dim() == 3
    timed = [t[:, None] if one else t for t in (x, dt, A, trap, B, C, angles)]
    try:
        check(*timed, B_bias, C_bias, mimo_x, tuple(states))
    except ValueError as err:
        form = "one token: the scan's shapes without seqlen" if one else "T tokens: seqlen = T"
        raise ValueError(f"mamba3_step ({form}): {err}") from None
    return one


def _kernel_step(x, dt, A, lam, Bh, Ch, turn, z, states, D, mimo_x, mimo_z, mimo_o):
    """One token through mamba_ssm's ``mamba3_step_fn``: x, z (batch, nheads, headdim); dt, A, λ
    (batch, nheads) in fp32, λ after its sigmoid; Bh, Ch (batch, rank, nheads, dstate) biased, not
    yet rotated; turn (batch, nheads, nangles). The kernel takes k and q rotated by the new angle;
    the angle, the previous key and input are kept here."""
    angle, ssm, k_state, v_state = states
    pairwise, h = mimo_x is None, x.shape[1]
    new_angle = torch.remainder(angle + turn, TWO_PI)
    k = rotate(Bh, new_angle[:, None], pairwise).to(k_state.dtype)
    q = rotate(Ch, new_angle[:, None], pairwise).to(k_state.dtype)
    r, p = Bh.shape[1], x.shape[2]
    ones = torch.ones(r, h, p, device=x.device, dtype=x.dtype)
    xproj = ones if pairwise else mimo_x.transpose(0, 1).contiguous()
    outproj = ones if pairwise else None if mimo_o is None else mimo_o.transpose(0, 1).contiguous()
    zproj = None if z is None else ones if pairwise else mimo_z.transpose(0, 1).contiguous()
    out = torch.empty(
        (x.shape[0], h, p) if outproj is not None else (x.shape[0], r, h, p),
        device=x.device,
        dtype=x.dtype,
    )
    fn = _backend.kernel_module("mamba3_step").mamba3_step_fn
    fn(
        ssm,
        k_state,
        v_state,
        A,
        k,
        q,
        torch.zeros(h, device=x.device) if D is None else D,
        x,
        dt,
        lam,
        xproj,
        outproj=outproj,
        out=out,
        z=z,
        zproj=zproj,
    )
    angle.copy_(new_angle)
    k_state.copy_(k)
    v_state.copy_(x)
    return out
