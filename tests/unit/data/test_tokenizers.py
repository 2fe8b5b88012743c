"""Tokenizers, offline: GPT-2 against known ids, byte and bpe-N by round trips; bpe-N of exactly N
tokens, trained on the data it encodes; a directory without a tokenizer refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import jsonl

from ssmkit.data import EOS, get_tokenizer, prepare
from ssmkit.data.shards import open_shards


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSMKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


TEXTS = [
    "Hello world",
    " the end.\n",
    "Unicode: héllo — 日本語 🙂",
    "def f(x):\n\treturn x ** 2\n",
    "",
]


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
    assert len(tok) == 300 and tok.eos_token == EOS
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges learned
    cached = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("bpe-300-")
    assert get_tokenizer("bpe-300", corpus=corpus).encode("lazy dog") == tok.encode("lazy dog")
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1  # no second training


def test_bad_names_are_clear():
    with pytest.raises(ValueError, match="expected bpe-<vocab size>"):
        get_tokenizer("bpe-big")
    with pytest.raises(ValueError, match="at least 257"):
        get_tokenizer("bpe-100", corpus=["abc"])
    with pytest.raises(
        ValueError, match="Offline, use 'gpt2', 'byte', 'bpe-<N>' or a local directory"
    ):
        get_tokenizer("someone/not-a-cached-tokenizer")


def words(n: int, seed: int) -> list[str]:
    """n documents of made-up words: a corpus whose BPE differs from the default corpus' one."""
    rng = np.random.default_rng(seed)
    vocab = ["".join(rng.choice(list("zqxjkvw"), size=rng.integers(4, 9))) for _ in range(60)]
    return [" ".join(rng.choice(vocab, size=80)) for _ in range(n)]


def test_bpe_8192_has_8192_tokens_on_the_default_corpus_and_prepare_uses_it(tmp_path):
    tok = get_tokenizer("bpe-8192")  # the train split of stdlib-docs: 2.1M characters
    assert len(tok) == 8192 and tok.eos_token == EOS
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert get_tokenizer("bpe-8192", corpus="stdlib-docs").encode(
        "the for statement"
    ) == tok.encode("the for statement")  # the same tokenizer, by name or by corpus
    index = prepare("stdlib-docs", "bpe-8192", tmp_path / "shards", max_tokens=3000, progress=False)
    assert index["tokenizer"] == "bpe-8192" and index["vocab_size"] == 8192
    assert index["options"]["bpe"] == Path(tok.name_or_path).name


def test_bpe_too_big_for_its_corpus_is_an_error_naming_the_sizes(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"bpe-2000: at most 2\d\d tokens can be learned from the texts "
        r"given \(14 characters; every word is then one token\): "
        r"use bpe-2\d\d or less",
    ):
        get_tokenizer("bpe-2000", corpus=["abc abd abe ab"])
    src = jsonl(tmp_path / "tiny.jsonl", ["hello there"] * 30)
    with pytest.raises(
        ValueError, match=r"from the train split of .*tiny.jsonl' \([\d,]+ characters"
    ):
        get_tokenizer("bpe-5000", corpus=str(src))
    assert not list((tmp_path / "cache" / "tokenizers").glob("bpe-*"))  # nothing smaller was cached


def test_prepare_trains_bpe_on_a_local_source(tmp_path):
    src = jsonl(tmp_path / "corpus.jsonl", words(200, seed=0))
    index = prepare(str(src), "bpe-400", tmp_path / "shards", progress=False)
    trained = get_tokenizer(index["tokenizer"])  # the index names the tokenizer it used exactly
    assert index["tokenizer"] != "bpe-400" and len(trained) == 400 == index["vocab_size"]
    same = get_tokenizer("bpe-400", corpus=str(src))
    default = get_tokenizer("bpe-400")  # trained on stdlib-docs instead
    sample = words(1, seed=0)[0]
    assert trained.encode(sample) == same.encode(sample)
    assert (
        len(trained.encode(sample)) < len(default.encode(sample)) / 2
    )  # its merges are the corpus'
    _, shards = open_shards(tmp_path / "shards")
    ids = np.concatenate(shards)
    assert ids.max() < 400 and trained.decode(ids[:40].tolist()).split()[0] in sample.split()
    with pytest.raises(
        ValueError, match="bpe-<N> tokenizer is trained on a local corpus; 'slimpajama'"
    ):
        prepare("slimpajama", "bpe-400", tmp_path / "remote", progress=False)


@pytest.mark.parametrize("name", ["byte", "bpe-300", "gpt2"])
def test_saved_tokenizers_load_back_exactly(name, tmp_path):
    from transformers import AutoTokenizer

    tok = get_tokenizer(
        name,
        corpus=[
            "the quick brown fox jumps over the lazy dog " * 20,
            "def f(x): return x + 1\n" * 20,
        ],
    )
    tok.save_pretrained(tmp_path / "tok")
    for loaded in (
        AutoTokenizer.from_pretrained(tmp_path / "tok"),
        get_tokenizer(tmp_path / "tok"),
    ):
        assert len(loaded) == len(tok) and loaded.eos_token_id == tok.eos_token_id
        for text in [*TEXTS, EOS + "x"]:
            assert loaded.encode(text) == tok.encode(text)
            assert loaded.decode(loaded.encode(text)) == tok.decode(tok.encode(text))


def test_a_directory_without_a_tokenizer_is_refused(tmp_path):
    import ssmkit

    model_dir = tmp_path / "model"
    ssmkit.build_model(ssmkit.ModelConfig.preset("tiny", vocab_size=257)).save_pretrained(model_dir)
    with pytest.raises(
        ValueError,
        match=r"model holds no tokenizer \(files there: \['config.json', "
        r"'model.safetensors'\]\); a tokenizer directory holds "
        r"tokenizer.json",
    ):
        get_tokenizer(model_dir)
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer"})
    )
    with pytest.raises(ValueError, match="holds no tokenizer"):
        get_tokenizer(str(model_dir))
    from tokenizers import Tokenizer, models

    # it loads, but knows no character of "Hello world": encodes it to []
    core = Tokenizer(models.BPE(vocab={"<|endoftext|>": 0, "a": 1}, merges=[]))
    core.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model \(2 tokens\) encodes 'Hello world' to no tokens"):
        get_tokenizer(model_dir)
