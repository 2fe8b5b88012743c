"""Tokenize a source into packed token shards: ``prepare(source, tokenizer, out_dir, ...)``.

Documents are tokenized in worker processes (in order), each followed by EOS, and packed into one
flat token stream cut into shards of ``shard_tokens`` tokens, stored as raw ``uint16`` (vocabulary
below 65536) or ``uint32``. ``index.json`` records the tokenizer, vocabulary size, dtype, every
shard's token count and sha256, the source and the options.

Crash safety and resume: a shard is written to a temporary name and renamed when complete, and
after each shard ``progress.json`` records where in the source the next one starts (document and
token offset). Re-running the same command keeps the finished shards and redoes only the rest,
byte for byte the same; re-running a finished one does nothing.

``mds_seq_len=N`` also writes a MosaicML streaming (MDS) copy of ``N + 1``-token windows into
``out_dir/mds`` (see :mod:`ssmkit.data.mds`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from itertools import islice
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..io import sha256_file, write_atomically  # noqa: F401  (re-exported: ssmkit.data.shards.write_atomically)
from .sources import Document, load_source
from .tokenizers import get_tokenizer

INDEX, PROGRESS = "index.json", "progress.json"
FORMAT_VERSION = 1


def _json(path: Path, obj):
    write_atomically(path, (json.dumps(obj, indent=2) + "\n").encode())


_TOKENIZER = None


def _init_worker(name):
    global _TOKENIZER
    _TOKENIZER = get_tokenizer(name)


def _encode(texts: list[str]) -> list[list[int]]:
    """A batch at once: fast tokenizers encode a list in parallel (Rust threads)."""
    return _TOKENIZER(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []


def _token_lists(docs: Iterator[Document], tokenizer: str, workers: int, batch: int = 64) -> Iterator[list[int]]:
    """Token ids of each document, in order, tokenized by ``workers`` processes."""
    batches = iter(lambda: [d.text for d in islice(docs, batch)], [])
    if workers <= 1:
        _init_worker(tokenizer)
        for texts in batches:
            yield from _encode(texts)
        return
    with get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        for encoded in pool.imap(_encode, batches):
            yield from encoded


def prepare(source: str | Iterable[Document], tokenizer: str, out_dir: str | os.PathLike, *, split: str = "train",
            max_tokens: int | None = None, shard_tokens: int = 1 << 24, workers: int = 1,
            dtype: str = "auto", progress: bool = True, mds_seq_len: int | None = None) -> dict:
    """Tokenize ``source`` (a name for :func:`ssmkit.data.sources.load_source`) into ``out_dir``.

    Returns the index (also written to ``out_dir/index.json``). ``mds_seq_len``: also write an MDS copy
    (:func:`ssmkit.data.write_mds` with that ``seq_len``) into ``out_dir/mds``.
    """
    if mds_seq_len is not None and (isinstance(mds_seq_len, bool) or not isinstance(mds_seq_len, int)
                                    or mds_seq_len < 1):
        raise ValueError(f"mds_seq_len must be a positive int; got {mds_seq_len!r}")
    index = _prepare(source, tokenizer, out_dir, split=split, max_tokens=max_tokens, shard_tokens=shard_tokens,
                     workers=workers, dtype=dtype, progress=progress)
    if mds_seq_len is not None:
        from .mds import write_mds

        write_mds(out_dir, Path(out_dir) / "mds", mds_seq_len, progress=progress)
    return index


def _prepare(source, tokenizer, out_dir, *, split, max_tokens, shard_tokens, workers, dtype, progress) -> dict:
    out = Path(out_dir)
    tok = get_tokenizer(tokenizer)
    vocab = len(tok)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer!r} has no EOS token to separate documents")
    if dtype not in ("auto", "uint16", "uint32"):
        raise ValueError(f"dtype {dtype!r} is not valid; valid: auto, uint16, uint32")
    if dtype == "uint16" and vocab > 1 << 16:
        raise ValueError(f"tokenizer {tokenizer!r} has {vocab} tokens: ids do not fit uint16 (max 65536 tokens); "
                         "use dtype='uint32' or 'auto'")
    dtype = np.uint32 if dtype == "uint32" or vocab > 1 << 16 else np.uint16
    options = dict(source=source if isinstance(source, str) else "<documents>", split=split, tokenizer=tokenizer,
                   max_tokens=max_tokens,
                   shard_tokens=shard_tokens)
    if shard_tokens < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError("shard_tokens and max_tokens must be positive")
    out.mkdir(parents=True, exist_ok=True)
    if (out / INDEX).exists():
        index = json.loads((out / INDEX).read_text())
        if index.get("options") == options:
            return index                                            # finished before: nothing to do
        raise ValueError(f"{out} already holds shards made with other options {index.get('options')}; "
                         "use another directory")
    state = {"options": options, "shards": [], "next_doc": 0, "next_offset": 0, "documents": 0}
    if (out / PROGRESS).exists():
        saved = json.loads((out / PROGRESS).read_text())
        if saved.get("options") != options:
            raise ValueError(f"{out} holds a partial run with other options {saved.get('options')}")
        state = saved
        for shard in state["shards"]:                               # finished shards must be intact
            if sha256_file(out / shard["file"]) != shard["sha256"]:
                raise ValueError(f"{out / shard['file']} does not match its recorded sha256; delete {out} and rerun")
    docs = load_source(source, split) if isinstance(source, str) else iter(source)
    docs = islice(docs, state["next_doc"], None)                    # finished shards hold everything before
    skip = state["next_offset"]                                     # ... and this much of the next document
    written = sum(s["tokens"] for s in state["shards"])
    buffer: list[int] = []
    bar = tqdm(total=max_tokens, initial=written, unit="tok", unit_scale=True, disable=not progress,
               desc=f"prepare {state['options']['source']}")

    def flush(next_doc: int, next_offset: int):
        nonlocal written, buffer
        name = f"shard_{len(state['shards']):05d}.bin"
        data = np.asarray(buffer, dtype=dtype).tobytes()
        write_atomically(out / name, data)
        state["shards"].append({"file": name, "tokens": len(buffer), "sha256": hashlib.sha256(data).hexdigest()})
        state.update(next_doc=next_doc, next_offset=next_offset)
        written, buffer = written + len(buffer), []
        _json(out / PROGRESS, state)

    left = lambda: None if max_tokens is None else max_tokens - written - len(buffer)  # noqa: E731
    for doc_index, ids in enumerate(_token_lists(docs, tokenizer, workers), start=state["next_doc"]):
        ids.append(tok.eos_token_id)
        pos, skip = skip, 0                                         # pos: offset inside this document
        while pos < len(ids) and left() != 0:
            take = min(shard_tokens - len(buffer), len(ids) - pos, len(ids) if left() is None else left())
            buffer.extend(ids[pos : pos + take])
            pos += take
            if len(buffer) == shard_tokens or left() == 0:
                flush(*((doc_index + 1, 0) if pos == len(ids) else (doc_index, pos)))
        state["documents"] = doc_index + 1
        bar.update(written + len(buffer) - bar.n)                   # shows tokens/s and, with a budget, ETA
        if left() == 0:
            break
    if buffer:
        flush(state["documents"], 0)
    if not state["shards"]:
        raise ValueError(f"source {source!r} ({split}) has no documents")
    index = dict(version=FORMAT_VERSION, tokenizer=tokenizer, vocab_size=vocab, eos_token_id=tok.eos_token_id,
                 dtype=np.dtype(dtype).name, total_tokens=written, documents=state["documents"],
                 shards=state["shards"], options=options)
    _json(out / INDEX, index)
    (out / PROGRESS).unlink(missing_ok=True)
    bar.close()
    return index
