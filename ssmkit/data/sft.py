"""SFT data: instruction samples tokenized once (:func:`prepare_sft`), and batches of them, packed
or one per row, with next-token labels on the completions only and ``seq_idx`` for the scan's resets
(:class:`SFTLoader`).

    ssmkit.data.prepare_sft("sft-arith", "data/arith-train")                 # or a trl .jsonl file
    ssmkit.data.prepare_sft("sft-arith", "data/arith-val", split="val")
    loader = ssmkit.data.SFTLoader("data/arith-train", seq_len=256, batch_size=8)
    for input_ids, labels, seq_idx in loader:
        out = model(input_ids, labels=labels, shift_labels=False, seq_idx=seq_idx)

Formats and the chat template: :mod:`ssmkit.data.sft_format`; the offline sets:
:mod:`ssmkit.data.sft_sets`.

A prepared directory (one split) holds ``tokens.npy`` (every sample's ids back to back, uint16 or
uint32), ``loss_mask.npy`` (uint8, 1 where a token is a target of the loss), ``offsets.npy`` (int64,
sample k is ``[offsets[k], offsets[k+1])``), ``completion_start.npy`` (int64, where each sample's
last completion begins: the generation prompt is the tokens before it) and ``index.json``
(tokenizer, options, counts, and each file's sha256, checked every time the directory is opened).
Files are written atomically, the index last; numpy files are read with ``allow_pickle=False``.

Batches (mamba_ssm's packed-sample convention): ``input_ids`` (B, L) int64; ``labels`` (B, L) int64
already shifted, ``labels[b, t]`` the target of position t, -100 where there is none: prompt tokens
(with ``completion_only``), the last position of every sample (a sample never predicts the next
one's first token) and padding; ``seq_idx`` (B, L) int32, the index of the sample a position belongs
to within its row (0, 1, 2, ...: non-decreasing), padding at the row's end getting the next index of
its own. Padding ids are EOS.

Packing (``packing=True``): samples go into windows of ``seq_len`` tokens by best-fit decreasing (as
trl's "bfd" packing: longest first, each into the fullest window it fits, never split); equal
lengths are ordered by a permutation seeded with ``seed``. ``packing=False``: one sample per row,
right-padded. A sample longer than ``seq_len`` is skipped, never truncated (a cut completion would
teach the model to stop without EOS, a cut prompt to answer a question it did not see):
``loader.skipped`` counts them, a warning names them, and ``index.json``'s ``longer_than`` counts
the samples over common lengths.

Order and ranks (as :class:`ssmkit.data.TokenLoader`): each epoch visits the windows in an order
shuffled with (seed, epoch); rank r of world_size takes every world_size-th window of it, so ranks
never share a sample; all ranks get ``batches_per_epoch`` batches (the rest of an epoch is dropped).
``state_dict`` / ``load_state_dict`` resume at the exact batch.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import os
import platform
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from .. import checks
from ..io import DirLock, read_json, write_atomically, write_json
from .sft_format import CHAT_TEMPLATES, encode_records, parse_record, read_jsonl
from .sft_sets import SFT_SOURCES
from .tokenizers import get_tokenizer

__all__ = [
    "SFT_SOURCES",
    "SFTData",
    "SFTLoader",
    "open_sft",
    "pack_windows",
    "prepare_sft",
    "sample_labels",
]

INDEX = "index.json"
KIND = "ssmkit-sft"
FORMAT_VERSION = 1
FILES = ("tokens", "loss_mask", "offsets", "completion_start")
LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)


# --- preparing ------------------------------------------------------------------------------------


def _records(source: str, split: str, seed: int, max_samples: int | None):
    """The checked records of ``source`` and what identifies their content (for the options)."""
    if source in SFT_SOURCES:
        rows = SFT_SOURCES[source](split, seed, max_samples)
        records = [parse_record(row, f"{source} {split}[{i}]") for i, row in enumerate(rows)]
        return records, f"{source}/{sys.implementation.name}-{platform.python_version()}"
    path = Path(source)
    if path.suffix == ".jsonl" and path.is_dir():
        raise ValueError(f"SFT source {source} is a directory, not a .jsonl file")
    if path.suffix != ".jsonl" or not path.is_file():
        raise ValueError(
            f"unknown SFT source {source!r}; valid: {', '.join(SFT_SOURCES)} or a path to a "
            ".jsonl file (one JSON object per line in trl's prompt-completion or messages "
            "format)"
        )
    if split not in ("train", "val"):
        raise ValueError(
            f"split {split!r} is not valid; valid: train (the file), val (its sibling .val.jsonl)"
        )
    if split == "val":
        path = path.with_name(path.name.removesuffix(".jsonl") + ".val.jsonl")
        if not path.is_file():
            raise ValueError(
                f"split 'val' of {source} is the sibling file {path}, which does not exist; "
                "write the held-out records there, or prepare that file itself as 'train'"
            )
    records = read_jsonl(path)[:max_samples]
    return records, hashlib.sha256(path.read_bytes()).hexdigest()


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def prepare_sft(
    source: str,
    out_dir,
    tokenizer: str = "gpt2",
    split: str = "train",
    seed: int = 0,
    completion_only: bool = True,
    max_samples: int | None = None,
    chat_template: str = "ssmkit",
) -> Path:
    """Tokenize the samples of ``source`` once into ``out_dir`` and return ``out_dir``.

    source: an offline set (a key of :data:`SFT_SOURCES`: "sft-docstrings", "sft-arith") or a
    ``.jsonl`` file in trl's formats (:mod:`ssmkit.data.sft_format`). split: "train" or "val". For
    an offline set, "val" is its held-out split; for a file, "train" is the whole file and "val" its
    sibling ``NAME.val.jsonl`` (an error if missing). seed: the offline sets' draw and order (see
    each set); unused for a file. max_samples: keep the first N samples (a file's first N lines).
    completion_only: loss on completions (and their EOS) only; False: on every token. chat_template:
    "ssmkit" (the one template; see :data:`ssmkit.data.sft_format.CHAT_TEMPLATE`).

    A directory already prepared with the same options is checked and kept; with other options it is
    an error. Bad arguments and bad records raise ValueError before anything is written."""
    seed = checks.integer(seed, "seed", minimum=0)
    max_samples = checks.integer(max_samples, "max_samples", minimum=1, none_ok=True)
    completion_only = checks.boolean(completion_only, "completion_only")
    checks.choice(chat_template, "chat_template", CHAT_TEMPLATES)
    if not isinstance(tokenizer, str) or not tokenizer:
        raise ValueError(f"tokenizer must be a name or a directory (str); got {tokenizer!r}")
    source = os.fspath(source) if isinstance(source, os.PathLike) else source
    if not isinstance(source, str):
        raise ValueError(
            f"source must be a name ({', '.join(SFT_SOURCES)}) or a .jsonl path; got {source!r}"
        )
    records, content = _records(source, split, seed, max_samples)
    if tokenizer not in ("gpt2", "byte") and Path(tokenizer).is_dir():
        tokenizer = str(Path(tokenizer).resolve())  # readable from any working directory
    options = dict(
        source=source if source in SFT_SOURCES else str(Path(source).resolve()),
        content=content,
        split=split,
        tokenizer=tokenizer,
        seed=seed,
        completion_only=completion_only,
        max_samples=max_samples,
        chat_template=chat_template,
        version=FORMAT_VERSION,
    )
    out = Path(out_dir)
    if _prepared(out, options):
        return out
    tok = get_tokenizer(tokenizer)
    ids, masks, starts = encode_records(records, tok, completion_only)  # bad records fail here
    vocab = len(tok)
    lengths = np.array([len(r) for r in ids], dtype=np.int64)
    flat = np.fromiter((t for r in ids for t in r), dtype=np.int64, count=int(lengths.sum()))
    if flat.size and (flat.min() < 0 or flat.max() >= vocab):
        raise ValueError(f"tokenizer {tokenizer!r} gave a token id outside its {vocab} tokens")
    arrays = dict(
        tokens=flat.astype(np.uint16 if vocab <= 1 << 16 else np.uint32),
        loss_mask=np.fromiter((m for r in masks for m in r), dtype=np.uint8, count=flat.size),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        completion_start=np.array(starts, dtype=np.int64),
    )
    index = dict(
        kind=KIND,
        version=FORMAT_VERSION,
        tokenizer=tokenizer,
        vocab_size=vocab,
        eos_token_id=tok.eos_token_id,
        samples=len(ids),
        tokens=int(flat.size),
        loss_tokens=int(arrays["loss_mask"].sum()),
        lengths=dict(
            min=int(lengths.min()), mean=round(float(lengths.mean()), 2), max=int(lengths.max())
        ),
        longer_than={str(n): int((lengths > n).sum()) for n in LENGTHS},
        files={},
        options=options,
    )
    with DirLock(out, "sft prepare"):
        if _prepared(out, options):  # another process finished it meanwhile
            return out
        for name, array in arrays.items():
            data = _npy(array)
            write_atomically(out / f"{name}.npy", data)
            index["files"][name] = {
                "file": f"{name}.npy",
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
            }
        write_json(out / INDEX, index)  # last: its presence means complete
    return out


def _prepared(out: Path, options: dict) -> bool:
    """True if ``out`` holds intact SFT data made with ``options``; False if it holds none;
    ValueError if it holds data made with other options (or damaged)."""
    if not (out / INDEX).exists():
        return False
    saved = open_sft(out).index.get("options") or {}
    if saved != options:
        diff = "; ".join(
            f"{k}: {saved.get(k)!r} there, {v!r} now"
            for k, v in options.items()
            if saved.get(k) != v
        )
        raise ValueError(
            f"{out} already holds SFT data made with other options ({diff}); use another directory"
        )
    return True


# --- reading --------------------------------------------------------------------------------------


class SFTData:
    """A prepared directory, checked: ``index`` (index.json), ``tokens``, ``loss_mask``,
    ``offsets``, ``completion_start`` (numpy arrays, see the module docstring), ``lengths`` (tokens
    per sample)."""

    def __init__(self, folder, index: dict, arrays: dict[str, np.ndarray]):
        self.dir, self.index = Path(folder), index
        self.tokens, self.loss_mask = arrays["tokens"], arrays["loss_mask"].astype(bool)
        self.offsets, self.completion_start = arrays["offsets"], arrays["completion_start"]
        self.lengths = np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample k: its token ids (n,) int64 and loss mask (n,) bool (True: a target of the
        loss)."""
        lo, hi = self.offsets[k], self.offsets[k + 1]
        return self.tokens[lo:hi].astype(np.int64), self.loss_mask[lo:hi]

    def prompt(self, k: int) -> np.ndarray:
        """The generation prompt of sample k's last completion: its tokens before it, (m,) int64."""
        return self.tokens[self.offsets[k] : self.offsets[k] + self.completion_start[k]].astype(
            np.int64
        )


def open_sft(folder) -> SFTData:
    """Read a directory :func:`prepare_sft` wrote, checking every file's sha256 and the arrays'
    shapes; anything missing, damaged or inconsistent is a ValueError naming the file."""
    folder = Path(folder)
    redo = f"prepare it again (delete {folder} and run prepare_sft)"
    if not (folder / INDEX).exists():
        raise ValueError(
            f"{folder} has no {INDEX}: prepare it first with ssmkit.data.prepare_sft(source, "
            f"{str(folder)!r})"
        )
    index = read_json(folder / INDEX, "SFT index")
    if (
        not isinstance(index, dict)
        or index.get("kind") != KIND
        or not isinstance(index.get("files"), dict)
        or set(index["files"]) != set(FILES)
    ):
        raise ValueError(
            f"{folder / INDEX} is not an index of ssmkit SFT data (kind {KIND!r}, files "
            f"{', '.join(FILES)}); {redo}"
        )
    arrays = {}
    for name in FILES:
        entry, path = index["files"][name], folder / f"{name}.npy"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ValueError(f"SFT file {path} is missing (its index lists it); {redo}") from None
        if not isinstance(entry, dict) or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise ValueError(
                f"SFT file {path} is corrupt: its sha256 differs from {INDEX} (changed or "
                f"damaged since it was written); {redo}"
            )
        arrays[name] = np.load(io.BytesIO(data), allow_pickle=False)
    offsets, n = arrays["offsets"], index.get("samples")
    ok = (
        isinstance(n, int)
        and offsets.shape == (n + 1,)
        and offsets[0] == 0
        and (np.diff(offsets) > 0).all()
        and offsets[-1] == len(arrays["tokens"]) == len(arrays["loss_mask"])
        and arrays["completion_start"].shape == (n,)
        and (len(arrays["tokens"]) == 0 or int(arrays["tokens"].max()) < index.get("vocab_size", 0))
    )
    if not ok:
        raise ValueError(
            f"{folder}: the arrays do not fit together or with {INDEX} (sample count, offsets, "
            f"token ids < vocab_size); {redo}"
        )
    return SFTData(folder, index, arrays)


# --- packing and batches --------------------------------------------------------------------------


def sample_labels(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The shifted labels of one sample: tokens (n,), mask (n,) bool -> (n,) int64 where position j
    holds token j + 1 if that token is a target of the loss, else -100; the last position predicts
    nothing (the sample's EOS ends it: never the first token of whatever follows in a packed
    row)."""
    labels = np.full(len(tokens), -100, dtype=np.int64)
    labels[:-1] = np.where(mask[1:], tokens[1:], -100)
    return labels


def pack_windows(lengths, seq_len: int, seed: int = 0) -> list[list[int]]:
    """Best-fit decreasing: sample indices grouped into windows of at most ``seq_len`` tokens.

    lengths: tokens per sample, each <= seq_len. Samples are taken longest first (equal lengths in
    the order of a permutation seeded with ``seed``); each goes into the open window with the least
    room that still fits it, or a new window. Within a window, samples keep the order they were
    placed in."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.max() > seq_len:
        raise ValueError(f"a sample of {int(lengths.max())} tokens does not fit seq_len {seq_len}")
    tie = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).numpy()
    order = np.lexsort((tie, -lengths))
    windows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, window), sorted
    for k in order.tolist():
        n = int(lengths[k])
        at = bisect.bisect_left(room, (n, -1))
        if at == len(room):
            windows.append([k])
            free, w = seq_len - n, len(windows) - 1
        else:
            free, w = room.pop(at)
            windows[w].append(k)
            free -= n
        bisect.insort(room, (free, w))
    return windows


class SFTLoader:
    """Endless batches ``(input_ids, labels, seq_idx)``, each (batch_size, seq_len), from a prepared
    SFT directory; see the module docstring for their meaning, the packing, the order and resuming.

    Attributes: ``batches_per_epoch``, ``epoch``, ``step`` (as TokenLoader), ``windows`` (lists of
    sample indices, one per row), ``skipped`` (samples longer than seq_len), ``fill`` (share of the
    windows' positions holding tokens), ``data`` (:class:`SFTData`), ``eos_token_id``."""

    def __init__(
        self,
        sft_dir,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        packing: bool = True,
    ):
        ints = dict(
            seq_len=seq_len, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed
        )
        bad = {k: v for k, v in ints.items() if not checks.is_integer(v)}
        if (
            bad
            or seq_len < 2
            or batch_size < 1
            or world_size < 1
            or not 0 <= rank < world_size
            or seed < 0
        ):
            raise ValueError(
                "need integers seq_len >= 2, batch_size >= 1, 0 <= rank < world_size and "
                "seed >= 0; got " + ", ".join(f"{k}={v!r}" for k, v in ints.items())
            )
        self.packing = checks.boolean(packing, "packing")
        (self.seq_len, self.batch_size, self.rank, self.world_size, self.seed) = (
            int(v) for v in ints.values()
        )
        self.dir = Path(sft_dir)
        self.data = open_sft(self.dir)
        self.eos_token_id = int(self.data.index["eos_token_id"])
        lengths = self.data.lengths
        fits = np.nonzero(lengths <= seq_len)[0]
        self.skipped = len(lengths) - len(fits)
        if self.skipped:
            warnings.warn(
                f"{self.dir}: {self.skipped} of {len(lengths)} samples are longer than seq_len "
                f"{seq_len} (the longest: {int(lengths.max())} tokens) and are skipped, "
                "not truncated",
                stacklevel=2,
            )
        if self.packing:
            self.windows = [
                [int(fits[i]) for i in w] for w in pack_windows(lengths[fits], seq_len, seed)
            ]
        else:
            self.windows = [[int(k)] for k in fits]
        used = sum(int(lengths[k]) for w in self.windows for k in w)
        self.fill = used / (len(self.windows) * seq_len) if self.windows else 0.0
        self.batches_per_epoch = len(self.windows) // world_size // batch_size
        if self.batches_per_epoch == 0:
            how = "packed into" if self.packing else "one per row:"
            raise ValueError(
                f"{self.dir}: {len(fits)} samples fit seq_len {seq_len} "
                f"({how} {len(self.windows)} rows): "
                f"not one batch of {batch_size} rows per rank for {world_size} ranks"
            )
        self.epoch, self.step = 0, 0

    def row(self, window: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One row: input_ids (seq_len,) int64, labels (seq_len,) int64, seq_idx (seq_len,)
        int32."""
        ids = np.full(self.seq_len, self.eos_token_id, dtype=np.int64)
        labels = np.full(self.seq_len, -100, dtype=np.int64)
        seq_idx = np.full(self.seq_len, len(window), dtype=np.int32)  # padding: an index of its own
        at = 0
        for i, k in enumerate(window):
            tokens, mask = self.data.sample(k)
            n = len(tokens)
            ids[at : at + n] = tokens
            labels[at : at + n] = sample_labels(tokens, mask)
            seq_idx[at : at + n] = i
            at += n
        return ids, labels, seq_idx

    def _my_windows(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.windows), generator=g)
        return order[self.rank :: self.world_size][: self.batches_per_epoch * self.batch_size]

    def __iter__(self):
        while True:
            windows = self._my_windows(self.epoch)
            while self.step < self.batches_per_epoch:
                chosen = windows[
                    self.step * self.batch_size : (self.step + 1) * self.batch_size
                ].tolist()
                rows = [self.row(self.windows[w]) for w in chosen]
                self.step += 1
                yield tuple(torch.from_numpy(np.stack(parts)) for parts in zip(*rows, strict=True))
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
            packing=self.packing,
            samples=len(self.data),
            tokens_sha256=self.data.index["files"]["tokens"]["sha256"],
        )

    def load_state_dict(self, state: dict):
        if not isinstance(state, dict):
            raise ValueError(
                f"loader state must be a dict from state_dict(); got {type(state).__name__}"
            )
        mine = self.state_dict()
        for key in (
            "seed",
            "world_size",
            "seq_len",
            "batch_size",
            "packing",
            "samples",
            "tokens_sha256",
        ):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"loader state has {key}={state.get(key)!r}, this loader has {mine[key]!r}"
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
        self.epoch, self.step = int(epoch), int(step)
