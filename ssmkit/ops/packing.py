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
* ``initial_states`` (one per row) belong to the sample numbered 0: they reach the positions before
  the first change only when ``seq_idx[:, 0] == 0`` (mamba_ssm's state passing starts from
  ``seq_idx = 0``), and the final state returned is the state after the row's last position, i.e.
  that of its last sample. causal-conv1d refuses initial states and final states together with
  seq_idx; for states of every sample, see below.

The ops check the shape and dtype of ``seq_idx`` but not its values (reading them would synchronise
a GPU); :meth:`ssmkit.models.MambaLM.forward` checks that each row is non-decreasing. The ops
take no negative values; the model takes -1, causal-conv1d's mark for padding, and removes those
positions before its layers (they change no state and take no loss). The kernels get seq_idx as
int32; any integer dtype is accepted here. Glossary: ``reset`` (batch, seqlen) bool, the state is
zeroed before position t; ``segment`` (batch, seqlen), the number of resets up to t: segment 0
continues the initial state, positions of one segment are one sample.

Per-sample states (mamba_ssm's varlen ``initial_states`` / ``return_varlen_states``, causal-conv1d's
``initial_states`` / ``return_final_states``): the samples of a packed batch are numbered 0..n-1 in
row-major order, a new number at every row start and every change of ``seq_idx`` (the order of
:func:`cu_seqlens`); :func:`sample_spans` gives each one's row and positions and
:func:`sample_numbers` each position's number. An op given one state per sample starts every sample
from its own state and can return every sample's final state. The ops' keywords, the same for every
op and backend, valid only with ``seq_idx`` (:func:`sample_state_spans` checks them):

* ``initial_sample_states``: (n_samples, *state) -- every sample, the first of each row included,
  starts from its own state (a ValueError together with the op's per-row ``initial_state(s)``);
* ``return_sample_states=True``: the op also returns the (n_samples, *state) final states, each
  sample's state after its last position. A sample that started from the per-row initial state (no
  ``initial_sample_states``) or from zeros ends where it would alone.

The result equals each sample run alone as a batch-1 call from its state (outputs, final states and
gradients, the initial states' included). State shapes: the conv (dim, width - 1), the last inputs
left of the sample, as causal-conv1d's ``initial_states`` (a sample shorter than width - 1 keeps
part of its initial conv state in its final one); the S6 scan (dim, dstate), fp32 as its final
state.
"""

from __future__ import annotations

from typing import NamedTuple

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


def check_sample_state_keywords(
    seq_idx: torch.Tensor | None,
    initial_sample_states: torch.Tensor | None,
    return_sample_states: bool,
    initial_state: torch.Tensor | None = None,
    initial_state_name: str = "initial_state",
    return_final_state: bool = False,
    final_state_name: str = "return_final_state",
) -> bool:
    """Whether an op runs with per-sample states (the convention above); a ValueError names a
    combination that cannot be, without reading any values: sample states without ``seq_idx``;
    ``initial_sample_states`` next to the op's per-row initial state (named
    ``initial_state_name``), which it replaces; ``return_sample_states`` next to the op's per-row
    final state (``final_state_name``): a row's final state is its last sample's."""
    if initial_sample_states is None and not return_sample_states:
        return False
    if seq_idx is None:
        given = (
            "initial_sample_states" if initial_sample_states is not None else "return_sample_states"
        )
        raise ValueError(
            f"{given} needs seq_idx (batch, seqlen), from which the packed samples are numbered; "
            f"pass seq_idx, or {initial_state_name} for one sequence per row"
        )
    if initial_state is not None and initial_sample_states is not None:
        raise ValueError(
            f"{initial_state_name} and initial_sample_states cannot both be given: "
            f"initial_sample_states holds every sample's state, the first of each row included "
            f"(where {initial_state_name} would go); pass one of them"
        )
    if return_sample_states and return_final_state:
        raise ValueError(
            f"{final_state_name} and return_sample_states are exclusive: a row's final state is "
            "that of its last sample, sample_states[sample_numbers(seq_idx)[:, -1]]"
        )
    return True


def sample_state_spans(
    seq_idx: torch.Tensor | None,
    initial_sample_states: torch.Tensor | None,
    return_sample_states: bool,
    shape: tuple,
    initial_state: torch.Tensor | None = None,
    initial_state_name: str = "initial_state",
    return_final_state: bool = False,
):
    """:func:`check_sample_state_keywords`, then None when no per-sample state is used, else
    :func:`sample_spans` of ``seq_idx`` (one GPU sync) with ``initial_sample_states`` checked
    against ``shape``, one sample's state."""
    if not check_sample_state_keywords(
        seq_idx,
        initial_sample_states,
        return_sample_states,
        initial_state,
        initial_state_name,
        return_final_state,
    ):
        return None
    spans = sample_spans(seq_idx)
    if initial_sample_states is not None:
        check_sample_states(initial_sample_states, len(spans[0]), tuple(shape))
        if not initial_sample_states.dtype.is_floating_point:
            raise ValueError(
                f"initial_sample_states must be a floating-point tensor; got dtype "
                f"{initial_sample_states.dtype}"
            )
    return spans


class Piece(NamedTuple):
    """Steps ``start:end`` of a chunked scan (see :func:`sample_pieces`). ``enter``: (rows, sample
    numbers) of the samples that begin at ``start``; ``leave``: those that end at ``end`` (each
    None when there are none)."""

    start: int
    end: int
    enter: tuple[torch.Tensor, torch.Tensor] | None
    leave: tuple[torch.Tensor, torch.Tensor] | None


def sample_pieces(spans, seqlen: int, most: int) -> list[Piece]:
    """The steps 0..seqlen-1 of a chunked scan cut into pieces of at most ``most`` steps and at
    every sample start of every row (``spans`` from :func:`sample_spans`, or None: chunks of
    ``most`` only). Every sample then begins at a piece's first step and ends at a piece's last,
    so per-sample states cost only the state hand-over between pieces: a piece's entering state is
    the previous piece's final state, except in its ``enter`` rows, which take their new sample's
    initial state (no cumulative decay over a sample is ever formed); the final state of a
    ``leave`` row is its sample's. At most seqlen / most + n_samples pieces."""
    cuts = set(range(0, seqlen, most))
    enter: dict[int, list] = {}
    leave: dict[int, list] = {}
    device = None if spans is None else spans[0].device
    if spans is not None:
        for i, (r, s, e) in enumerate(zip(*(t.tolist() for t in spans))):
            cuts.add(s)
            enter.setdefault(s, []).append((r, i))
            leave.setdefault(e, []).append((r, i))

    def index(pairs):
        if not pairs:
            return None
        return tuple(torch.tensor(c, dtype=torch.long, device=device) for c in zip(*pairs))

    bounds = sorted(cuts) + [seqlen]
    return [
        Piece(s, e, index(enter.get(s)), index(leave.get(e))) for s, e in zip(bounds, bounds[1:])
    ]


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
    "Piece",
    "sample_numbers",
    "sample_pieces",
    "sample_spans",
    "sample_state_spans",
    "segments",
    "seq_idx_from_position_ids",
]
