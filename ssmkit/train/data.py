"""The data of a training run: token shards for pretraining, or SFT samples for instruction tuning.

``config.data`` is one of

* a prepared directory: token shards (``index.json`` of :func:`ssmkit.data.prepare`) or SFT data
  (``index.json`` of kind ``ssmkit-sft``, :func:`ssmkit.data.prepare_sft`), used as it is;
* an SFT source: ``sft-docstrings`` / ``sft-arith`` (the offline sets; validation: their held-out
  "val" split) or ``"sft:PATH.jsonl"`` (trl's prompt-completion or messages format; validation: the
  sibling ``PATH.val.jsonl`` when it exists, else none), prepared once with ``config.tokenizer``
  into ``$SSMKIT_CACHE/sft/`` under a key of the source's content, the tokenizer and the format
  version;
* any other text source (``stdlib-docs``, a corpus directory, a hub dataset), tokenized into shards
  once into ``$SSMKIT_CACHE/shards/`` (:func:`prepare_data`).

``config.val_data`` replaces the default validation data: a prepared directory of the same kind, or
for SFT also ``"sft:VAL.jsonl"``. Token shards are read by :class:`ssmkit.data.TokenLoader` (batches
``(input_ids, labels)``), SFT data by :class:`ssmkit.data.SFTLoader` (packed samples, batches
``(input_ids, labels, seq_idx)``: the Trainer passes ``seq_idx`` to the model, so the scan restarts
at each sample, and the labels score the completions only). The SFT validation loss is the held-out
completion loss of :func:`ssmkit.eval.completion_loss` (samples one per row, token-weighted mean)
over the first ``eval_batches x micro_batch`` samples.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import sys
from pathlib import Path

from ..data import TokenLoader, prepare, source_fingerprint
from ..io import cache_dir, read_json
from .config import TrainConfig
from .distributed import Dist

PREPARE_WAIT = 6 * 3600  # seconds to wait for another process preparing the same cached shards
SFT_PREFIX = "sft:"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_")[-80:]


def _in_turn(d: Dist, fn):
    """``fn()`` on rank 0, then on the first process (LOCAL_RANK 0) of each other machine, then on
    the other ranks (a collective: every rank calls it). Each turn finds the work of the turns
    before done where it can see it: with ``$SSMKIT_CACHE`` on a filesystem the machines share, rank
    0's prepared shards and verified checksums; with a cache on each machine's own disk, the first
    process of a machine prepares that machine's copy. No two machines prepare at once, so a
    shared cache needs no lock that works across machines (``flock`` over NFS or Lustre may not);
    the directory lock still keeps other jobs out. An error in a turn stops every rank instead of
    leaving them waiting."""
    result = None
    turns = (d.is_main, d.local_rank == 0 and not d.is_main, d.local_rank != 0)
    for turn, mine in enumerate(turns):
        error = None
        if mine:
            try:
                result = fn()
            except Exception as exc:
                error = exc
        if d.any(error is not None):
            who = ("rank 0", "the first process of another machine", "another rank")[turn]
            raise error or ValueError(f"{who} stopped while preparing the data (see its message)")
    return result


# --- SFT ------------------------------------------------------------------------------------------


def sft_source(data: str) -> str | None:
    """The SFT source ``data`` names (an offline set's name or a .jsonl path), or None when it is
    not one."""
    from ..data.sft import SFT_SOURCES

    if data.startswith(SFT_PREFIX):
        path = data[len(SFT_PREFIX) :]
        if not path.endswith(".jsonl"):
            raise ValueError(
                f"data={data!r}: after 'sft:' comes a .jsonl file in trl's formats "
                "(prompt/completion or messages), e.g. sft:data/train.jsonl"
            )
        if Path(path).is_dir():
            raise ValueError(f"data={data!r}: {path} is a directory, not a .jsonl file")
        if not Path(path).is_file():
            raise ValueError(f"data={data!r}: the file {path} does not exist")
        return path
    return data if data in SFT_SOURCES else None


def is_sft_dir(path) -> bool:
    """True for a directory :func:`ssmkit.data.prepare_sft` wrote (its index.json has kind
    ssmkit-sft)."""
    from ..data.sft import INDEX, KIND

    index = Path(path) / INDEX
    if not index.is_file():
        return False
    try:
        return read_json(index, "index").get("kind") == KIND
    except (ValueError, AttributeError):
        return False


def _sft_key(source: str, tokenizer: str) -> str:
    """The cache key of a prepared SFT source: what prepare_sft's options record about its
    content."""
    from ..data.sft import FORMAT_VERSION, SFT_SOURCES

    if source in SFT_SOURCES:
        content = f"{source}/{sys.implementation.name}-{platform.python_version()}"
    else:
        content = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    key = json.dumps(
        [
            str(Path(source).resolve()) if source not in SFT_SOURCES else source,
            content,
            tokenizer,
            FORMAT_VERSION,
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"{_slug(Path(source).stem)}-{_slug(tokenizer)}-{digest}"


def prepare_sft_data(
    cfg: TrainConfig, source: str, dist: Dist | None = None
) -> tuple[Path, Path | None]:
    """Prepared SFT directories (train, validation or None) for ``source`` (see the module
    docstring); rank 0 prepares, the other ranks find its work done (:func:`_in_turn`)."""
    from ..data.sft import SFT_SOURCES, prepare_sft

    base = cache_dir() / "sft" / _sft_key(source, cfg.tokenizer)
    sibling = (
        None if source in SFT_SOURCES else Path(source).with_name(Path(source).stem + ".val.jsonl")
    )
    has_val = cfg.val_data is None and (sibling is None or sibling.is_file())

    def work():
        prepare_sft(source, base / "train", tokenizer=cfg.tokenizer, split="train")
        if has_val:
            prepare_sft(source, base / "val", tokenizer=cfg.tokenizer, split="val")

    _in_turn(dist or Dist(), work)
    if cfg.val_data is not None:
        return base / "train", _sft_val(cfg, dist)
    return base / "train", base / "val" if has_val else None


def _sft_val(cfg: TrainConfig, dist: Dist | None) -> Path:
    """``config.val_data`` for SFT: a prepared SFT directory, or "sft:VAL.jsonl" prepared whole."""
    from ..data.sft import prepare_sft

    if is_sft_dir(cfg.val_data):
        return Path(cfg.val_data)
    path = sft_source(cfg.val_data) if cfg.val_data.startswith(SFT_PREFIX) else None
    if path is None:
        raise ValueError(
            f"val_data={cfg.val_data!r} is neither a prepared SFT directory nor "
            "'sft:PATH.jsonl' (the validation data of an SFT run)"
        )
    out = cache_dir() / "sft" / _sft_key(path, cfg.tokenizer) / "train"
    _in_turn(dist or Dist(), lambda: prepare_sft(path, out, tokenizer=cfg.tokenizer, split="train"))
    return out


# --- token shards ---------------------------------------------------------------------------------


def prepare_data(cfg: TrainConfig, dist: Dist | None = None) -> tuple[Path, Path | None]:
    """Directories (train, validation) for ``cfg.data``: used as is when it holds an index.json; an
    SFT source is prepared by :func:`prepare_sft_data`; any other source is prepared once into
    ``$SSMKIT_CACHE/shards/``. The cache entry is keyed by the source's content
    (:func:`ssmkit.data.source_fingerprint`: an edited local corpus is prepared afresh), and a
    process preparing the same entry is waited for. Under torchrun rank 0 prepares, then the first
    process of each other machine (which finds it prepared on a shared cache): :func:`_in_turn`."""
    if (Path(cfg.data) / "index.json").exists():
        if cfg.val_data and is_sft_dir(cfg.data):
            return Path(cfg.data), _sft_val(cfg, dist)  # a prepared dir, or sft:VAL.jsonl
        return Path(cfg.data), Path(cfg.val_data) if cfg.val_data else None
    source = sft_source(cfg.data)
    if source is not None:
        return prepare_sft_data(cfg, source, dist)
    budget = f"-{cfg.data_tokens}" if cfg.data_tokens else ""
    content = source_fingerprint(cfg.data) or "remote"
    base = cache_dir() / "shards" / f"{_slug(cfg.data)}-{_slug(cfg.tokenizer)}{budget}-{content}"

    def work():
        if dist is not None and dist.local_rank != 0:  # one process a machine prepares
            return
        prepare(
            cfg.data,
            cfg.tokenizer,
            base / "train",
            split="train",
            max_tokens=cfg.data_tokens,
            workers=cfg.data_workers,
            progress=cfg.progress,
            lock_wait=PREPARE_WAIT,
        )
        if not cfg.val_data:
            val_budget = None if cfg.data_tokens is None else max(1, cfg.data_tokens // 100)
            prepare(
                cfg.data,
                cfg.tokenizer,
                base / "validation",
                split="validation",
                max_tokens=val_budget,
                workers=cfg.data_workers,
                progress=cfg.progress,
                lock_wait=PREPARE_WAIT,
            )

    _in_turn(dist or Dist(), work)
    return base / "train", Path(cfg.val_data) if cfg.val_data else base / "validation"


# --- loaders --------------------------------------------------------------------------------------


def make_loader(data, cfg: TrainConfig, d: Dist, seed: int):
    """The training loader for a prepared directory: an SFTLoader for SFT data, else a TokenLoader
    (each opened, and its files verified, on rank 0 first: :func:`_in_turn`)."""
    if is_sft_dir(data):
        from ..data.sft import SFTLoader

        return _in_turn(
            d,
            lambda: SFTLoader(data, cfg.seq_len, cfg.micro_batch, d.rank, d.world_size, seed=seed),
        )
    return _in_turn(
        d, lambda: TokenLoader(data, cfg.seq_len, cfg.micro_batch, d.rank, d.world_size, seed=seed)
    )


def make_val(val_data, cfg: TrainConfig, d: Dist, train_is_sft: bool):
    """What :meth:`Trainer.evaluate` scores: a TokenLoader over validation shards, or for an SFT run
    the opened held-out SFT data; a validation set of the other kind than the training data is an
    error."""
    if is_sft_dir(val_data) != train_is_sft:
        kind = "SFT data" if train_is_sft else "token shards"
        raise ValueError(
            f"val_data {val_data} is not {kind}, as the training data is: give validation data "
            "of the same kind"
        )
    if train_is_sft:
        from ..data.sft import open_sft

        return _in_turn(d, lambda: open_sft(val_data))
    return _in_turn(
        d, lambda: TokenLoader(val_data, cfg.seq_len, cfg.micro_batch, d.rank, d.world_size, seed=0)
    )


def loader_index(loader) -> dict:
    """The index.json of the loader's data (``vocab_size``, ``tokenizer``)."""
    return loader.data.index if hasattr(loader, "data") else loader.index


def resume_keys(loader) -> tuple[str, ...]:
    """The loader-state keys that must match for a checkpoint's data position to mean the same
    data."""
    return (
        ("seed", "seq_len", "packing", "samples", "tokens_sha256")
        if hasattr(loader, "data")
        else ("seed", "seq_len", "total_tokens")
    )


def sft_val_loss(module, val, cfg: TrainConfig, device, dtype) -> dict:
    """Held-out completion loss (:func:`ssmkit.eval.completion_loss`) over the first eval_batches x
    micro_batch samples of ``val``: ``{"loss", "ppl"}``."""
    from ..eval import completion_loss
    from ..eval.loss import ppl_of

    result = completion_loss(
        module,
        val,
        batch_size=cfg.micro_batch,
        n=cfg.eval_batches * cfg.micro_batch,
        device=device,
        dtype=dtype,
    )
    return {"loss": result["loss"], "ppl": ppl_of(result["loss"])}
