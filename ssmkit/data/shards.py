"""Token shards: a source tokenized and packed into shards (:func:`write_shards`), and read back
checked (:func:`open_shards`). The entry point is :func:`ssmkit.data.prepare` (in
:mod:`ssmkit.data.pipeline`).

Documents are tokenized in worker processes (in order), each followed by EOS, and packed into one
flat token stream cut into shards of ``shard_tokens`` tokens, stored as raw ``uint16`` (vocabulary
below 65536) or ``uint32``. Blank documents are skipped. ``index.json`` records the tokenizer (its
name; for a ``bpe-<N>`` trained on a local source, the directory holding it: see
:func:`~ssmkit.data.tokenizers.tokenizer_for`), vocabulary size, dtype, every shard's token count
and sha256, the source, its fingerprint (:func:`~ssmkit.data.sources.source_fingerprint`) and the
options.

Crash safety and resume: a shard is written to a temporary name and renamed when complete, and
after each shard ``progress.json`` records where in the source the next one starts (document and
token offset). Re-running the same command keeps the finished shards (after checking their sha256)
and redoes only the rest, byte for byte the same; re-running a finished one checks the shards and
does nothing. A local source edited since is refused. The whole run holds the directory's
:class:`~ssmkit.io.DirLock`, so two runs never write into one directory.

Checking shards (:func:`check_shards`, used by the loader and the MDS writer): their size always;
``verify=True`` also their sha256 and that every token id is below the index's ``vocab_size``;
``verify="auto"`` does that once per file and remembers it under ``$SSMKIT_CACHE/verified/`` by
(size, mtime, ctime), so a second open costs a ``stat`` per shard.

The MDS copy (``prepare(..., mds_seq_len=N)``, :mod:`ssmkit.data.mds`) reads the shards through this
module; it is written by :mod:`ssmkit.data.pipeline`, above both.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from .. import checks
from ..io import (
    cache_dir,
    children_ignore_sigint,
    ignore_sigint,
    plain_name,
    read_json,
    tqdm_bar,
    write_atomically,
    write_json,
)
from .sources import Document, load_source, source_fingerprint
from .tokenizers import get_tokenizer, tokenizer_for

INDEX, PROGRESS = "index.json", "progress.json"
FORMAT_VERSION = 1
DTYPES = ("uint16", "uint32")
RACY_NS = 2 * 10**9  # a file changed less than 2 s before it was hashed is hashed again next time
_SHARD = re.compile(r"shard_\d{5}\.bin")
_SHARD_TMP = re.compile(r"\.shard_\d{5}\.bin\.tmp-\d+")


# --- checking prepared shards ---------------------------------------------------------------------


def _redo(folder: Path) -> str:
    return (
        "prepare the data again into a new directory "
        f"(or delete {folder} and run ssmkit data prepare again)"
    )


def check_count(name: str, value, minimum: int = 1, none_ok: bool = False):
    """``value`` as an int >= ``minimum`` (bool is not an int), or ValueError naming ``name``."""
    return checks.integer(value, name, minimum=minimum, none_ok=none_ok)


def _check_entries(shards, where: Path) -> list[dict]:
    """Shard entries read from ``where``: plain file names, token counts, sha256 strings."""
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise ValueError(f"{where}: 'shards' is not a list of shard entries; {_redo(where.parent)}")
    for s in shards:
        plain_name(s.get("file"), str(where))
        ok = (
            isinstance(s.get("sha256"), str)
            and isinstance(s.get("tokens"), int)
            and s["tokens"] >= 0
        )
        if not ok or isinstance(s["tokens"], bool):
            raise ValueError(
                f"{where}: shard entry {s!r} needs tokens (int >= 0) and sha256; "
                f"{_redo(where.parent)}"
            )
    return shards


def load_index(folder: str | os.PathLike) -> dict:
    """The ``index.json`` of a prepared directory, checked (dtype, vocab_size, shard entries,
    total)."""
    folder = Path(folder)
    if not (folder / INDEX).exists():
        raise ValueError(
            f"{folder} has no {INDEX}: prepare it first (ssmkit data prepare --out {folder})"
        )
    index = read_json(folder / INDEX, "shard index")
    if (
        not isinstance(index, dict)
        or index.get("dtype") not in DTYPES
        or "shards" not in index
        or not isinstance(index.get("vocab_size"), int)
        or index["vocab_size"] < 1
    ):
        raise ValueError(
            f"{folder / INDEX} is not an index of ssmkit token shards "
            f"(it needs dtype uint16 or uint32, vocab_size and shards); {_redo(folder)}"
        )
    _check_entries(index["shards"], folder / INDEX)
    if index.get("total_tokens") != sum(s["tokens"] for s in index["shards"]):
        raise ValueError(
            f"{folder / INDEX}: total_tokens {index.get('total_tokens')!r} "
            f"is not the sum of the shards' tokens; {_redo(folder)}"
        )
    return index


def _scan(path: Path, dtype: str) -> tuple[str, int]:
    """One pass over a shard: its sha256 and its largest token id (-1 if empty)."""
    h, top = hashlib.sha256(), -1
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            top = max(top, int(np.frombuffer(block, dtype).max()))
    return h.hexdigest(), top


def _verified_file(folder: Path) -> Path:
    key = str(folder.resolve())
    return cache_dir() / "verified" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _load_verified(folder: Path) -> dict:
    try:
        data = read_json(_verified_file(folder))
    except ValueError:  # none yet, unreadable or corrupt: check again
        return {}
    ok = (
        isinstance(data, dict)
        and data.get("dir") == str(folder.resolve())
        and isinstance(data.get("files"), dict)
    )
    return data["files"] if ok else {}


def _save_verified(folder: Path, files: dict):
    path = _verified_file(folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"dir": str(folder.resolve()), "files": files})
    except OSError:  # a read-only cache only means checking again next time
        pass


def check_shards(
    folder: str | os.PathLike,
    shards: list[dict],
    dtype: str,
    vocab_size: int,
    verify: bool | str = "auto",
) -> None:
    """Check the shard files of ``folder`` against their index entries, or raise ValueError naming
    the file.

    ``verify=False``: each file exists and has the size the index says. ``True``: also its sha256
    and that every token id is below ``vocab_size``, reading every byte. ``"auto"``: like True, but
    a file whose (size, mtime, ctime) is what it was when last found intact is not read again
    (remembered in ``$SSMKIT_CACHE/verified/``; a cache that cannot be written only costs a
    re-check)."""
    if not (verify is True or verify is False or verify == "auto"):
        raise ValueError(f"verify must be 'auto', True or False; got {verify!r}")
    folder, itemsize = Path(folder), np.dtype(dtype).itemsize
    known = _load_verified(folder) if verify == "auto" else {}
    intact = {}
    for s in shards:
        path = folder / s["file"]
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ValueError(
                f"shard {path} is missing (its index lists it); {_redo(folder)}"
            ) from None
        if st.st_size != s["tokens"] * itemsize:
            raise ValueError(
                f"shard {path} is corrupt: {st.st_size} bytes, "
                f"the index says {s['tokens'] * itemsize}; {_redo(folder)}"
            )
        if verify is False:
            continue
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, s["sha256"], dtype, vocab_size]
        if known.get(s["file"]) == key:
            intact[s["file"]] = key
            continue
        digest, top = _scan(path, dtype)
        if digest != s["sha256"]:
            raise ValueError(
                f"shard {path} is corrupt: its sha256 differs from the index "
                f"(changed or damaged since it was written); {_redo(folder)}"
            )
        if top >= vocab_size:
            raise ValueError(
                f"shard {path} is corrupt: it holds token id {top}, the index's vocab_size is "
                f"{vocab_size}; {_redo(folder)}"
            )
        # coarse clocks: trust only older stamps
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS:
            intact[s["file"]] = key
    if verify == "auto" and intact != known:
        _save_verified(folder, intact)


def open_shards(
    folder: str | os.PathLike, verify: bool | str = "auto"
) -> tuple[dict, list[np.ndarray]]:
    """The checked index of a prepared directory and its shards as read-only memory maps (see
    :func:`check_shards`)."""
    folder = Path(folder)
    index = load_index(folder)
    check_shards(folder, index["shards"], index["dtype"], index["vocab_size"], verify)
    dtype = np.dtype(index["dtype"])
    maps = [
        np.memmap(folder / s["file"], dtype=dtype, mode="r") if s["tokens"] else np.zeros(0, dtype)
        for s in index["shards"]
    ]
    return index, maps


# --- tokenizing -----------------------------------------------------------------------------------

_TOKENIZER = None


def _init_worker(name):
    global _TOKENIZER
    _TOKENIZER = get_tokenizer(name)


def _init_pool_worker(name):
    ignore_sigint()  # Ctrl-C is the parent's: it ends the pool, the workers print nothing
    _init_worker(name)


def _encode(texts: list[str]) -> list[list[int]]:
    """A batch at once: fast tokenizers encode a list in parallel (Rust threads). Blank texts give
    []."""
    keep = [t for t in texts if t.strip()]
    ids = iter(
        _TOKENIZER(keep, add_special_tokens=False, verbose=False)["input_ids"] if keep else []
    )
    return [next(ids) if t.strip() else [] for t in texts]


def _texts(docs: Iterator[Document], batch: int) -> list[str]:
    texts = []
    for d in islice(docs, batch):
        if not isinstance(getattr(d, "text", None), str):
            raise ValueError(
                f"document {getattr(d, 'id', d)!r} has no text string (got "
                f"{type(getattr(d, 'text', d)).__name__}); "
                "a source yields ssmkit.data.Document(id, text)"
            )
        texts.append(d.text)
    return texts


def _token_lists(
    docs: Iterator[Document], tokenizer: str, workers: int, batch: int = 64
) -> Iterator[list[int]]:
    """Token ids of each document, in order, tokenized by ``workers`` processes."""
    batches = iter(lambda: _texts(docs, batch), [])
    if workers <= 1:
        _init_worker(tokenizer)
        for texts in batches:
            yield from _encode(texts)
        return
    with children_ignore_sigint():  # Ctrl-C is ours: the workers print nothing
        pool = get_context("spawn").Pool(
            workers, initializer=_init_pool_worker, initargs=(tokenizer,)
        )
    with pool:
        for encoded in pool.imap(_encode, batches):
            yield from encoded


# --- writing shards -------------------------------------------------------------------------------


@contextmanager
def progress_bar(**kw):
    """A tqdm bar that stays when the work finishes and is erased when it fails (so the error reads
    alone)."""
    bar = tqdm_bar(**kw)  # the form $SSMKIT_PROGRESS asks for
    try:
        yield bar
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()


def _same_options(out: Path, what: str, saved, options: dict):
    """ValueError unless the options saved in ``out`` are ``options``; names what differs."""
    if saved == options:
        return
    if isinstance(saved, dict) and {**saved, "source_fingerprint": None} == {
        **options,
        "source_fingerprint": None,
    }:
        raise ValueError(
            f"the source {options['source']!r} changed since {out} was prepared (fingerprint "
            f"{saved.get('source_fingerprint')} then, {options['source_fingerprint']} now: "
            f"files edited, added or removed, or another Python for stdlib-docs); "
            f"prepare into another directory, or delete {out} and run again"
        )
    saved = saved if isinstance(saved, dict) else {}
    diff = "; ".join(
        f"{k}: {saved.get(k)!r} there, {v!r} now" for k, v in options.items() if saved.get(k) != v
    )
    raise ValueError(
        f"{out} already holds {what} made with other options ({diff}); use another directory"
    )


def _load_progress(out: Path, options: dict) -> dict | None:
    """The state a crashed run saved, checked: same options, sane fields, plain shard names. None if
    that run wrote no shard (e.g. it stopped at a bad line): then there is nothing to keep."""
    state = read_json(out / PROGRESS, "progress file")
    if isinstance(state, dict) and state.get("shards") == []:
        return None
    _same_options(
        out, "a partial run", state.get("options") if isinstance(state, dict) else None, options
    )
    for k, shard in enumerate(_check_entries(state.get("shards"), out / PROGRESS)):
        # as flush() names them
        plain_name(shard["file"], str(out / PROGRESS), pattern=f"shard_{k:05d}\\.bin")
    for key in ("next_doc", "next_offset", "documents", "empty_documents"):
        check_count(f"{out / PROGRESS}: {key}", state.get(key), minimum=0)
    return state


def write_shards(
    source, tokenizer, out: Path, *, split, max_tokens, shard_tokens, workers, dtype, progress
) -> dict:
    """Tokenize ``source`` into shards in ``out`` and return the index (also written to
    ``out/index.json``).

    Arguments are :func:`ssmkit.data.prepare`'s, already checked; the caller holds ``out``'s
    :class:`~ssmkit.io.DirLock`. Finished shards of a crashed run are kept (see the module
    docstring); a finished directory is checked and returned as it is.
    """
    named = isinstance(source, str)
    options = dict(
        source=source if named else "<documents>",
        split=split,
        tokenizer=tokenizer,
        max_tokens=max_tokens,
        shard_tokens=shard_tokens,
        dtype=dtype,
        source_fingerprint=source_fingerprint(source) if named else None,
    )
    # bpe-<N> is trained on the source's train split (tokenizer_for decides); `loadable` names
    # exactly that tokenizer (index.json's "tokenizer": what a checkpoint saves, what the workers
    # load)
    loadable = tokenizer_for(tokenizer, source if named else None)
    if tokenizer.startswith("bpe-"):  # its corpus' fingerprint and recipe
        options["bpe"] = Path(get_tokenizer(loadable).name_or_path).name
    if (out / INDEX).exists():  # finished before: check it, nothing to do
        index = load_index(out)
        _same_options(out, "shards", index.get("options"), options)
        check_shards(out, index["shards"], index["dtype"], index["vocab_size"], verify="auto")
        return index
    tok = get_tokenizer(loadable)
    vocab = len(tok)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer!r} has no EOS token to separate documents")
    if dtype == "uint16" and vocab > 1 << 16:
        raise ValueError(
            f"tokenizer {tokenizer!r} has {vocab} tokens: ids do not fit uint16 "
            "(max 65536 tokens); use dtype='uint32' or 'auto'"
        )
    dtype = np.dtype(np.uint32 if dtype == "uint32" or vocab > 1 << 16 else np.uint16)
    if (out / PROGRESS).exists():  # a crashed run: keep its intact shards
        state = _load_progress(out, options)
        if state is not None:
            check_shards(out, state["shards"], dtype.name, vocab, verify=True)
    else:
        state, ours = None, sorted(p.name for p in out.iterdir() if _SHARD.fullmatch(p.name))
        if ours:
            raise ValueError(
                f"{out} holds {ours[0]} but no {INDEX} or {PROGRESS}: "
                "shards not written by ssmkit prepare; use another directory"
            )
    if state is None:
        state = {
            "options": options,
            "shards": [],
            "next_doc": 0,
            "next_offset": 0,
            "documents": 0,
            "empty_documents": 0,
        }
        write_json(out / PROGRESS, state)  # from now on the directory is ours
    # temp files of a killed run (we hold the lock)
    for p in out.iterdir():
        if _SHARD_TMP.fullmatch(p.name):
            p.unlink(missing_ok=True)
    docs = load_source(source, split) if named else iter(source)
    docs = islice(docs, state["next_doc"], None)  # finished shards hold everything before
    skip = state["next_offset"]  # ... and this much of the next document
    written = sum(s["tokens"] for s in state["shards"])
    buffer: list[int] = []

    def flush(next_doc: int, next_offset: int):
        nonlocal written, buffer
        name = f"shard_{len(state['shards']):05d}.bin"
        ids = np.asarray(buffer, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(
                f"tokenizer {tokenizer!r} gave token id "
                f"{ids.max() if ids.max() >= vocab else ids.min()}, outside its {vocab} tokens"
            )
        data = ids.astype(dtype).tobytes()
        try:
            write_atomically(out / name, data)
        except OSError as exc:  # disk full: name the file in the message
            exc.filename = exc.filename or str(out / name)
            raise
        state["shards"].append(
            {"file": name, "tokens": len(buffer), "sha256": hashlib.sha256(data).hexdigest()}
        )
        state.update(next_doc=next_doc, next_offset=next_offset)
        written, buffer = written + len(buffer), []
        write_json(out / PROGRESS, state)

    left = lambda: None if max_tokens is None else max_tokens - written - len(buffer)  # noqa: E731
    with progress_bar(
        total=max_tokens,
        initial=written,
        unit="tok",
        unit_scale=True,
        disable=not progress,
        desc=f"prepare {options['source']}",
    ) as bar:
        for doc_index, ids in enumerate(
            _token_lists(docs, loadable, workers), start=state["next_doc"]
        ):
            state["documents"] = doc_index + 1
            if not ids:  # a blank document: nothing to learn from
                state["empty_documents"] += 1
                continue
            ids.append(tok.eos_token_id)
            pos, skip = skip, 0  # pos: offset inside this document
            while pos < len(ids) and left() != 0:
                take = min(
                    shard_tokens - len(buffer),
                    len(ids) - pos,
                    len(ids) if left() is None else left(),
                )
                buffer.extend(ids[pos : pos + take])
                pos += take
                if len(buffer) == shard_tokens or left() == 0:
                    flush(*((doc_index + 1, 0) if pos == len(ids) else (doc_index, pos)))
            bar.update(written + len(buffer) - bar.n)  # shows tokens/s and, with a budget, ETA
            if left() == 0:
                break
        if buffer:
            flush(state["documents"], 0)
        if not state["shards"]:
            what = (
                f"has no text: its {state['documents']} documents are blank"
                if state["documents"]
                else "has no documents"
            )
            raise ValueError(
                f"source {options['source']!r} ({split} split) {what}; nothing to train on"
            )
    if named and source_fingerprint(source) != options["source_fingerprint"]:
        raise ValueError(
            f"the source {source!r} changed while it was being prepared; "
            f"delete {out} and prepare again when it no longer changes"
        )
    index = dict(
        version=FORMAT_VERSION,
        tokenizer=loadable,
        vocab_size=vocab,
        eos_token_id=tok.eos_token_id,
        dtype=dtype.name,
        total_tokens=written,
        documents=state["documents"],
        empty_documents=state["empty_documents"],
        shards=state["shards"],
        options=options,
    )
    write_json(out / INDEX, index)
    (out / PROGRESS).unlink(missing_ok=True)
    return index
