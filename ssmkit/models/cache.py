"""The inference cache: what each layer needs to continue a sequence.

A Mamba layer keeps two tensors, independent of how many tokens were seen (:class:`LayerState`):

* ``conv``: the last ``d_conv`` inputs of the causal conv, (batch, conv_dim, d_conv);
* ``ssm``:  the SSM state h_t, (batch, d_inner, d_state) for Mamba-1 and
  (batch, nheads, headdim, d_state) for Mamba-2, kept in fp32.

A Mamba-3 layer keeps four (:class:`Mamba3State`): the rotation angle, the state h, and the previous
token's rotated key and input, which its trapezoid rule mixes into the next step.

An S4D or H3 layer keeps its diagonal SSM's complex state, and H3 also the last inputs of its shift
SSM (:class:`LTIState`).

An attention layer keeps its keys and values (:class:`KVState`): all of them for full attention
(memory grows with the sequence), or the last ``window`` of them in a ring buffer for sliding-window
attention (constant memory, like an SSM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerState:
    conv: torch.Tensor
    ssm: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))


@dataclass
class Mamba3State:
    angle: torch.Tensor  # θ, (batch, nheads, nangles), fp32
    ssm: torch.Tensor  # h, (batch, nheads, headdim, d_state), fp32
    k: torch.Tensor  # the last rotated key B, (batch, rank, nheads, d_state)
    v: torch.Tensor  # the last input x, (batch, nheads, headdim)
    seen: int = 0  # tokens folded in (0: a fresh state, which the kernels take as "none")

    def tensors(self) -> tuple:
        return self.angle, self.ssm, self.k, self.v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class LTIState:
    """S4D / H3 (:mod:`ssmkit.models.s4d`, :mod:`ssmkit.models.h3`). ``ssm`` is replaced by each
    step, not written in place, so a step keeps its autograd graph (the tests' second path)."""

    ssm: torch.Tensor  # x, complex64: S4D (batch, H, N/2); H3 (batch, head_dim, head_dim, nheads,
    # N/2), the outer product k vᵀ of every head, each entry N/2 modes
    conv: torch.Tensor | None = None  # H3's shift SSM: its last shift_size inputs, (batch, d_model,
    # shift_size)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ssm, self.conv) if t is not None)


class KVState:
    """Keys and values of one attention layer, (batch, heads_kv, capacity, head_dim) each.

    ``append(k, v)`` adds new positions and returns the keys and values the new queries attend to,
    with ``key_pos`` (capacity,) the absolute position of each slot (-1: empty), so the caller
    builds its causal / window mask from positions, never from slot order. Full attention grows its
    buffers by doubling (amortised O(1) per token, no reallocation per step); with ``window`` the
    buffer is a ring of exactly ``window`` slots and a token's key overwrites the one ``window``
    positions before it. ``conv`` holds the last ``d_conv`` qkv inputs when the layer has a short
    conv (else None).

    Rows of different lengths (left padding, or :meth:`load_samples` after a packed prefill) share
    the positions 0..length-1 and end together: row r's real keys start at ``start[r]``, the slots
    before it are masked, and its rotary positions count from it.
    """

    def __init__(
        self,
        batch_size: int,
        heads_kv: int,
        head_dim: int,
        dtype,
        device,
        window: int | None = None,
        conv: torch.Tensor | None = None,
        capacity: int = 256,
    ):
        self.window, self.conv, self.length = window, conv, 0
        self.start: torch.Tensor | None = (
            None  # (batch,) first real position per row (left padding)
        )
        cap = window if window else capacity
        self.k = torch.zeros(batch_size, heads_kv, cap, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.key_pos = torch.full((cap,), -1, dtype=torch.long, device=device)

    def _grow(self, needed: int):
        cap = self.k.shape[2]
        if needed <= cap:
            return
        new = max(needed, 2 * cap)
        pad = (0, 0, 0, new - cap)
        self.k, self.v = torch.nn.functional.pad(self.k, pad), torch.nn.functional.pad(self.v, pad)
        self.key_pos = torch.cat([self.key_pos, self.key_pos.new_full((new - cap,), -1)])

    def append(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v: (batch, heads_kv, n, head_dim) at positions length..length+n-1.

        Returns (keys, values, key_pos) to attend over. For a ring buffer and a block of n > 1 new
        tokens (a prefill), the returned tensors are the previous window followed by the new block
        (window + n slots) so every new query still sees its own last ``window`` keys; the ring
        keeps only the last ``window`` afterwards."""
        n, start = k.shape[2], self.length
        pos = torch.arange(start, start + n, device=self.key_pos.device)
        self.length += n
        if self.window is None:
            self._grow(start + n)
            self.k[:, :, start : start + n], self.v[:, :, start : start + n] = k, v
            self.key_pos[start : start + n] = pos
            return self.k[:, :, : start + n], self.v[:, :, : start + n], self.key_pos[: start + n]
        if n > 1:
            keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
            key_pos = torch.cat([self.key_pos, pos])
        keep = min(n, self.window)  # only the last `window` new keys survive
        slots = pos[-keep:] % self.window
        self.k[:, :, slots], self.v[:, :, slots] = k[:, :, -keep:], v[:, :, -keep:]
        self.key_pos[slots] = pos[-keep:]
        if n > 1:
            return keys, values, key_pos
        return self.k, self.v, self.key_pos

    def load_samples(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        row: torch.Tensor,
        start: torch.Tensor,
        end: torch.Tensor,
    ):
        """Fill a fresh cache from a packed prefill: k, v (rows, heads_kv, seqlen, head_dim) of the
        packed rows, sample i at ``k[row[i], :, start[i]:end[i]]`` (three (n,) int64 tensors, n =
        this cache's batch). Row i gets sample i's keys and values right-aligned, as left padding
        would place them: the rows end at position ``length`` = the longest sample, and row i's
        keys start at ``self.start[i]`` = length - len_i. A ring buffer keeps the last ``window``
        positions. Costs one gather of the cache's size; nothing is padded before the layers."""
        n = row.shape[0]
        if n != self.k.shape[0] or self.length:
            raise ValueError(
                f"load_samples fills a fresh cache of one row per sample: {n} samples for a "
                f"cache of {self.k.shape[0]} rows holding {self.length} positions"
            )
        device = self.key_pos.device
        lengths = end - start
        longest = int(lengths.max())
        first = (longest - lengths).to(device)  # (n,) each row's first real position
        if self.window is None:
            self._grow(longest)
            positions = torch.arange(longest, device=device)
            slots = positions
        else:
            positions = torch.arange(max(0, longest - self.window), longest, device=device)
            slots = positions % self.window
        real = positions[None] >= first[:, None]  # (n, m)
        src = start.to(device)[:, None] + positions[None] - first[:, None]
        src = src.clamp(0, k.shape[2] - 1)
        rows = row.to(device)[:, None]
        for buffer, packed in ((self.k, k), (self.v, v)):
            picked = packed[rows, :, src]  # (n, m, heads_kv, head_dim)
            picked = picked.masked_fill(~real[:, :, None, None], 0).transpose(1, 2)
            buffer[:, :, slots] = picked.to(buffer.dtype)
        self.key_pos[slots] = positions
        self.length, self.start = longest, first

    def nbytes(self) -> int:
        extra = 0 if self.conv is None else self.conv.numel() * self.conv.element_size()
        return self.k.numel() * self.k.element_size() * 2 + extra


@dataclass
class InferenceCache:
    layers: list = field(
        default_factory=list
    )  # a LayerState / Mamba3State / LTIState / KVState (or a backbone's own)
    seqlen_offset: int = 0  # tokens already folded into the states (the longest row's, after a
    # packed prefill)
    batch_size: int | None = None  # rows (sequences), as allocated

    @classmethod
    def allocate(cls, model, batch_size: int, dtype=None, device=None) -> InferenceCache:
        """Zero states for every layer of ``model`` (an :class:`ssmkit.models.MambaLM`)."""
        param = next(model.parameters())
        dtype = dtype or param.dtype
        device = device or param.device
        return cls(model.backbone.allocate_states(batch_size, dtype, device), batch_size=batch_size)

    def nbytes(self) -> int:
        """Memory held by the cache: constant in the sequence length for SSM and sliding-window
        layers, growing with it for full-attention layers."""
        return sum(s.nbytes() for s in self.layers)
