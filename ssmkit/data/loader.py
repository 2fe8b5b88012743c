"""``TokenLoader``: batches of training windows from prepared shards, resumable to the exact batch.

The shards are read through memory maps, as one flat token stream. Window i covers tokens
``[i * seq_len, i * seq_len + seq_len + 1)``; it gives ``input_ids = w[:-1]`` and
``labels = w[1:]`` (already shifted: call ``model(input_ids, labels=labels, shift_labels=False)``).
Each epoch visits every window once, in an order shuffled with (seed, epoch); rank r of
world_size takes every world_size-th window of that order, so ranks never share a window and all
ranks get the same number of batches.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .. import checks
from .shards import open_shards


class TokenLoader:
    """Batches ``(input_ids, labels)`` of shape ``(batch_size, seq_len)`` from a prepared directory.

    ``verify``: how much of the shards to check when opening them. ``"auto"`` (default): each file's
    size, and its sha256 and token ids (< the index's ``vocab_size``) the first time this directory
    is opened, remembered by file (size, mtime, ctime) so later opens only ``stat`` the files.
    ``True``: read and check every file on every open. ``False``: sizes only. A damaged shard is a
    ValueError naming the file.
    """

    def __init__(
        self,
        shard_dir,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        verify: bool | str = "auto",
    ):
        ints = dict(
            seq_len=seq_len, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed
        )
        bad = {k: v for k, v in ints.items() if not checks.is_integer(v)}
        if bad or seq_len < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                "need integers seq_len >= 1, batch_size >= 1, 0 <= rank < world_size, "
                "and seed; got " + ", ".join(f"{k}={v!r}" for k, v in ints.items())
            )
        seq_len, batch_size, rank, world_size, seed = (int(v) for v in ints.values())
        self.dir = Path(shard_dir)
        self.index, self.maps = open_shards(self.dir, verify)
        self.dtype = np.dtype(self.index["dtype"])
        self.starts = np.cumsum([0] + [len(m) for m in self.maps]).tolist()
        (self.seq_len, self.batch_size, self.rank, self.world_size, self.seed) = (
            seq_len,
            batch_size,
            rank,
            world_size,
            seed,
        )
        self.n_windows = max(0, (self.starts[-1] - 1) // seq_len)
        self.batches_per_epoch = self.n_windows // world_size // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{self.dir} holds {self.starts[-1]} tokens: not one batch of "
                f"{batch_size} x {seq_len + 1} tokens per rank for {world_size} ranks"
            )
        self.epoch, self.step = 0, 0

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the flat stream, across shard boundaries."""
        out, shard = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            lo = start - self.starts[shard]
            hi = min(stop, self.starts[shard + 1]) - self.starts[shard]
            out.append(self.maps[shard][lo:hi])
            start += hi - lo
            shard += 1
        return np.concatenate(out) if len(out) > 1 else out[0]

    def _my_windows(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.n_windows, generator=g)
        return order[self.rank :: self.world_size][: self.batches_per_epoch * self.batch_size]

    def __iter__(self):
        while True:
            windows = self._my_windows(self.epoch)
            while self.step < self.batches_per_epoch:
                ids = windows[
                    self.step * self.batch_size : (self.step + 1) * self.batch_size
                ].tolist()
                batch = np.stack(
                    [
                        self._tokens(i * self.seq_len, i * self.seq_len + self.seq_len + 1)
                        for i in ids
                    ]
                )
                self.step += 1
                batch = torch.from_numpy(batch.astype(np.int64))
                yield batch[:, :-1], batch[:, 1:]
            self.epoch, self.step = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return dict(
            epoch=self.epoch,
            step=self.step,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            total_tokens=self.starts[-1],
        )

    def load_state_dict(self, state: dict):
        if not isinstance(state, dict):
            raise ValueError(
                f"loader state must be a dict from state_dict(); got {type(state).__name__}"
            )
        for key in ("seed", "world_size", "seq_len", "batch_size", "total_tokens"):
            mine = self.state_dict()[key]
            if state.get(key) != mine:
                raise ValueError(
                    f"loader state has {key}={state.get(key)!r}, this loader has {mine!r}"
                )
        epoch, step = state.get("epoch"), state.get("step")
        if (
            not all(checks.is_integer(v) and v >= 0 for v in (epoch, step))
            or step > self.batches_per_epoch
        ):
            raise ValueError(
                f"loader state has epoch={epoch!r}, step={step!r}; expected integers >= 0 "
                f"with step <= {self.batches_per_epoch} (batches per epoch)"
            )
        self.epoch, self.step = epoch, step
