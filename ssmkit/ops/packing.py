r"""Packed samples: ``seq_idx`` and what the ops derive from it.

For supervised fine-tuning several samples are packed into one row of a batch. A recurrent layer
would carry its state from one sample into the next; with ``seq_idx`` every op restarts at each
sample's first token, so a packed row gives the outputs of its samples run one by one.

Convention (mamba_ssm's ``mamba_chunk_scan_combined`` and causal-conv1d's ``causal_conv1d_fn``):
``seq_idx`` is an integer tensor (batch, seqlen) holding, for every position, the index of the
sample it belongs to within its row, non-decreasing along the row, e.g. ``[[0, 0, 0, 1, 1, 2]]``.
What the kernels do with it, and therefore every backend here:

* the conv: output t sums only the taps s with ``seq_idx[s] == seq_idx[t]`` (zeros left of a
  sample);
* the scans: no decay and no input cross a change of ``seq_idx``: the state is zeroed before
  position t when ``seq_idx[t] != seq_idx[t-1]``;
* ``initial_states`` belong to the sample numbered 0: they reach the positions before the first
  change only when ``seq_idx[:, 0] == 0`` (mamba_ssm's state passing starts from ``seq_idx = 0``),
  and the final state returned is the state after the row's last position, i.e. that of its last
  sample. causal-conv1d refuses initial states and final states together with seq_idx (ssmkit's conv
  takes neither).

The ops check the shape and dtype of ``seq_idx`` but not its values (reading them would synchronise
a GPU); :meth:`ssmkit.models.MambaLM.forward` checks that each row is non-negative and
non-decreasing. Negative values, which causal-conv1d's kernel reads as padding (output 0), are not
supported: give padding a sample index of its own (and labels -100). The kernels get seq_idx as
int32; any integer dtype is accepted here. Glossary: ``reset`` (batch, seqlen) bool, the state is
zeroed before position t; ``segment`` (batch, seqlen), the number of resets up to t: segment 0
continues the initial state, positions of one segment are one sample.

Per-sample states (mamba_ssm's varlen ``initial_states`` / ``return_varlen_states``, causal-conv1d's
``initial_states`` / ``return_final_states``): the samples of a packed batch are numbered 0..n-1 in
row-major order, a new number at every row start and every change of ``seq_idx`` (the order of
:func:`cu_seqlens`); :func:`sample_spans` gives each one's row and positions and
:func:`sample_numbers` each position's number. An op given one state per sample starts every sample
from its own state and can return every sample's final state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_seq_idx(seq_idx: torch.Tensor | None, batch: int, seqlen: int) -> None:
    """``seq_idx`` must be None or an integer tensor (batch, seqlen); a ValueError says what it
    got."""
    if seq_idx is None:
        return
    if not isinstance(seq_idx, torch.Tensor):
        raise ValueError(
            f"seq_idx must be an integer tensor (batch={batch}, seqlen={seqlen}); "
            f"got {type(seq_idx).__name__}"
        )
    if seq_idx.dtype.is_floating_point or seq_idx.dtype.is_complex or seq_idx.dtype == torch.bool:
        raise ValueError(
            f"seq_idx must hold integer sample indices (int32 as the kernels take, or int64); "
            f"got dtype {seq_idx.dtype}"
        )
    if tuple(seq_idx.shape) != (batch, seqlen):
        raise ValueError(
            f"seq_idx must be (batch={batch}, seqlen={seqlen}); got {tuple(seq_idx.shape)}"
        )


def resets(seq_idx: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen) bool: the state is zeroed before position t. t > 0: seq_idx changes at t; t =
    0: the row does not start with sample 0 (the initial state belongs to sample 0)."""
    prev = F.pad(seq_idx[:, :-1], (1, 0), value=0)
    return seq_idx != prev


def segments(seq_idx: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen) int64: how many resets happened up to and including t (0 = the initial
    state's segment). Two positions see each other iff their segments are equal."""
    return resets(seq_idx).long().cumsum(dim=1)


def positions_in_sample(seq_idx: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen) int64: each position's offset from the first token of its sample (0, 1, 2,
    ..., 0, 1, ...), what rotary embeddings see when the samples run one by one."""
    seqlen = seq_idx.shape[1]
    t = torch.arange(seqlen, device=seq_idx.device).expand_as(seq_idx)
    first = F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0), value=True)  # a sample starts at t
    return t - torch.where(first, t, torch.zeros_like(t)).cummax(dim=1).values


def cu_seqlens(seq_idx: torch.Tensor) -> torch.Tensor:
    """The rows flattened into one sequence of batch * seqlen positions, cut at every row start and
    every change of ``seq_idx``: (n_samples + 1,) int32 cumulative lengths (0, len_0, len_0 + len_1,
    ..., b·L), the varlen form mamba_ssm's Mamba-3 kernels take. Reads the values (a GPU sync)."""
    b, L = seq_idx.shape
    first = F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0), value=True).reshape(-1)
    starts = first.nonzero().reshape(-1)
    end = torch.tensor([b * L], device=seq_idx.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


def sample_numbers(seq_idx: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen) int64: the number of the packed sample each position belongs to, counted
    over the whole batch in row-major order (0..n-1; a row start always begins a new sample), the
    numbering of :func:`cu_seqlens` and of per-sample states."""
    first = F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0), value=True)
    return first.reshape(-1).long().cumsum(0).reshape(seq_idx.shape) - 1


def sample_spans(seq_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each packed sample lies: ``(row, start, end)``, three (n_samples,) int64 tensors in the
    numbering of :func:`sample_numbers`; sample i is ``seq_idx[row[i], start[i]:end[i]]`` (end
    exclusive). Reads the values (a GPU sync)."""
    L = seq_idx.shape[1]
    cu = cu_seqlens(seq_idx).long()
    begin, stop = cu[:-1], cu[1:]
    return begin // L, begin % L, (stop - 1) % L + 1


def check_sample_states(states, n_samples: int, shape: tuple, name: str = "initial_sample_states"):
    """``states`` must be a tensor (n_samples, *shape): one state per packed sample; a ValueError
    names what it got."""
    want = (n_samples, *shape)
    if not isinstance(states, torch.Tensor) or tuple(states.shape) != want:
        got = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
        raise ValueError(
            f"{name} must be one state per packed sample, {want} (n_samples={n_samples} "
            f"from seq_idx, row-major); got {got}"
        )


def seq_idx_from_position_ids(position_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """seq_idx (batch, seqlen) int32 from position ids that restart at ``start`` for every packed
    sample (as transformers' ``DataCollatorWithFlattening`` writes them, ``position_ids_start`` 0 by
    default): a new sample begins where the position id equals ``start``, and at the beginning of
    every row. A 1-D tensor is one row."""
    if (
        not isinstance(position_ids, torch.Tensor)
        or position_ids.dim() not in (1, 2)
        or position_ids.dtype.is_floating_point
        or position_ids.dtype == torch.bool
    ):
        got = (
            f"{tuple(position_ids.shape)} {position_ids.dtype}"
            if isinstance(position_ids, torch.Tensor)
            else type(position_ids).__name__
        )
        raise ValueError(
            f"position_ids must be an integer tensor (batch, seqlen) or (seqlen,); got {got}"
        )
    rows = position_ids if position_ids.dim() == 2 else position_ids[None]
    begins = rows == start
    if rows.shape[1]:
        begins[:, 0] = True
    return (begins.to(torch.int32).cumsum(dim=1, dtype=torch.int32) - 1).to(torch.int32)


__all__ = [
    "check_sample_states",
    "check_seq_idx",
    "cu_seqlens",
    "positions_in_sample",
    "resets",
    "sample_numbers",
    "sample_spans",
    "segments",
    "seq_idx_from_position_ids",
]
