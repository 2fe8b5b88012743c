r"""The Mamba-1 selective scan (S6), "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces" (Gu & Dao, 2023), Algorithm 2 and equations (2a), (2b), (4).

Glossary (code name -> paper symbol):

    u           x      the input sequence, one scalar channel per d in D = d_inner (``dim``)
    delta, dt   Δ      the step size, Δ = softplus(δ + delta_bias) (Algorithm 2: τ_Δ(Parameter +
                       s_Δ(x)), τ_Δ = softplus); ``delta`` holds the raw δ until discretised, and in
                       :class:`SelectiveScanFn` ``dt_raw`` = δ + bias, ``dt`` = Δ
    A           A      the (diagonal) state matrix, one row of N = d_state values per channel, A < 0
    B, C        B, C   input-dependent input / output projections of the state, N values per step
    D           D      the skip connection y += D * u
    z           z      the gate branch, y *= silu(z)
    h, H        h      the hidden state, (batch, D, N) per time step; H: one chunk's states
    dA, dB      Ā, B̄   discretised A, B (mamba_ssm's deltaA, deltaB). In ``backward``, ``dA`` is
                       still Ā, while ``dB, dC, dD, dz, ddt, du`` are gradients ∂L/∂(·) and ∂L/∂A
                       is ``dA_param``
    dim, dstate, ngroups   D, N, G: G groups of D / G channels, each group sharing one B_t, C_t

Einsum letters and short shapes: ``b`` batch, ``d`` channel (D), ``g`` group (G), ``c`` channel
within its group (d = g·D/G + c), ``n`` state index (N), ``t`` time step, ``L`` seqlen, ``T``
steps per chunk. Careful: the local ``k`` (forward) and ``n`` (backward) count a chunk's steps,
and ``k`` in backward is the chunk index.

Discretisation as in the official code: Ā = exp(Δ A) (zero-order hold, eq. 4) and B̄ = Δ B, the
first-order (Euler) form of eq. 4's B̄ -- "a mix of ZOH for A and Euler discretization for B"
(Gu, state-spaces/mamba#114). The recurrence (eq. 2a, 2b):

$$ h_t = \bar A_t \odot h_{t-1} + \bar B_t\, x_t, \qquad y_t = C_t^\top h_t $$

Shapes follow mamba_ssm's ``selective_scan_fn``: ``u, delta, z: (batch, dim, seqlen)``,
``A: (dim, dstate)``, ``B, C: (batch, dstate, seqlen)`` or grouped ``(batch, ngroups, dstate,
seqlen)`` where channel d uses group ``d // (dim // ngroups)``.

Packed samples: mamba_ssm's selective_scan_fn has no such input; here ``seq_idx`` (batch, seqlen),
the same convention as the SSD's and the conv's (:mod:`ssmkit.ops.packing`), zeroes h_{t-1} where it
changes: h_t = [same sample] Ā_t h_{t-1} + B̄_t x_t. ``initial_state`` reaches only sample 0; the
final state is the last sample's. Per-sample states (mamba_ssm's varlen ``initial_states`` /
``return_varlen_states`` for its SSD): ``initial_sample_states`` (n_samples, dim, dstate) makes
h_{t-1} at every sample's first step that sample's state instead of 0, and ``return_sample_states``
returns h at every sample's last step, (n_samples, dim, dstate) fp32. The torch paths cut their
chunks at every sample start (:func:`~ssmkit.ops.packing.sample_pieces`) and hand the state over
between chunks, so each sample runs the very recurrence it runs alone: no decay accumulated over a
sample (exp(A ΣΔ)) is ever formed, and no precision is lost on long samples.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import backend as _backend
from . import compiled as _compiled
from . import s6_cpu as _s6_cpu
from .packing import check_seq_idx, resets, sample_numbers, sample_pieces, sample_state_spans
from .precision import wide_dtype, widen


def _check(
    u,
    delta,
    A,
    B,
    C,
    initial_state,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
    return_final_state=False,
):
    """The arguments checked; returns :func:`~ssmkit.ops.packing.sample_spans` when per-sample
    states are used, else None."""
    if u.dim() != 3 or delta.shape != u.shape:
        raise ValueError(
            f"u and delta must both be (batch, dim, seqlen); got u {tuple(u.shape)}, "
            f"delta {tuple(delta.shape)}"
        )
    batch, dim, seqlen = u.shape
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must be (dim={dim}, dstate); got {tuple(A.shape)}")
    dstate = A.shape[1]
    for name, M in (("B", B), ("C", C)):
        ok3 = M.dim() == 3 and tuple(M.shape) == (batch, dstate, seqlen)
        ok4 = (
            M.dim() == 4
            and M.shape[0] == batch
            and M.shape[2:] == (dstate, seqlen)
            and dim % M.shape[1] == 0
        )
        if not (ok3 or ok4):
            raise ValueError(
                f"{name} must be (batch={batch}, dstate={dstate}, seqlen={seqlen}) or "
                f"(batch, ngroups, dstate, seqlen) with ngroups dividing dim={dim}; "
                f"got {tuple(M.shape)}"
            )
    if initial_state is not None and tuple(initial_state.shape) != (batch, dim, dstate):
        raise ValueError(
            f"initial_state must be (batch={batch}, dim={dim}, dstate={dstate}); "
            f"got {tuple(initial_state.shape)}"
        )
    check_seq_idx(seq_idx, batch, seqlen)
    return sample_state_spans(
        seq_idx,
        initial_sample_states,
        return_sample_states,
        (dim, dstate),
        initial_state,
        "initial_state",
        return_final_state,
    )


def _sample_inits(spans, seq_idx, initial_state, initial_sample_states):
    """(n_samples, dim, dstate) in the scan's precision, every sample's initial state: the given
    ones; else ``initial_state`` for the first sample of each row that starts with sample 0 (the
    per-row convention) and zeros for the others; None when all are zeros."""
    if initial_sample_states is not None:
        return widen(initial_sample_states)
    if initial_state is None:
        return None
    h = widen(initial_state)
    first = (spans[1] == 0).nonzero().reshape(-1)  # each row's first sample, in row order
    gets = seq_idx[:, 0] == 0
    return h.new_zeros(len(spans[0]), *h.shape[1:]).index_put((first[gets],), h[gets])


def _results(y, h, finals, return_final_state, return_sample_states):
    """y, then the row's final state or the samples' final states where asked for (never both:
    :func:`~ssmkit.ops.packing.check_sample_state_keywords`)."""
    out = (y, *((h,) if return_final_state else ()), *((finals,) if return_sample_states else ()))
    return out if len(out) > 1 else y


def _grouped(M: torch.Tensor) -> torch.Tensor:
    """(batch, dstate, seqlen) -> (batch, 1, dstate, seqlen); grouped input unchanged."""
    return M.unsqueeze(1) if M.dim() == 3 else M


def _discretize_delta(delta, delta_bias, delta_softplus):
    delta = widen(delta)
    if delta_bias is not None:
        delta = delta + widen(delta_bias)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)  # threshold 20, as the CUDA kernel
    return delta


def _skip_and_gate(y, u, D, z):
    if D is not None:
        y = y + widen(u) * widen(D)[:, None]
    if z is not None:
        y = y * F.silu(widen(z))
    return y


# --------------------------------------------------------------------------------------------
# reference: Algorithm 2, one time step at a time, with autograd
# --------------------------------------------------------------------------------------------


def selective_scan_reference(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_final_state=False,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """The literal recurrence (Algorithm 2). Slow; the oracle for the other backends.

    Returns ``y: (batch, dim, seqlen)`` in u's dtype, and ``h_L: (batch, dim, dstate)`` (fp32)
    when ``return_final_state``, then the samples' final states (n_samples, dim, dstate) when
    ``return_sample_states``. With ``seq_idx`` h_{t-1} is zeroed where a new sample starts, or set
    to the sample's own initial state (``initial_sample_states``).
    """
    spans = _check(
        u,
        delta,
        A,
        B,
        C,
        initial_state,
        seq_idx,
        initial_sample_states,
        return_sample_states,
        return_final_state,
    )
    batch, dim, seqlen = u.shape
    delta = _discretize_delta(delta, delta_bias, delta_softplus)
    Bg, Cg = widen(_grouped(B)), widen(_grouped(C))
    heads_per_group = dim // Bg.shape[1]
    # give every channel its group's B_t and C_t: (batch, dim, dstate, seqlen)
    Bd = Bg.repeat_interleave(heads_per_group, dim=1)
    Cd = Cg.repeat_interleave(heads_per_group, dim=1)
    A, x = widen(A), widen(u)
    h = x.new_zeros(batch, dim, A.shape[1]) if initial_state is None else widen(initial_state)
    keep = None if seq_idx is None else (~resets(seq_idx)).float()  # 0 where a new sample starts
    if spans is not None:  # per-sample states: every sample starts from its own
        keep, h = None, x.new_zeros(batch, dim, A.shape[1])
        inits = _sample_inits(spans, seq_idx, initial_state, initial_sample_states)
        inits = x.new_zeros(len(spans[0]), dim, A.shape[1]) if inits is None else inits
        number = sample_numbers(seq_idx)  # (batch, seqlen)
        begins = number != F.pad(number[:, :-1], (1, 0), value=-1)  # a sample's first step
        ends = number != F.pad(number[:, 1:], (0, 1), value=-1)  # its last
    ys, finals = [], []
    for t in range(seqlen):
        if keep is not None:
            h = keep[:, t, None, None] * h  # a new sample: h_{t-1} = 0
        if spans is not None:  # a new sample: h_{t-1} = its initial state
            h = torch.where(begins[:, t, None, None], inits[number[:, t]], h)
        dA = torch.exp(delta[:, :, t, None] * A)  # Ā_t = exp(Δ_t A)      (ZOH)
        dB = delta[:, :, t, None] * Bd[:, :, :, t]  # B̄_t = Δ_t B_t
        h = dA * h + dB * x[:, :, t, None]  # h_t = Ā_t h_{t-1} + B̄_t x_t
        ys.append((h * Cd[:, :, :, t]).sum(-1))  # y_t = C_t^T h_t
        if return_sample_states:  # the samples that end at t: their final states
            finals.append((number[ends[:, t], t], h[ends[:, t]]))
    y = _skip_and_gate(torch.stack(ys, dim=-1), u, D, z).to(u.dtype)
    if return_sample_states:
        numbers, states = (torch.cat(part) for part in zip(*finals))
        finals = states[numbers.argsort()]
    return _results(y, h, finals, return_final_state, return_sample_states)


# --------------------------------------------------------------------------------------------
# torch: the same recurrence as a custom autograd.Function
# --------------------------------------------------------------------------------------------
#
# Like mamba_ssm's fused kernel, one autograd.Function does the whole op: Δ = softplus(Δ + bias),
# the recurrence, y = C h, the skip D x and the gate silu(z), with a hand-written backward.
# Forward and backward loop over time with no autograd graph; everything that does not need the
# loop (Ā, B̄x, y = C h, and all gradients but dL/dh) is computed for a chunk of T time steps at
# once, into work buffers allocated once per call and reused chunk after chunk (a chunk of
# T * batch * dim * dstate floats stays in cache). Only the states entering each chunk are kept;
# backward recomputes one chunk's states at a time, so state memory is
# O(batch * dim * dstate * (seqlen / T + T)) instead of O(batch * dim * dstate * seqlen).
#
# Inside a chunk the layout is time-major with channels split by group: (T, batch, groups,
# dim/groups, ...), so one time step is one contiguous slice and a group's B_t, C_t broadcast
# over its channels.

_CHUNK_ELEMENTS = 1 << 20  # aim for T * batch * dim * dstate ~ 1M floats (4 MiB) per chunk
LOG2_E = math.log2(math.e)


def _chunk_len(batch, dim, dstate):
    return max(1, min(64, _CHUNK_ELEMENTS // max(1, batch * dim * dstate)))


def _time_major(M):
    """(b, ..., L) -> a contiguous (L, b, ...): one time step is one contiguous slice."""
    return M.permute(-1, *range(M.dim() - 1)).contiguous()


def _chunk_states(delta, u, A, B, h, dA, H, keep=None):
    """Discretise and run the recurrence over one chunk, into the given buffers.

    delta, u: (T, b, g, c); A: (g, c, n); B: (T, b, g, n); h: (b, g, c, n) the entering state; keep:
    (T, b) or None, 0 where a packed sample starts (Ā_t is then 0: the product keep_t Ā_t h_{t-1} is
    all the forward and backward ever use of Ā_t, as the adjoint and as ∂(Ā_t h_{t-1})/∂(Δ_t A), so
    folding the reset into Ā makes both exact with no other change).
    Writes Ā_t = exp(Δ_t A) into dA (T, b, g, c, n) and h_{t-1} for t = 0..T into
    H (T + 1, b, g, c, n), H[0] = h. Returns h_{T-1} (a view of H).
    ``A`` comes pre-multiplied by log2(e): exp(x) = 2^(x log2 e), and torch's exp2 is several
    times faster than its exp on CPU (the CUDA kernel uses exp2f the same way).
    """
    H[0] = h  # first: h may be a view of H
    torch.mul(delta[..., None], A, out=dA).exp2_()
    if keep is not None:
        dA.mul_(keep[:, :, None, None, None])
    torch.mul((delta * u)[..., None], B[:, :, :, None, :], out=H[1:])  # B̄_t x_t = Δ_t x_t B_t ...
    Hs = H.unbind(0)
    for a, h_prev, h_out in zip(dA.unbind(0), Hs, Hs[1:]):  # ... + Ā_t h_{t-1} = h_t
        torch.addcmul(h_out, a, h_prev, out=h_out)
    return Hs[-1]


class SelectiveScanFn(torch.autograd.Function):
    """The torch backend's fused S6 scan, all fp32.

    u, delta, z: (b, d, L); A: (d, n); B, C: (b, g, n, L); D, delta_bias: (d,) or None;
    h0: (b, d, n); keep: (b, L) fp32, 0 where a packed sample starts, or None. Per-sample states:
    spans, :func:`~ssmkit.ops.packing.sample_spans` of the packed rows (keep None, h0 zeros), and
    h_samples: (n_samples, d, n) or None (zeros). Returns y: (b, d, L), h_L: (b, d, n) and the
    samples' final states (n_samples, d, n) (empty without spans). Inside, every sequence is
    time-major, (L, b, ...), and a chunk of steps s..e-1 is the view [s:e] reshaped to (k, b, g,
    d / g). With spans, chunks are also cut at every sample start and a new sample's initial state
    replaces the carried one in its row.
    """

    @staticmethod
    def forward(
        ctx,
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        h0,
        softplus,
        keep=None,
        spans=None,
        h_samples=None,
    ):
        batch, dim, L = u.shape
        groups, dstate = B.shape[1], A.shape[1]
        state = (batch, groups, dim // groups, dstate)
        T = min(L, _chunk_len(batch, dim, dstate))
        u_t, B_t, C_t = _time_major(u), _time_major(B), _time_major(C)  # (L, b, d), (L, b, g, n)
        dt_raw = _time_major(delta) if delta_bias is None else _time_major(delta) + delta_bias
        dt = F.softplus(dt_raw) if softplus else dt_raw  # Δ: (L, b, d)
        grp = lambda M: M.view(M.shape[0], *state[:3])  # noqa: E731  (k, b, d) -> (k, b, g, c)
        A2 = A.reshape(state[1:]) * LOG2_E
        dA, H = u.new_empty(T, *state), u.new_empty(T + 1, *state)
        ys = u.new_empty(L, batch, dim)  # C h, before D and z
        keep_t = None if keep is None else keep.t().contiguous()  # (L, b)
        pieces = sample_pieces(spans, L, T)  # chunks of at most T steps, cut at sample starts
        finals = u.new_zeros(0 if spans is None else len(spans[0]), *state[1:])
        starts, h = [], h0.reshape(state)
        for s, e, enter, leave in pieces:
            k = e - s
            if enter is not None:  # new samples begin in these rows, from their own states
                rows, ids = enter
                new = (
                    h.new_zeros(len(rows), *state[1:])
                    if h_samples is None
                    else h_samples[ids].reshape(-1, *state[1:])
                )
                h = h.index_copy(0, rows, new)
            starts.append(h.clone())
            h = _chunk_states(
                grp(dt[s:e]),
                grp(u_t[s:e]),
                A2,
                B_t[s:e],
                h,
                dA[:k],
                H[: k + 1],
                None if keep_t is None else keep_t[s:e],
            )
            grp(ys[s:e]).copy_(
                torch.einsum("tbgcn,tbgn->tbgc", H[1 : k + 1], C_t[s:e])
            )  # y_t = C_t^T h_t
            if leave is not None:  # samples that end here: their final states
                rows, ids = leave
                finals[ids] = h[rows]
        pre = ys if D is None else ys + u_t * D  # skip connection
        z_t = None if z is None else z.permute(2, 0, 1)
        out = pre if z is None else pre * F.silu(z_t)  # gate
        # the last chunk's Ā and states are still in the buffers: backward starts there without
        # recompute
        ctx.save_for_backward(
            u_t, dt_raw, A, B_t, C_t, D, z_t, delta_bias, dt, pre, dA, H, keep_t, *starts
        )
        ctx.T, ctx.softplus, ctx.pieces = T, softplus, pieces
        ctx.sample_states = h_samples is not None
        return (
            out.permute(1, 2, 0),
            h.reshape(batch, dim, dstate).clone(),
            finals.reshape(finals.shape[0], dim, dstate),
        )

    # Backward, derived. Per batch row, channel d and state index n (A is diagonal, so all is
    # elementwise in (d, n)); t = 0 .. L-1, h_{-1} = h0; dX means ∂L/∂X. The forward is
    #   Δ_t = softplus(δ_t + bias)                           (dt, from dt_raw = δ + bias)
    #   Ā_t = exp(Δ_t A)                                     (eq. 4, ZOH; dA_)
    #   h_t = Ā_t ⊙ h_{t-1} + Δ_t x_t B_t                    (eq. 2a, B̄_t = Δ_t B_t; H_[1:])
    #   y_t = Σ_n C_t[n] h_t[n]                              (eq. 2b; ys)
    #   pre = y + D x,  out = pre ⊙ silu(z)                   (pre saved, out returned)
    # Gate and skip, from the outside in (the code then overwrites dout with dy):
    #   dz = dout ⊙ pre ⊙ silu'(z),  dy = dout ⊙ silu(z),  dD = Σ_{t,b} dy ⊙ x,  dx = D ⊙ dy + ...
    # h_t reaches L through y_t and through h_{t+1}, so g_t = dh_t obeys the adjoint recurrence,
    # run backward in time (dH_; the only sequential loop):
    #   g_{L-1} = C_{L-1} dy_{L-1} + dh_L                     (dh_L = dh_last, grad of returned h_L)
    #   g_t     = C_t dy_t + Ā_{t+1} ⊙ g_{t+1}
    #   dh0     = Ā_0 ⊙ g_0                                   (``carry`` when the loop ends)
    # Chunk s..e-1 hands carry = Ā_s ⊙ g_s = dh_{s-1} to the chunk before, which adds it to g_{s-1}.
    # With g known, the rest is local in t (B, C are per batch row: dB, dC keep b):
    #   dB_t[n]   = Σ_{d in group} g_t[d,n] Δ_t[d] x_t[d]      (einsum over c)
    #   dC_t[n]   = Σ_{d in group} h_t[d,n] dy_t[d]
    #   dBx_t[d]  = Σ_n g_t[d,n] B_t[n]                        = ∂L/∂(Δ_t x_t)
    #   dDeltaA_t = g_t ⊙ h_{t-1} ⊙ Ā_t                        = ∂L/∂(Δ_t A), as ∂Ā/∂(ΔA) = Ā
    #   dA        = Σ_{t,b} dDeltaA_t ⊙ Δ_t                    (dA_param)
    #   dΔ_t      = Σ_n dDeltaA_t[·,n] A[·,n] + dBx_t ⊙ x_t    (ddt)
    #   dx_t     += dBx_t ⊙ Δ_t                                (du)
    #   dδ = dΔ ⊙ sigmoid(δ + bias) with softplus (1 above 20, as the forward), else dδ = dΔ;
    #   dbias = Σ_{t,b} dδ
    # Why recompute: storing every h_t takes a (batch, d_inner, seqlen, d_state) tensor, N times
    # the size of x. Forward keeps per chunk only its entering state h_{s-1}, (b, d, n), in
    # ``starts`` (plus the last chunk's Ā and H buffers); backward reruns _chunk_states on chunk k
    # from starts[k]: one extra forward pass over every chunk but the last, into T-step buffers
    # reused chunk after chunk. T is sized for cache (~2^20 floats), not memory: with
    # batch*dim*dstate = 2^18, T = 4 and ``starts`` holds a quarter of all states.
    # Numerics: all fp32; Ā is the same exp2 value as in forward, used both in the adjoint and as
    # ∂Ā/∂(ΔA). dA_param sums over (t, b) per chunk, then chunk by chunk from the last; dD and
    # dbias sum over all (L, b) at once. dH_ becomes dDeltaA in place only after dB, dBx and
    # carry have read it, and dDeltaA is scaled by A in place only after dA_param has read it.
    # Per-sample states: a sample's final state h_e is one more output, so its gradient joins
    # dh_{e-1} at the end of the chunk it ends (carry); a sample's initial state stands where the
    # carried state would, so dL/d(initial state) is the carry at its chunk's start, and nothing
    # flows on into the previous sample of that row.
    @staticmethod
    def backward(ctx, dout, dh_last, dfinals):
        (
            u_t,
            dt_raw,
            A,
            B_t,
            C_t,
            D,
            z_t,
            delta_bias,
            dt,
            pre,
            last_dA,
            last_H,
            keep_t,
            *starts,
        ) = ctx.saved_tensors
        L, batch, dim = u_t.shape
        groups, dstate = B_t.shape[2], A.shape[1]
        state = (batch, groups, dim // groups, dstate)
        T = ctx.T
        grp = lambda M: M.view(M.shape[0], *state[:3])  # noqa: E731
        dout = torch.zeros_like(u_t) if dout is None else _time_major(dout)
        # out = pre * silu(z), pre = ys + D u  (aten's fused silu / softplus backward kernels)
        dz = None
        if z_t is not None:
            dz = torch.ops.aten.silu_backward(dout * pre, z_t)
            dout = dout * F.silu(z_t)
        dD = None if D is None else (dout * u_t).sum((0, 1))
        du = torch.zeros_like(u_t) if D is None else dout * D  # (L, b, d)
        # the scan, chunk by chunk from the end; dL/dys = dout
        A_ = A.reshape(state[1:])
        A2 = A_ * LOG2_E
        carry = u_t.new_zeros(state) if dh_last is None else dh_last.reshape(state).clone()
        ddt, dB, dC, dA_param = (
            torch.empty_like(u_t),
            torch.empty_like(B_t),
            torch.empty_like(C_t),
            torch.zeros_like(A_),
        )
        work, dH = u_t.new_empty(T, *state), u_t.new_empty(T, *state)
        if len(starts) > 1:  # room to recompute a chunk
            dA, H = u_t.new_empty(T, *state), u_t.new_empty(T + 1, *state)
        d_samples = None
        if ctx.sample_states:
            d_samples = u_t.new_zeros(dfinals.shape[0], *state[1:])
        for k in reversed(range(len(starts))):
            s, e, enter, leave = ctx.pieces[k]
            n = e - s
            if leave is not None and dfinals is not None:  # dL/dh_{e-1} += dL/d(final state)
                rows, ids = leave
                carry = carry.index_add(0, rows, dfinals[ids].reshape(-1, *state[1:]))
            dt_c, u_c, dy_c, B_c = grp(dt[s:e]), grp(u_t[s:e]), grp(dout[s:e]), B_t[s:e]
            dH_, work_ = dH[:n], work[:n]
            if k == len(starts) - 1:
                dA_, H_ = last_dA[:n], last_H[: n + 1]
            else:  # recompute the states
                dA_, H_ = dA[:n], H[: n + 1]
                _chunk_states(
                    dt_c, u_c, A2, B_c, starts[k], dA_, H_, None if keep_t is None else keep_t[s:e]
                )
            # dL/dh_t = C_t dy_t + Ā_{t+1} dL/dh_{t+1}: the only sequential part
            torch.mul(dy_c[..., None], C_t[s:e, :, :, None, :], out=dH_)
            dH_[n - 1] += carry
            dHs, dAs = dH_.unbind(0), dA_.unbind(0)
            for t in range(n - 2, -1, -1):
                torch.addcmul(dHs[t], dAs[t + 1], dHs[t + 1], out=dHs[t])
            carry = dA_[0] * dH_[0]  # dL/dh_{s-1}
            if enter is not None:  # a sample's initial state entered here, not the carried one
                rows, ids = enter
                if d_samples is not None:
                    d_samples[ids] = carry[rows]
                carry = carry.index_fill(0, rows, 0.0)
            # the rest is parallel over the chunk; since Ā = exp(Δ A), dL/d(ΔA) = dL/dĀ * Ā
            dB[s:e] = torch.einsum("tbgcn,tbgc->tbgn", dH_, dt_c * u_c)
            dC[s:e] = torch.einsum("tbgcn,tbgc->tbgn", H_[1:], dy_c)
            dBx = torch.einsum("tbgcn,tbgn->tbgc", dH_, B_c)  # dL/d(Δ x): (n, b, g, c)
            dDeltaA = torch.mul(dH_, H_[:n], out=dH_).mul_(dA_)  # dH is no longer needed
            dA_param += torch.mul(dDeltaA, dt_c[..., None], out=work_).sum((0, 1))
            torch.add(dDeltaA.mul_(A_).sum(-1), dBx * u_c, out=grp(ddt[s:e]))
            grp(du[s:e]).addcmul_(dBx, dt_c)
        if ctx.softplus:  # Δ = softplus(δ + bias)
            ddt = torch.ops.aten.softplus_backward(ddt, dt_raw, 1.0, 20.0)
        dbias = None if delta_bias is None else ddt.sum((0, 1))
        # back to (b, ..., L)
        t_last = lambda M: None if M is None else M.permute(*range(1, M.dim()), 0)  # noqa: E731
        return (
            t_last(du),
            t_last(ddt),
            dA_param.reshape(dim, dstate),
            t_last(dB),
            t_last(dC),
            dD,
            t_last(dz),
            dbias,
            carry.reshape(batch, dim, dstate),
            None,
            None,
            None,
            None if d_samples is None else d_samples.reshape(d_samples.shape[0], dim, dstate),
        )


def selective_scan_torch(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_final_state=False,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """Fast pure-PyTorch selective scan (:class:`SelectiveScanFn`); same arguments and results as
    the reference. Without ``seq_idx`` the scan runs exactly as before (no reset factor
    anywhere)."""
    spans = _check(
        u,
        delta,
        A,
        B,
        C,
        initial_state,
        seq_idx,
        initial_sample_states,
        return_sample_states,
        return_final_state,
    )
    batch, dim, _ = u.shape
    f = lambda t: None if t is None else widen(t)  # noqa: E731
    h0 = (
        u.new_zeros(batch, dim, A.shape[1], dtype=wide_dtype(u))
        if initial_state is None or spans is not None
        else widen(initial_state)
    )
    keep = None if seq_idx is None else (~resets(seq_idx)).float()  # (b, L)
    inits = None
    if spans is not None:  # per-sample states: handed over at sample starts, no reset factor
        keep = None
        inits = _sample_inits(spans, seq_idx, initial_state, initial_sample_states)
        inits = None if inits is None else inits.to(h0.dtype)
    fn = (
        _compiled.CompiledScanFn if _compiled.enabled() else SelectiveScanFn
    )  # opt-in: compiled chunks
    y, h, finals = fn.apply(
        widen(u),
        widen(delta),
        widen(A),
        widen(_grouped(B)),
        widen(_grouped(C)),
        f(D),
        f(z),
        f(delta_bias),
        h0,
        delta_softplus,
        keep,
        spans,
        inits,
    )
    # the scan works time-major; y comes back in u's layout (contiguous, or a channels-last view as
    # the mixers pass), like the reference and the kernel: one copy, which the next matmul would
    # make anyway
    channels_last = u.stride(1) == 1 and u.shape[1] > 1
    y = (y.transpose(1, 2) if channels_last else y).to(u.dtype).contiguous()
    y = y.transpose(1, 2) if channels_last else y
    return _results(y, h, finals, return_final_state, return_sample_states)


# --------------------------------------------------------------------------------------------
# cuda: mamba_ssm's fused kernel
# --------------------------------------------------------------------------------------------


def selective_scan_cuda(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_final_state=False,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """mamba_ssm's ``selective_scan_fn`` (no initial state and no seq_idx support there, hence no
    per-sample states either)."""
    _check(
        u,
        delta,
        A,
        B,
        C,
        initial_state,
        seq_idx,
        initial_sample_states,
        return_sample_states,
        return_final_state,
    )
    if initial_state is not None:
        raise _backend.BackendError(
            "the cuda selective_scan kernel has no initial_state; use backend 'torch'"
        )
    if seq_idx is not None:
        raise _backend.BackendError(
            "the cuda selective_scan kernel (mamba_ssm's selective_scan_fn) cannot "
            "reset its state inside a row, so it cannot take seq_idx; use backend "
            "'torch' (what an automatic choice does)"
        )
    fn = _backend.kernel_module("selective_scan").selective_scan_fn
    out = fn(
        u,
        delta,
        A,
        B,
        C,
        D=D,
        z=z,
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        return_last_state=return_final_state,
    )
    if return_final_state:
        y, h = out
        return y, widen(h)
    return out


# --------------------------------------------------------------------------------------------
# cpu: the fused C++ kernel (ssmkit.ops.s6_cpu)
# --------------------------------------------------------------------------------------------


def selective_scan_cpu(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_final_state=False,
    seq_idx=None,
):
    """The fused CPU kernel (:mod:`ssmkit.ops.s6_cpu`), built at its first call; same arguments
    and results as the reference. BackendError where it cannot be built or cannot take the
    inputs (float64)."""
    _check(u, delta, A, B, C, initial_state, seq_idx)
    return _s6_cpu.fused_scan(
        u,
        delta,
        A,
        _grouped(B),
        _grouped(C),
        D=D,
        z=z,
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        initial_state=initial_state,
        return_final_state=return_final_state,
        seq_idx=seq_idx,
    )


_IMPLS = {
    "reference": selective_scan_reference,
    "torch": selective_scan_torch,
    "cpu": selective_scan_cpu,
    "cuda": selective_scan_cuda,
}


def selective_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_final_state=False,
    backend=None,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """The Mamba-1 selective scan (Algorithm 2), dispatched to a backend.

    Args:
        u, delta: (batch, dim, seqlen); A: (dim, dstate), negative;
        B, C: (batch, dstate, seqlen) or (batch, ngroups, dstate, seqlen);
        D: (dim,) or None; z: (batch, dim, seqlen) or None; delta_bias: (dim,) or None;
        initial_state: (batch, dim, dstate) or None;
        seq_idx: (batch, seqlen) integer sample index of every position of packed rows,
        non-decreasing along each row, or None: the state is zeroed where it changes
        (:mod:`ssmkit.ops.packing`);
        initial_sample_states: (n_samples, dim, dstate) or None, only with seq_idx: the state each
        packed sample starts from (numbered as :func:`~ssmkit.ops.packing.sample_numbers`; not
        together with ``initial_state``).
    Returns:
        y: (batch, dim, seqlen) in u's dtype; with ``return_final_state`` also
        h_L: (batch, dim, dstate) in fp32; with ``return_sample_states`` (only with seq_idx) then
        every sample's final state, (n_samples, dim, dstate) in fp32. Each sample's outputs, final
        state and gradients are those of the sample run alone from its initial state.

    With ``seq_idx`` the ``cuda`` backend (automatic or forced) runs the ``torch`` path instead:
    mamba_ssm's selective_scan_fn has no reset input (the reset is never dropped), nor per-sample
    states. On CPU tensors the automatic choice is the fused C++ kernel (:mod:`ssmkit.ops.s6_cpu`)
    where it builds; per-sample states run the torch path.
    """
    name = _backend.select("selective_scan", u, backend=backend)
    if name == "cuda" and seq_idx is not None:
        name = "torch"  # the kernel cannot reset its state inside a row; the torch path can
    if (
        name == "cuda"
        and initial_state is not None
        and (backend or _backend.forced_backend()) != "cuda"
    ):
        name = "torch"  # the kernel cannot start from a state; the torch path can
    extra = {} if seq_idx is None else {"seq_idx": seq_idx}
    if initial_sample_states is not None or return_sample_states:
        extra.update(
            seq_idx=seq_idx,
            initial_sample_states=initial_sample_states,
            return_sample_states=return_sample_states,
        )
    if name == "cpu" and set(extra) - {"seq_idx"}:
        name = "torch"  # per-sample states: the torch path adds them (sample_pieces), forced or not
    if (
        name == "cpu"
        and not (backend or _backend.forced_backend())
        and (_s6_cpu.unsupported(u, A, B, initial_state) or _compiled.enabled())
    ):
        # what the fused CPU kernel does not take (float64, ...; forced, it says so), and the
        # opt-in compiled torch path, which an explicit compile_scan(True) asks for
        name = "torch"
    return _IMPLS[name](
        u,
        delta,
        A,
        B,
        C,
        D=D,
        z=z,
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        initial_state=initial_state,
        return_final_state=return_final_state,
        **extra,
    )
