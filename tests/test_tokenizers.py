"""Tokenizers, offline: GPT-2 against known ids, byte and bpe-N by round trips."""

from __future__ import annotations

import pytest

from ssmkit.data import EOS, get_tokenizer


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSMKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


TEXTS = ["Hello world", " the end.\n", "Unicode: héllo — 日本語 🙂", "def f(x):\n\treturn x ** 2\n", ""]


def test_gpt2_known_ids_and_round_trip():
    tok = get_tokenizer("gpt2")
    assert len(tok) == 50257 and tok.eos_token == EOS and tok.eos_token_id == 50256
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262] and tok.encode("\n") == [198]
    assert tok.encode(EOS) == [50256]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_is_the_bytes():
    tok = get_tokenizer("byte")
    assert len(tok) == 257 and tok.eos_token_id == 256
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_bpe_trains_offline_and_is_cached(tmp_path):
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "def f(x): return x + 1\n" * 20]
    tok = get_tokenizer("bpe-300", corpus=corpus)
    assert 257 < len(tok) <= 300 and tok.eos_token == EOS
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")      # merges learned
    cached = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("bpe-300-")
    assert get_tokenizer("bpe-300", corpus=corpus).encode("lazy dog") == tok.encode("lazy dog")
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1              # no second training


def test_bad_names_are_clear():
    with pytest.raises(ValueError, match="expected bpe-<vocab size>"):
        get_tokenizer("bpe-big")
    with pytest.raises(ValueError, match="at least 257"):
        get_tokenizer("bpe-100", corpus=["abc"])
    with pytest.raises(ValueError, match="Offline, use 'gpt2', 'byte', 'bpe-<N>' or a local directory"):
        get_tokenizer("someone/not-a-cached-tokenizer")
