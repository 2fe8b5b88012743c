r"""Per-sample states of packed rows for the chunked scans (SSD, Mamba-3), by linearity.

With ``seq_idx`` (:mod:`ssmkit.ops.packing`) each sample of a packed batch can start from its own
state (``initial_sample_states``) and return its own final state (``return_sample_states``). The
scans are linear in their state, so for sample i on positions s_i..e_i

$$ y_t = y^0_t + w_t\, C_t h^{(i)}_0, \qquad h_{e_i} = h^0_{e_i} + w_{e_i} h^{(i)}_0, \qquad
   w_t = \prod_{k=s_i}^{t} a_k, \qquad
   h^0_{e_i} = \sum_{s=s_i}^{e_i} \Big(\prod_{k=s+1}^{e_i} a_k\Big)\, \Delta_s x_s B_s^\top $$

y⁰ is what any backend's packed scan gives from zero states (a kernel's included) and the rest is
two passes over the tokens: every token reads its sample's state (:func:`read_states`, the
``C_t h_0`` term) and every sample sums its tokens' outer products (:func:`sum_outer`, h⁰). Both
cost one (headdim x dstate) product per token and head, as the state passing of the chunked scan
does, mostly as one matmul per sample, and keep no per-token copy of a state (short samples are
gathered in bounded blocks, and backward recomputes).

The products of a_k are differences of one prefix sum of log a (:func:`prefix_sum`), kept in fp64
(on the CPU for Apple's MPS, which has none): in fp32 the difference of two prefix sums over
thousands of steps loses the digits of a short span (segsum in :mod:`ssmkit.ops.ssd` avoids it for
the same reason). Mamba-3's equations, with its trapezoid and rotations, are in
:mod:`ssmkit.ops.mamba3`.

Layout: the rows flattened into T = batch·seqlen positions, the order of
:func:`ssmkit.ops.packing.cu_seqlens`, in which every sample is one contiguous span.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .packing import check_sample_state_keywords, cu_seqlens, sample_numbers

# read_states / sum_outer: a sample of at least MATMUL_TOKENS positions is one matmul with its
# state; shorter ones are taken in runs whose states are gathered per token, at most BLOCK_ELEMENTS
# elements at once (16 MiB in fp32).
MATMUL_TOKENS = 8
BLOCK_ELEMENTS = 1 << 22


class Samples(NamedTuple):
    """Where the samples of a packed batch lie in its T flattened positions."""

    n: int  # how many samples
    idx: torch.Tensor  # (T,) int64: the sample of every position
    first: torch.Tensor  # (n,) int64: the flat position of each sample's first token
    last: torch.Tensor  # (n,) int64: ... and of its last
    cu: tuple[int, ...]  # (n + 1,): the span boundaries on the host (blocks are cut there)

    def repeat(self, r: int) -> Samples:
        """The same samples over T·r positions ((position, r) flattened, e.g. Mamba-3's ranks)."""
        if r == 1:
            return self
        return Samples(
            self.n,
            self.idx.repeat_interleave(r),
            self.first * r,
            self.last * r + r - 1,
            tuple(c * r for c in self.cu),
        )


def samples(seq_idx: torch.Tensor) -> Samples:
    """The :class:`Samples` of ``seq_idx`` (batch, seqlen), numbered as
    :func:`~ssmkit.ops.packing.sample_numbers`. Reads the values (a GPU sync)."""
    cu = cu_seqlens(seq_idx).long()
    return Samples(
        int(cu.numel()) - 1,
        sample_numbers(seq_idx).reshape(-1),
        cu[:-1],
        cu[1:] - 1,
        tuple(cu.tolist()),
    )


def _fp64(v: torch.Tensor) -> torch.Tensor:
    """v in fp64, on the CPU where its device has no fp64 (Apple's MPS)."""
    return (v.cpu() if v.device.type == "mps" else v).double()


def prefix_sum(v: torch.Tensor) -> torch.Tensor:
    """(T, ...) -> (T + 1, ...) fp64: P[t] = v_0 + ... + v_{t-1} (P[0] = 0), so that v_s + ... +
    v_t = P[t+1] - P[s]; of log a, the product of a_k over k = s..t is exp(P[t+1] - P[s])."""
    return F.pad(_fp64(v).cumsum(0), (0,) * (2 * (v.dim() - 1)) + (1, 0))


def since_start(v: torch.Tensor, smp: Samples) -> torch.Tensor:
    """(T, ...) -> (T, ...) fp64 (on :func:`prefix_sum`'s device): v summed over the steps of each
    position's sample up to and including it."""
    P = prefix_sum(v)
    return P[1:] - P[smp.first.to(P.device)][smp.idx.to(P.device)]


def decays(log_a: torch.Tensor, smp: Samples, dtype: torch.dtype = torch.float32):
    """From log a (T, H): ``w`` (T, H), a_{s_i}···a_t from the sample's start through t (how much
    of the initial state is left at t); ``u`` (T, H), a_{t+1}···a_{e_i} (how much of step t's input
    is left at the sample's end); ``w_end`` (n, H), the whole sample's product. In ``dtype`` (the
    scan's: fp32, or fp64 for fp64 inputs), on log_a's device."""
    P = prefix_sum(log_a)
    idx, first, last = (t.to(P.device) for t in (smp.idx, smp.first, smp.last))
    start, end = P[first], P[last + 1]  # (n, H)
    back = dict(device=log_a.device, dtype=dtype)
    w = torch.exp(P[1:] - start[idx]).to(**back)
    u = torch.exp(end[idx] - P[1:]).to(**back)
    return w, u, torch.exp(end - start).to(**back)


def _pieces(smp: Samples, per_token: int) -> list[tuple[int, int, int | None]]:
    """How to cut the T positions: ``(start, end, i)``, a sample i long enough for a matmul with
    its state of its own, or ``(start, end, None)``, a run of short samples whose states are
    gathered per token (at most ``BLOCK_ELEMENTS`` gathered at once)."""
    step, cu, out, run = max(1, BLOCK_ELEMENTS // max(1, per_token)), smp.cu, [], None
    for i in range(smp.n):
        a, b = cu[i], cu[i + 1]
        if b - a >= MATMUL_TOKENS:
            if run is not None:
                out.append((run, a, None))
                run = None
            out.append((a, b, i))
        elif run is None:
            run = a
        elif b - run > step:
            out.append((run, a, None))
            run = a
    if run is not None:
        out.append((run, cu[-1], None))
    return out


def _contract(a, S, smp, pieces, over_n: bool) -> torch.Tensor:
    """over_n: y[t,g,m] = Σ_n a[t,g,n] S[i(t),g,m,n]; else y[t,g,n] = Σ_m a[t,g,m] S[i(t),g,m,n]."""
    G, M, N = S.shape[1:]
    out = a.new_empty(a.shape[0], G, M if over_n else N)
    one, each = ("tgn,gmn->tgm", "tgn,tgmn->tgm") if over_n else ("tgm,gmn->tgn", "tgm,tgmn->tgn")
    for lo, hi, i in pieces:
        if i is not None:
            out[lo:hi] = torch.einsum(one, a[lo:hi], S[i])
        else:
            out[lo:hi] = torch.einsum(each, a[lo:hi], S[smp.idx[lo:hi]])
    return out


def _outer(v, k, smp, pieces) -> torch.Tensor:
    """S[i,g,m,n] = Σ_{t in sample i} v[t,g,m] k[t,g,n]."""
    G, M, N = v.shape[1], v.shape[2], k.shape[2]
    out = v.new_zeros(smp.n, G, M, N)
    for lo, hi, i in pieces:
        if i is not None:
            out[i] = torch.einsum("tgm,tgn->gmn", v[lo:hi], k[lo:hi])
        else:
            out.index_add_(0, smp.idx[lo:hi], torch.einsum("tgm,tgn->tgmn", v[lo:hi], k[lo:hi]))
    return out


class _Read(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, S, smp, pieces):
        ctx.save_for_backward(q, S)
        ctx.smp, ctx.pieces = smp, pieces
        return _contract(q, S, smp, pieces, over_n=True)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        q, S = ctx.saved_tensors
        smp, pieces = ctx.smp, ctx.pieces
        dq = _contract(dy, S, smp, pieces, over_n=False) if ctx.needs_input_grad[0] else None
        dS = _outer(dy, q, smp, pieces) if ctx.needs_input_grad[1] else None
        return dq, dS, None, None


class _Outer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, k, smp, pieces):
        ctx.save_for_backward(v, k)
        ctx.smp, ctx.pieces = smp, pieces
        return _outer(v, k, smp, pieces)

    @staticmethod
    @once_differentiable
    def backward(ctx, dS):
        v, k = ctx.saved_tensors
        smp, pieces = ctx.smp, ctx.pieces
        dv = _contract(k, dS, smp, pieces, over_n=True) if ctx.needs_input_grad[0] else None
        dk = _contract(v, dS, smp, pieces, over_n=False) if ctx.needs_input_grad[1] else None
        return dv, dk, None, None


def read_states(q: torch.Tensor, S: torch.Tensor, smp: Samples) -> torch.Tensor:
    """Every position reads its sample's state: q (T, G, N), S (n, G, M, N) -> (T, G, M),
    y[t] = S[i(t)] q[t] per group g. Differentiable in q and S (not twice)."""
    pieces = _pieces(smp, S[0].numel())
    return _Read.apply(q.contiguous(), S.contiguous(), smp, pieces)


def sum_outer(v: torch.Tensor, k: torch.Tensor, smp: Samples) -> torch.Tensor:
    """Every sample sums its positions' outer products: v (T, G, M), k (T, G, N) -> (n, G, M, N).
    Differentiable in v and k (not twice)."""
    pieces = _pieces(smp, v.shape[1] * v.shape[2] * k.shape[2])
    return _Outer.apply(v.contiguous(), k.contiguous(), smp, pieces)


def check_mode(
    seq_idx,
    initial_states,
    initial_sample_states,
    return_sample_states: bool,
    return_final_states: bool,
) -> bool:
    """Whether a scan runs with per-sample states: the one check every op uses
    (:func:`ssmkit.ops.packing.check_sample_state_keywords`) with the SSD's and Mamba-3's names."""
    return check_sample_state_keywords(
        seq_idx,
        initial_sample_states,
        return_sample_states,
        initial_states,
        "initial_states",
        return_final_states,
        "return_final_states",
    )


def row_last(seq_idx: torch.Tensor) -> torch.Tensor:
    """(batch,) int64: the number of every row's last sample (whose final state is the row's)."""
    return sample_numbers(seq_idx)[:, -1]


__all__ = [
    "Samples",
    "check_mode",
    "decays",
    "prefix_sum",
    "read_states",
    "row_last",
    "samples",
    "since_start",
    "sum_outer",
]
