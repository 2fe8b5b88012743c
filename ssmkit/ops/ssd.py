r"""The Mamba-2 state-space dual (SSD), "Transformers are SSMs" (Dao & Gu, 2024).

Glossary (code name -> paper symbol):

    x       x      input, (batch, seqlen, nheads, headdim): P = headdim channels per head
    dt      Δ      step size per head and time, dt = clamp(softplus(dt_raw + dt_bias), *dt_limit)
    A       a      one negative scalar per head: the state matrix is a * I
                   (section 3.2, "scalar SSM")
    B, C    B, C   (batch, seqlen, ngroups, dstate); head h reads group h // (nheads // ngroups)
    D       D      skip connection, per head (nheads,) or per channel (nheads, headdim)
    z       z      gate, y *= silu(z)
    h       h      state per head, (batch, nheads, headdim, dstate)

With a_t = exp(Δ_t A) the recurrence (paper eq. 1 with a scalar A) is

$$ h_t = a_t\, h_{t-1} + \Delta_t\, x_t B_t^\top, \qquad y_t = h_t C_t + D x_t $$

and its dual, the quadratic "masked attention" form (section 3, eq. 16 / SSD):

$$ y = (L \circ C B^\top)\,(\Delta \cdot x), \qquad
   L_{ts} = \prod_{k=s+1}^{t} a_k \ (t \ge s),\ 0 \text{ otherwise} $$

The chunked algorithm (section 6) splits the sequence into chunks of Q steps: the quadratic
form inside each chunk, the recurrence across chunk boundaries. Three functions implement the
three views and must agree: :func:`ssd_reference` (recurrence), :func:`ssd_quadratic` (dual),
:func:`ssd_chunked` (the ``torch`` backend). Shapes follow mamba_ssm's
``mamba_chunk_scan_combined``.

Packed samples (``seq_idx``, :mod:`ssmkit.ops.packing`): h_{t-1} is replaced by 0 where seq_idx
changes, so no decay and no input cross a sample boundary; in the dual form L_ts = 0 unless s and t
are one sample. ``initial_states`` reach only sample 0 (when the row starts with it), and the final
state is the last sample's: mamba_ssm's semantics.

Training memory: under autograd :func:`ssd_chunked` keeps every chunk's intermediates for the
backward (the (Q, Q) decay blocks and scores, the einsums' operands, every chunk's states: tens of
times the inputs' bytes per token). :func:`ssd_chunked_recompute` gives the same values and
gradients keeping only its inputs and one state per segment of whole chunks, and recomputes one
segment at a time in the backward (gradient checkpointing over time, :mod:`ssmkit.ops.recompute`;
mamba_ssm's kernels likewise save chunk states and recompute the rest). The torch backend of
:func:`ssd_scan` takes it for calls of more than :data:`RECOMPUTE_FROM` tokens;
:func:`ssd_recompute` forces it on or off.

Per-sample states (mamba_ssm's varlen ``return_varlen_states``): ``initial_sample_states`` (n,
nheads, headdim, dstate) gives every packed sample its own h_{-1}, ``return_sample_states`` returns
every sample's last h, numbered as :func:`ssmkit.ops.packing.sample_numbers`. The reference runs the
recurrence from each sample's state; the other views add the states by linearity to their
zero-state packed scan (:mod:`ssmkit.ops.sample_states`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange

from .. import checks
from . import backend as _backend
from . import compiled as _compiled
from . import sample_states as _samples
from .packing import (
    check_sample_states,
    check_seq_idx,
    cu_seqlens,
    positions_in_sample,
    resets,
    sample_numbers,
    segments,
)
from .precision import widen
from .recompute import scan_in_segments, segment_bounds

LOG2_E = 1.0 / math.log(2.0)

# The torch backend's chunk on CPUs. The result does not depend on the chunk (each choice computes
# the same sums), only the cost does: per token the diagonal blocks cost ~Q (N + H P) multiply-adds
# and the states passed between chunks ~2 H P N, so a short chunk does less work; below ~64 the
# per-chunk loop's overhead wins. Measured fwd+bwd at L = 16K (8 heads of 32, N = 64, 2 cores): Q =
# 256 0.85 s, 128 0.39 s, 64 0.21 s, 32 0.26 s. GPUs and the kernels keep the model's chunk_size
# (256: tensor-core tiles).
CPU_CHUNK_SIZE = 64

# The torch backend's SSD under autograd keeps every chunk's intermediates for the backward, tens of
# times its inputs' bytes per token. For calls of more than RECOMPUTE_FROM tokens (batch x seqlen:
# what those intermediates grow with) ssd_scan runs ssd_chunked_recompute instead: only the inputs
# and one state per segment of RECOMPUTE_SEGMENT steps are kept, and one segment's intermediates
# at a time are recomputed in the backward. That costs one more forward of the scan, a third of its
# forward + backward, at every length, where the memory it saves grows with the tokens; so calls
# up to RECOMPUTE_FROM tokens keep the faster plain path (the CPU speed benchmarks' 8 x 256 and
# 1 x 2048 among them), longer ones (the long-context runs) recompute. benchmarks/ssd_recompute.py
# measures both; ssd_recompute() forces either path. A segment of 2048 steps runs as fast as
# longer ones and keeps one segment's intermediates small.
RECOMPUTE_SEGMENT = 2048
RECOMPUTE_FROM = 2048
_RECOMPUTE: bool | None = None  # None: automatic (RECOMPUTE_FROM); True / False: forced


def ssd_recompute(enabled: bool | None = None) -> None:
    """Force the torch backend of :func:`ssd_scan` to recompute in the backward
    (:func:`ssd_chunked_recompute`, ``True``) or to keep autograd's intermediates
    (:func:`ssd_chunked`, ``False``) at every sequence length, for this process; ``None`` restores
    the automatic choice (recompute above :data:`RECOMPUTE_FROM` tokens a call). The compiled scan
    (:func:`ssmkit.ops.compile_scan`) and per-sample states keep their own paths."""
    global _RECOMPUTE
    if enabled not in (None, True, False):
        raise ValueError(f"ssd_recompute takes True, False or None (automatic); got {enabled!r}")
    _RECOMPUTE = enabled


def recomputes(tokens: int) -> bool:
    """Whether :func:`ssd_scan`'s torch backend recomputes for a call of ``tokens`` positions
    (batch x seqlen)."""
    return tokens > RECOMPUTE_FROM if _RECOMPUTE is None else _RECOMPUTE


def _check(x, dt, A, B, C, initial_states, seq_idx=None):
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seqlen, nheads, headdim); got {tuple(x.shape)}")
    batch, seqlen, nheads, headdim = x.shape
    if tuple(dt.shape) != (batch, seqlen, nheads):
        raise ValueError(
            f"dt must be (batch={batch}, seqlen={seqlen}, nheads={nheads}); got {tuple(dt.shape)}"
        )
    if tuple(A.shape) != (nheads,):
        raise ValueError(f"A must be (nheads={nheads},); got {tuple(A.shape)}")
    for name, M in (("B", B), ("C", C)):
        if (
            M.dim() != 4
            or M.shape[:2] != (batch, seqlen)
            or nheads % M.shape[2] != 0
            or M.shape != B.shape
        ):
            raise ValueError(
                f"{name} must be (batch={batch}, seqlen={seqlen}, ngroups, dstate) "
                "with ngroups dividing "
                f"nheads={nheads}, and B and C alike; got B {tuple(B.shape)}, C {tuple(C.shape)}"
            )
    dstate = B.shape[3]
    if initial_states is not None and tuple(initial_states.shape) != (
        batch,
        nheads,
        headdim,
        dstate,
    ):
        raise ValueError(
            f"initial_states must be (batch={batch}, nheads={nheads}, headdim={headdim}, "
            f"dstate={dstate}); "
            f"got {tuple(initial_states.shape)}"
        )
    check_seq_idx(seq_idx, batch, seqlen)


def discretize_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """Δ = clamp(softplus(dt + dt_bias), *dt_limit) in fp32, as the official kernels.
    (batch, seqlen, nheads)."""
    dt = widen(dt)
    if dt_bias is not None:
        dt = dt + widen(dt_bias)
    if dt_softplus:
        dt = F.softplus(dt)  # threshold 20, as the kernels
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _heads_view(M, nheads):
    """(batch, L, ngroups, dstate) -> (batch, L, nheads, dstate): each head sees its group's
    vector."""
    return widen(M).repeat_interleave(nheads // M.shape[2], dim=2)


def _skip_and_gate(y, x, D, z):
    """y + D x, then y * silu(z). y, x, z: (batch, L, nheads, headdim); D: (nheads,) or (nheads,
    headdim)."""
    if D is not None:
        Dv = widen(D) if D.dim() == 2 else widen(D)[:, None]
        y = y + widen(x) * Dv
    if z is not None:
        y = y * F.silu(widen(z))
    return y


def _with_sample_states(
    run, x, dt, A, B, C, kw, initial_sample_states, return_sample_states, return_final_states
):
    """Per-sample states by linearity (:mod:`ssmkit.ops.sample_states`) around a zero-state packed
    scan: ``run(z, finals) -> (y0, sample final states from zero or None)`` runs the backend with
    the op's keywords ``kw`` (D, z, dt_bias, dt_softplus, dt_limit, seq_idx) but the gate z it is
    given (None while an initial state's term is still to be added before the gate). Returns what
    :func:`ssd_scan` returns."""
    z, seq_idx = kw["z"], kw["seq_idx"]
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    T, h0 = batch * seqlen, initial_sample_states
    smp = _samples.samples(seq_idx)
    if h0 is not None:
        check_sample_states(h0, smp.n, (nheads, headdim, dstate))
    want = return_sample_states or return_final_states
    y, finals = run(z if h0 is None else None, want)
    dt = discretize_dt(dt, kw["dt_bias"], kw["dt_softplus"], kw["dt_limit"])
    w, u, w_end = _samples.decays((dt * widen(A)).reshape(T, nheads), smp, dt.dtype)
    if h0 is not None:  # + w_t C_t h0: h0 decayed from the sample's start, read by C
        h0 = widen(h0)
        Ch0 = _samples.read_states(
            widen(C).reshape(T, ngroups, dstate), h0.reshape(smp.n, ngroups, -1, dstate), smp
        )
        y = widen(y) + (Ch0.reshape(T, nheads, headdim) * w[..., None]).reshape(x.shape)
        y = _skip_and_gate(y, x, None, z).to(x.dtype)
    if not want:
        return y
    if finals is None:  # Σ_s (a_{s+1}···a_e) Δ_s x_s B_sᵀ over each sample
        v = widen(x).reshape(T, nheads, headdim) * (u * dt.reshape(T, nheads))[..., None]
        finals = _samples.sum_outer(
            v.reshape(T, ngroups, -1), widen(B).reshape(T, ngroups, dstate), smp
        ).reshape(smp.n, nheads, headdim, dstate)
    if h0 is not None:
        finals = finals + w_end[..., None, None] * h0
    return y, (finals if return_sample_states else finals[_samples.row_last(seq_idx)])


def _torch_run(impl, x, dt, A, B, C, chunk_size, kw):
    """:func:`_with_sample_states`'s ``run`` for a torch path ``impl`` (ssd_chunked's
    signature)."""
    return lambda z, finals: (impl(x, dt, A, B, C, chunk_size, **{**kw, "z": z}), None)


def _op_keywords(D, z, dt_bias, dt_softplus, dt_limit, seq_idx):
    return dict(
        D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=seq_idx
    )


# --------------------------------------------------------------------------------------------
# reference: the recurrence, one step at a time
# --------------------------------------------------------------------------------------------


def ssd_reference(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=None,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    initial_states=None,
    return_final_states=False,
    dt_limit=(0.0, math.inf),
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_t^T, y_t = h_t C_t (h_{t-1} = 0 where ``seq_idx``
    changes, or the sample's own state with ``initial_sample_states``). ``chunk_size`` is ignored
    here."""
    _check(x, dt, A, B, C, initial_states, seq_idx)
    per_sample = _samples.check_mode(
        seq_idx, initial_states, initial_sample_states, return_sample_states, return_final_states
    )
    batch, seqlen, nheads, headdim = x.shape
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch, xf = _heads_view(B, nheads), _heads_view(C, nheads), widen(x)
    h = (
        xf.new_zeros(batch, nheads, headdim, B.shape[3])
        if initial_states is None
        else widen(initial_states)
    )
    keep = None if seq_idx is None else (~resets(seq_idx)).float()  # 0: a new sample starts at t
    if per_sample:  # h_{-1} of every sample: its own state (or 0), set at its first step
        number = sample_numbers(seq_idx)
        n_samples = int(number[-1, -1]) + 1
        start = positions_in_sample(seq_idx) == 0
        last = F.pad(start[:, 1:], (0, 1), value=True)  # the next step starts a sample
        ends = {}
        for r, t in last.nonzero().tolist():
            ends.setdefault(t, []).append(r)
        if initial_sample_states is None:
            init = h.new_zeros(n_samples, *h.shape[1:])
        else:
            check_sample_states(initial_sample_states, n_samples, tuple(h.shape[1:]))
            init = widen(initial_sample_states)
        finals = [None] * n_samples
    ys = []
    for t in range(seqlen):
        a = torch.exp(dt[:, t] * widen(A))  # a_t: (batch, nheads)
        if per_sample:
            h = torch.where(start[:, t, None, None, None], init[number[:, t]], h)
        elif keep is not None:
            h = keep[:, t, None, None, None] * h
        h = a[:, :, None, None] * h + torch.einsum("bh,bhp,bhn->bhpn", dt[:, t], xf[:, t], Bh[:, t])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))  # y_t = h_t C_t
        if per_sample:
            for r in ends.get(t, ()):
                finals[int(number[r, t])] = h[r]
    y = _skip_and_gate(torch.stack(ys, dim=1), x, D, z).to(x.dtype)
    if per_sample and (return_sample_states or return_final_states):
        states = torch.stack(finals)
        return y, (states if return_sample_states else states[_samples.row_last(seq_idx)])
    return (y, h) if return_final_states else y


# --------------------------------------------------------------------------------------------
# the dual: quadratic, attention-like form
# --------------------------------------------------------------------------------------------


def segsum(a: torch.Tensor) -> torch.Tensor:
    """Stable segment sums: out[..., t, s] = a[..., s+1] + ... + a[..., t] for t >= s, -inf above.

    a: (..., T) -> (..., T, T). exp(segsum(log a)) is the 1-semiseparable mask L of the paper.
    Computed as a masked cumulative sum (not as a difference of prefix sums, which cancels badly).
    """
    T = a.shape[-1]
    a = a[..., None].expand(*a.shape, T)  # a[..., k, s] = a_k
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)
    out = torch.cumsum(a.masked_fill(~strict, 0), dim=-2)  # sum over s < k <= t
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device))
    return out.masked_fill(~causal, -math.inf)


def ssd_quadratic(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=None,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    initial_states=None,
    return_final_states=False,
    dt_limit=(0.0, math.inf),
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """y = (L ∘ C Bᵀ)(Δ x) over the whole sequence: O(seqlen²) memory, the "attention" view. With
    ``seq_idx`` L is block diagonal: L_ts = 0 unless s and t are one sample; per-sample states are
    added by linearity."""
    _check(x, dt, A, B, C, initial_states, seq_idx)
    if _samples.check_mode(
        seq_idx, initial_states, initial_sample_states, return_sample_states, return_final_states
    ):
        kw = _op_keywords(D, z, dt_bias, dt_softplus, dt_limit, seq_idx)
        run = _torch_run(ssd_quadratic, x, dt, A, B, C, chunk_size, kw)
        return _with_sample_states(
            run,
            x,
            dt,
            A,
            B,
            C,
            kw,
            initial_sample_states,
            return_sample_states,
            return_final_states,
        )
    batch, seqlen, nheads, headdim = x.shape
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch, xf = _heads_view(B, nheads), _heads_view(C, nheads), widen(x)
    logA = rearrange(dt * widen(A), "b l h -> b h l")  # log a_t
    L = torch.exp(segsum(logA))  # (b, h, t, s)
    decay_from_start = torch.exp(torch.cumsum(logA, dim=-1))  # prod_{k<=t} a_k
    if seq_idx is not None:
        seg = segments(seq_idx)  # (b, L)
        L = L * (seg[:, None, :, None] == seg[:, None, None, :])  # one sample only
        decay_from_start = decay_from_start * (seg == 0)[:, None, :]  # h_0 reaches sample 0 only
    scores = torch.einsum("bthn,bshn->bhts", Ch, Bh)  # C_t · B_s
    y = torch.einsum("bhts,bsh,bshp->bthp", L * scores, dt, xf)
    if initial_states is not None:
        y = y + torch.einsum("bht,bthn,bhpn->bthp", decay_from_start, Ch, widen(initial_states))
    y = _skip_and_gate(y, x, D, z).to(x.dtype)
    if not return_final_states:
        return y
    decay_to_end = L[:, :, -1, :]  # prod_{s<k<=L} a_k
    h = torch.einsum("bhs,bsh,bshp,bshn->bhpn", decay_to_end, dt, xf, Bh)
    if initial_states is not None:
        h = h + decay_from_start[:, :, -1, None, None] * widen(initial_states)
    return y, h


# --------------------------------------------------------------------------------------------
# torch backend: the chunked algorithm (section 6)
# --------------------------------------------------------------------------------------------


def ssd_chunked(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=256,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    initial_states=None,
    return_final_states=False,
    dt_limit=(0.0, math.inf),
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """SSD by chunks of ``chunk_size``: quadratic inside a chunk, recurrence between chunks.

    Heads are kept grouped as (ngroups, heads per group) so B and C are never copied per head. With
    ``seq_idx`` every term is masked to one sample, as mamba_ssm's kernels do: inside a chunk (s, t)
    pairs of one sample, a chunk's own state from its last sample's steps, the state entering a
    chunk only to the steps of the sample it belongs to and across a chunk only when no sample
    starts in it. Per-sample states are added by linearity (:mod:`ssmkit.ops.sample_states`).
    """
    _check(x, dt, A, B, C, initial_states, seq_idx)
    if _samples.check_mode(
        seq_idx, initial_states, initial_sample_states, return_sample_states, return_final_states
    ):
        kw = _op_keywords(D, z, dt_bias, dt_softplus, dt_limit, seq_idx)
        run = _torch_run(ssd_chunked, x, dt, A, B, C, chunk_size, kw)
        return _with_sample_states(
            run,
            x,
            dt,
            A,
            B,
            C,
            kw,
            initial_sample_states,
            return_sample_states,
            return_final_states,
        )
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    Q = int(chunk_size)
    if Q < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size}")
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    pad = (-seqlen) % Q  # padded steps have Δ = 0: no input, no decay
    xf = F.pad(widen(x), (0, 0, 0, 0, 0, pad))
    dt_p = F.pad(dt, (0, 0, 0, pad))
    Bf = F.pad(widen(B), (0, 0, 0, 0, 0, pad))
    Cf = F.pad(widen(C), (0, 0, 0, 0, 0, pad))
    # chunks: c = chunk index, l / s = position in chunk, g = group, h = head in group
    xc = rearrange(xf * dt_p[..., None], "b (c l) (g h) p -> b c l g h p", l=Q, g=ngroups)  # Δ x
    Bc = rearrange(Bf, "b (c l) g n -> b c l g n", l=Q)
    Cc = rearrange(Cf, "b (c l) g n -> b c l g n", l=Q)
    logA = rearrange(dt_p * widen(A), "b (c l) (g h) -> b g h c l", l=Q, g=ngroups)
    cum = torch.cumsum(logA, dim=-1)  # within-chunk prefix
    if (
        seq_idx is not None
    ):  # segc: each step's sample (padded steps: the last's); enter: the entering
        seg = segments(seq_idx)
        segc = rearrange(
            torch.cat([seg, seg[:, -1:].expand(-1, pad)], dim=1), "b (c l) -> b c l", l=Q
        )
        enter = F.pad(segc[:, :-1, -1], (1, 0), value=0)  # (b, c); chunk 0: sample 0

    # 1. diagonal blocks: y = (L ∘ C Bᵀ)(Δ x) inside each chunk. L_ls = exp(cum_l - cum_s) for l >=
    # s: the official kernel's form (chunk_scan: exp(dA_cs_m - dA_cs_k), fp32). Within one chunk the
    # prefix sums stay small enough that the difference loses < 1e-5 relative, and it costs one
    # subtraction where segsum's masked cumsum over (Q, Q) costs a scan and its backward a flip and
    # a second scan.
    # exp(v) = 2^(v log2 e): on CPUs exp2 is several times cheaper than exp over these (Q, Q)
    # blocks.
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=x.device))
    if seq_idx is not None:  # (b, 1, 1, c, l, s)
        causal = (causal & (segc[..., :, None] == segc[..., None, :]))[:, None, None]
    cum2 = cum * LOG2_E
    L = torch.exp2(
        (cum2[..., :, None] - cum2[..., None, :]).masked_fill(~causal, -math.inf)
    )  # (b,g,h,c,l,s)
    scores = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)  # shared by a group's heads
    y = torch.einsum("bghcls,bgcls,bcsghp->bclghp", L, scores, xc)

    # 2. each chunk's own final state, as if it started from zero
    decay_to_end = torch.exp(cum[..., -1:] - cum)  # (b, g, h, c, l)
    if seq_idx is not None:  # the chunk's last sample only
        decay_to_end = decay_to_end * (segc == segc[..., -1:])[:, None, None]
    states = torch.einsum("bghcl,bclgn,bclghp->bcghpn", decay_to_end, Bc, xc)

    # 3. pass states across chunk boundaries: h_c = a_chunk(c-1) h_{c-1} + states(c-1)
    h = (
        xf.new_zeros(batch, ngroups, nheads // ngroups, headdim, dstate)
        if initial_states is None
        else rearrange(widen(initial_states), "b (g h) p n -> b g h p n", g=ngroups)
    )
    # unbind, not states[:, c]: the backward of an indexed slice writes a zero tensor of the whole
    # input, which over c chunks is O(c^2) memory traffic; unbind's backward is one stack.
    chunk_decay = torch.exp(cum[..., -1])
    if seq_idx is not None:  # a sample starting inside chunk c cuts the chain
        chunk_decay = chunk_decay * (segc[..., -1] == enter)[:, None, None]
    chunk_decay = chunk_decay[..., None, None].unbind(-3)  # c x (b, g, h, 1, 1)
    entering = []
    for decay, state in zip(chunk_decay, states.unbind(1)):
        entering.append(h)
        h = decay * h + state
    entering = torch.stack(entering, dim=1)  # (b, c, g, h, p, n)

    # 4. off-diagonal blocks: the state entering each chunk, decayed to each position, read by C
    decay_in = torch.exp(cum)
    if seq_idx is not None:  # only the steps of the entering state's sample
        decay_in = decay_in * (segc == enter[..., None])[:, None, None]
    y = y + torch.einsum("bclgn,bcghpn,bghcl->bclghp", Cc, entering, decay_in)
    y = rearrange(y, "b c l g h p -> b (c l) (g h) p")[:, :seqlen]
    y = _skip_and_gate(y, x, D, z).to(x.dtype)
    if not return_final_states:
        return y
    return y, rearrange(h, "b g h p n -> b (g h) p n")


# --------------------------------------------------------------------------------------------
# torch backend, long sequences: the chunked algorithm by segments, recomputed in the backward
# --------------------------------------------------------------------------------------------


def _local_segments(seq_idx, bounds):
    """seq_idx renumbered per segment so that the segment's first step is 0 when it continues the
    sample of the step before it, 1 when a sample starts there: ssd_chunked's convention for its
    initial state (:func:`ssmkit.ops.packing.resets`) then passes the entering state on, or masks it
    out, row by row. Within a segment the changes are seq_idx's. (batch, seqlen) int64."""
    seg = segments(seq_idx)
    base = torch.zeros_like(seg)
    for s, e in bounds[1:]:
        base[:, s:e] = seg[:, s - 1 : s]
    return seg - base


def ssd_chunked_recompute(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=256,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    initial_states=None,
    return_final_states=False,
    dt_limit=(0.0, math.inf),
    seq_idx=None,
    segment=None,
):
    """:func:`ssd_chunked` over segments of ``segment`` steps (whole chunks), whose backward keeps
    only the inputs and the state entering each segment and recomputes one segment's forward at a
    time (:func:`ssmkit.ops.recompute.scan_in_segments`): the same outputs, final state and
    gradients (to fp32 rounding), with O(L) memory for the backward instead of ssd_chunked's
    intermediates (the (Q, Q) decay blocks and scores, the einsums' copies, every chunk's states),
    for one more forward's compute.

    Shapes and keywords as :func:`ssd_chunked`; ``segment``: steps per segment, rounded down to a
    multiple of ``chunk_size`` (None: :data:`RECOMPUTE_SEGMENT`). With ``seq_idx`` a segment whose
    first step starts a sample gets no state from the segment before (:func:`_local_segments`).
    Per-sample states (``initial_sample_states``, ``return_sample_states``) are not taken here:
    :func:`ssd_scan` runs them on :func:`ssd_chunked`, under autograd."""
    _check(x, dt, A, B, C, initial_states, seq_idx)
    Q = checks.integer(chunk_size, "chunk_size", minimum=1)
    segment = checks.integer(
        RECOMPUTE_SEGMENT if segment is None else segment, "segment", minimum=1
    )
    bounds = segment_bounds(x.shape[1], segment, Q)
    local = None if seq_idx is None else _local_segments(seq_idx, bounds)

    def run(h, seq, rest):
        xs, dts, Bs, Cs, zs, idx = seq
        A_, D_, bias = rest
        return ssd_chunked(
            xs,
            dts,
            A_,
            Bs,
            Cs,
            Q,
            D=D_,
            z=zs,
            dt_bias=bias,
            dt_softplus=dt_softplus,
            initial_states=h,
            return_final_states=True,
            dt_limit=dt_limit,
            seq_idx=idx,
        )

    y, h = scan_in_segments(run, initial_states, (x, dt, B, C, z, local), (A, D, dt_bias), bounds)
    return (y, h) if return_final_states else y


# --------------------------------------------------------------------------------------------
# cuda: mamba_ssm's Triton kernels
# --------------------------------------------------------------------------------------------


def ssd_cuda(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=256,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    initial_states=None,
    return_final_states=False,
    dt_limit=(0.0, math.inf),
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """mamba_ssm's ``mamba_chunk_scan_combined`` (``seq_idx`` passed as the int32, contiguous
    (batch, seqlen) tensor its Triton kernels read).

    Per-sample states: its initial states are one per row (for the row's sample 0), so the kernel
    runs the samples from zero states and their initial states are added by linearity in torch
    (:mod:`ssmkit.ops.sample_states`). The samples' final states come from its varlen form (the rows
    flattened to batch 1, ``cu_seqlens`` and ``return_varlen_states``) when no gradient is needed;
    that output has no backward, so under autograd they are summed in torch."""
    fn = _backend.kernel_module("ssd_scan").mamba_chunk_scan_combined
    if _samples.check_mode(
        seq_idx, initial_states, initial_sample_states, return_sample_states, return_final_states
    ):
        inputs = (x, dt, A, B, C, D, z, dt_bias, initial_sample_states)
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
        kw = _op_keywords(D, z, dt_bias, dt_softplus, dt_limit, seq_idx)

        def run(gate, finals):
            common = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit))
            if not finals or grad:
                y = fn(x, dt, A, B, C, chunk_size, z=gate, seq_idx=_int32(seq_idx), **common)
                return y, None
            b, L = seq_idx.shape
            flat = lambda t: None if t is None else t.reshape(1, b * L, *t.shape[2:])  # noqa: E731
            y, states = fn(
                flat(x),
                flat(dt),
                A,
                flat(B),
                flat(C),
                chunk_size,
                z=flat(gate),
                seq_idx=_int32(sample_numbers(seq_idx).reshape(1, b * L)),
                cu_seqlens=cu_seqlens(seq_idx),
                return_varlen_states=True,
                **common,
            )
            return y.reshape(x.shape), states

        return _with_sample_states(
            run,
            x,
            dt,
            A,
            B,
            C,
            kw,
            initial_sample_states,
            return_sample_states,
            return_final_states,
        )
    extra = {} if seq_idx is None else {"seq_idx": _int32(seq_idx)}
    return fn(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=D,
        z=z,
        dt_bias=dt_bias,
        initial_states=initial_states,
        dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit),
        return_final_states=return_final_states,
        **extra,
    )


def _int32(seq_idx):
    """seq_idx as the kernels read it: int32, contiguous."""
    return seq_idx.to(torch.int32).contiguous()


_IMPLS = {"reference": ssd_reference, "torch": ssd_chunked, "cuda": ssd_cuda}


def ssd_scan(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    initial_states=None,
    return_final_states=False,
    dt_limit=(0.0, math.inf),
    backend=None,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """The Mamba-2 SSD scan, dispatched to a backend.

    Args:
        x: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads); A: (nheads,), negative;
        B, C: (batch, seqlen, ngroups, dstate); D: (nheads,) or (nheads, headdim) or None;
        z: like x or None; dt_bias: (nheads,) or None;
        initial_states: (batch, nheads, headdim, dstate) or None;
        seq_idx: (batch, seqlen) integer sample index of every position of packed rows,
        non-decreasing along each row, or None: the state restarts at every sample
        (:mod:`ssmkit.ops.packing`);
        initial_sample_states: (n_samples, nheads, headdim, dstate) or None, with seq_idx only and
        instead of initial_states: every packed sample starts from its own state (samples numbered
        row-major as :func:`ssmkit.ops.packing.sample_numbers`), as if it ran alone as a batch of
        one with that initial state (mamba_ssm's varlen ``initial_states``).
    Returns:
        y like x (x's dtype); with ``return_final_states`` also the final state
        (batch, nheads, headdim, dstate) in fp32; with ``return_sample_states`` (seq_idx only, not
        with return_final_states) instead every sample's final state (n_samples, nheads, headdim,
        dstate) in fp32 (mamba_ssm's ``return_varlen_states``).

    ``chunk_size`` is the kernels' block length; the torch backend on a CPU uses at most
    :data:`CPU_CHUNK_SIZE` (the same sums, fewer operations); above :data:`RECOMPUTE_FROM` tokens
    (or as :func:`ssd_recompute` forces) it runs :func:`ssd_chunked_recompute`, whose backward keeps
    O(L) memory, not ssd_chunked's intermediates. Per-sample states cost two more
    passes over the tokens, each one (headdim x dstate) product per token and head
    (:mod:`ssmkit.ops.sample_states`).
    """
    name = _backend.select("ssd_scan", x, backend=backend)
    if name == "torch" and x.device.type == "cpu":
        chunk_size = min(int(chunk_size), CPU_CHUNK_SIZE)
    extra = {} if seq_idx is None else {"seq_idx": seq_idx}
    impl = _IMPLS[name]
    per_sample = initial_sample_states is not None or return_sample_states
    torch_long = name == "torch" and x.dim() == 4 and recomputes(x.shape[0] * x.shape[1])
    if torch_long and not per_sample and not _compiled.enabled():
        impl = ssd_chunked_recompute
    if name == "torch" and _compiled.enabled():  # opt-in: the whole chunked SSD compiled
        impl = functools.partial(_compiled.run, ssd_chunked)
        if _samples.check_mode(
            seq_idx,
            initial_states,
            initial_sample_states,
            return_sample_states,
            return_final_states,
        ):  # the zero-state scan compiled; the samples' terms, which read seq_idx, eager
            _check(x, dt, A, B, C, None, seq_idx)
            kw = _op_keywords(D, z, dt_bias, dt_softplus, dt_limit, seq_idx)
            run = _torch_run(impl, x, dt, A, B, C, chunk_size, kw)
            return _with_sample_states(
                run,
                x,
                dt,
                A,
                B,
                C,
                kw,
                initial_sample_states,
                return_sample_states,
                return_final_states,
            )
    if per_sample:
        extra.update(
            initial_sample_states=initial_sample_states, return_sample_states=return_sample_states
        )
    return impl(
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
        **extra,
    )
