"""``prepare(source, tokenizer, out_dir, ...)``: a source made ready to train on, in one call.

It checks every argument before anything is written, holds ``out_dir``'s :class:`~ssmkit.io.DirLock`
for the whole run (two runs never write into one directory), tokenizes and packs the source into
token shards (:func:`ssmkit.data.shards.write_shards`: crash-safe and resumable, see
:mod:`ssmkit.data.shards`) and, with ``mds_seq_len=N``, also writes a MosaicML streaming (MDS) copy
of ``N + 1``-token windows into ``out_dir/mds`` (:mod:`ssmkit.data.mds`). It sits above both: the
MDS writer reads shards, and ``prepare`` writes the one and then the other.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from .. import checks
from ..io import DirLock, Stopped, read_json, sigterm_interrupts
from .mds import write_mds
from .shards import DTYPES, INDEX, PROGRESS, check_count, write_shards
from .sources import Document, check_source


def prepare(
    source: str | Iterable[Document],
    tokenizer: str,
    out_dir: str | os.PathLike,
    *,
    split: str = "train",
    max_tokens: int | None = None,
    shard_tokens: int = 1 << 24,
    workers: int = 1,
    dtype: str = "auto",
    progress: bool = True,
    mds_seq_len: int | None = None,
    lock_wait: float = 0,
) -> dict:
    """Tokenize ``source`` (a name for :func:`ssmkit.data.sources.load_source`, or Documents) into
    ``out_dir``.

    Returns the index (also written to ``out_dir/index.json``). ``mds_seq_len``: also write an MDS
    copy (:func:`ssmkit.data.write_mds` with that ``seq_len``) into ``out_dir/mds``. ``lock_wait``:
    seconds to wait for another process preparing into ``out_dir`` (a shared cache) before failing;
    0 fails at once. Bad arguments raise ValueError before anything is written.
    """
    max_tokens = check_count("max_tokens", max_tokens, none_ok=True)
    shard_tokens = check_count("shard_tokens", shard_tokens)
    workers = check_count("workers", workers)
    mds_seq_len = check_count("mds_seq_len", mds_seq_len, none_ok=True)
    if dtype not in ("auto", *DTYPES):
        raise ValueError(f"dtype {dtype!r} is not valid; valid: auto, uint16, uint32")
    checks.number(lock_wait, "lock_wait", low=0)  # seconds to wait for the directory's lock
    if not isinstance(tokenizer, str) or not tokenizer:
        raise ValueError(f"tokenizer must be a name or a directory (str); got {tokenizer!r}")
    source = os.fspath(source) if isinstance(source, os.PathLike) else source
    if isinstance(source, str):
        check_source(source, split)
    elif isinstance(source, (bytes, dict)) or not isinstance(source, Iterable):
        raise ValueError(
            f"source must be a name, a path or an iterable of Document; got {type(source).__name__}"
        )
    out = Path(out_dir)
    try:
        with sigterm_interrupts(), DirLock(out, "data prepare", wait=lock_wait):
            index = write_shards(
                source,
                tokenizer,
                out,
                split=split,
                max_tokens=max_tokens,
                shard_tokens=shard_tokens,
                workers=workers,
                dtype=dtype,
                progress=progress,
            )
            if mds_seq_len is not None:
                write_mds(out, out / "mds", mds_seq_len, progress=progress)
    except KeyboardInterrupt as exc:  # Ctrl-C, Jupyter's stop button, SIGTERM: one line
        if isinstance(exc, Stopped):
            raise
        raise Stopped(_stopped_at(out), getattr(exc, "signum", 2)) from None
    return index


def _stopped_at(out: Path) -> str:
    """What a stopped :func:`prepare` kept in ``out``, in one line."""
    if (out / INDEX).exists():
        return (
            f"stopped while writing the MDS copy; the token shards in {out} are complete "
            "(the same call writes the MDS copy)"
        )
    try:
        shards = read_json(out / PROGRESS, "progress file")["shards"]
    except (ValueError, OSError, KeyError, TypeError):
        shards = []
    if not shards:
        return "stopped while preparing data; nothing written"
    tokens = sum(s.get("tokens", 0) for s in shards)
    return (
        f"stopped while preparing data; {len(shards)} shard(s) ({tokens:,} tokens) kept in {out} "
        "(the same call goes on from there)"
    )
