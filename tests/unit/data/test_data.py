"""Sources, shard preparation and the loader: exact token accounting, resume, and rank splits."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from helpers import jsonl

import ssmkit.data as D
from ssmkit.data import shards as shards_mod
from ssmkit.data.sources import in_validation
from ssmkit.io import LOCK_FILE


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSMKIT_CACHE", str(tmp_path / "cache"))


TEXTS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(40)]


def read_tokens(folder):
    index = json.loads((folder / "index.json").read_text())
    return np.concatenate(
        [np.fromfile(folder / s["file"], dtype=index["dtype"]) for s in index["shards"]]
    )


def test_stdlib_docs_is_stable_and_split_by_hash():
    train, val = list(D.stdlib_docs("train")), list(D.stdlib_docs("validation"))
    ids = [d.id for d in train]
    assert ids[0].startswith("pydoc:") and any(i.startswith("stdlib:") for i in ids)
    assert len(set(ids)) == len(ids) and not set(ids) & {d.id for d in val}
    assert all(in_validation(d.id) for d in val) and not any(in_validation(i) for i in ids)
    assert sum(len(d.text) for d in train) > 1_000_000  # over a million characters of prose
    again = itertools.islice(D.stdlib_docs("train"), 50)
    assert [d.id for d in again] == ids[:50]  # same order every time


def test_prepare_counts_every_token_plus_eos(tmp_path):
    src = jsonl(tmp_path / "docs.jsonl", TEXTS)
    index = D.prepare(
        str(src), "byte", tmp_path / "out", split="all", shard_tokens=500, progress=False
    )
    expected = [b for t in TEXTS for b in (*t.encode("utf-8"), 256)]  # bytes, then EOS (id 256)
    assert index["total_tokens"] == len(expected) and index["documents"] == len(TEXTS)
    assert index["dtype"] == "uint16" and all(s["tokens"] == 500 for s in index["shards"][:-1])
    assert read_tokens(tmp_path / "out").tolist() == expected
    mtimes = {
        p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir() if p.name != LOCK_FILE
    }
    assert (
        D.prepare(str(src), "byte", tmp_path / "out", split="all", shard_tokens=500, progress=False)
        == index
    )
    assert {
        p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir() if p.name != LOCK_FILE
    } == mtimes


def test_max_tokens_budget(tmp_path):
    index = D.prepare(
        "stdlib-docs",
        "byte",
        tmp_path / "out",
        max_tokens=12_345,
        shard_tokens=5_000,
        progress=False,
    )
    assert index["total_tokens"] == 12_345 and [s["tokens"] for s in index["shards"]] == [
        5000,
        5000,
        2345,
    ]


def test_a_crash_mid_way_then_rerun_gives_identical_shards(tmp_path, monkeypatch):
    src = jsonl(tmp_path / "docs.jsonl", TEXTS)
    kw = dict(split="all", shard_tokens=333, progress=False)  # shards end inside documents
    D.prepare(str(src), "byte", tmp_path / "clean", **kw)
    real, calls = shards_mod.write_atomically, []

    def crash_on_fourth(path, data):
        calls.append(path.name)
        if len(calls) == 4:
            raise KeyboardInterrupt("killed")
        real(path, data)

    monkeypatch.setattr(shards_mod, "write_atomically", crash_on_fourth)
    with pytest.raises(KeyboardInterrupt):
        D.prepare(str(src), "byte", tmp_path / "resumed", **kw)
    monkeypatch.setattr(shards_mod, "write_atomically", real)
    assert (tmp_path / "resumed" / "progress.json").exists()
    assert not (tmp_path / "resumed" / "index.json").exists()
    kept = (tmp_path / "resumed" / "shard_00000.bin").stat().st_mtime_ns
    D.prepare(str(src), "byte", tmp_path / "resumed", **kw)
    assert (
        tmp_path / "resumed" / "shard_00000.bin"
    ).stat().st_mtime_ns == kept  # finished shards kept
    clean, resumed = (
        sorted((tmp_path / "clean").iterdir()),
        sorted((tmp_path / "resumed").iterdir()),
    )
    assert [p.name for p in clean] == [p.name for p in resumed]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(clean, resumed, strict=True))


def test_workers_give_the_same_shards(tmp_path):
    src = jsonl(tmp_path / "docs.jsonl", TEXTS)
    one = D.prepare(
        str(src), "byte", tmp_path / "one", split="all", shard_tokens=700, progress=False
    )
    two = D.prepare(
        str(src), "byte", tmp_path / "two", split="all", shard_tokens=700, workers=2, progress=False
    )
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]


@pytest.fixture
def prepared(tmp_path):
    rng = np.random.default_rng(0)  # 60 docs x 64 tokens = 3840 tokens
    texts = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 63)) for _ in range(60)]
    D.prepare(
        str(jsonl(tmp_path / "w.jsonl", texts)),
        "byte",
        tmp_path / "w",
        split="all",
        shard_tokens=1000,
        progress=False,
    )
    return tmp_path / "w"


def window_ids(x, loader):
    """Recover each window's index from its tokens (window i starts at token i * seq_len)."""
    flat = read_tokens(loader.dir).astype(np.int64).tolist()
    n = loader.seq_len
    starts = {tuple(flat[i * n : i * n + n]): i for i in range(loader.n_windows)}
    assert len(starts) == loader.n_windows  # random text: windows are distinct
    return [starts[tuple(row.tolist())] for row in x]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_window_once_per_epoch_across_ranks(prepared, world_size):
    seen = []
    for rank in range(world_size):
        loader = D.TokenLoader(
            prepared, seq_len=31, batch_size=2, rank=rank, world_size=world_size, seed=3
        )
        assert loader.n_windows == 123 and loader.batches_per_epoch == 123 // world_size // 2
        it = iter(loader)
        for _ in range(loader.batches_per_epoch):
            x, y = next(it)
            assert x.shape == (2, 31) and torch.equal(x[:, 1:], y[:, :-1])
            seen += window_ids(x, loader)
    assert len(seen) == len(set(seen))  # no window twice, no rank overlap
    assert 123 - len(seen) < world_size * 2  # only the uneven remainder is left out


def test_resume_continues_with_the_same_batches(prepared):
    straight = D.TokenLoader(prepared, seq_len=40, batch_size=3, seed=1)
    it = iter(straight)
    reference = [
        next(it) for _ in range(2 * straight.batches_per_epoch + 3)
    ]  # crosses two epoch boundaries
    first = D.TokenLoader(prepared, seq_len=40, batch_size=3, seed=1)
    it = iter(first)
    k = straight.batches_per_epoch + 2
    head = [next(it) for _ in range(k)]
    second = D.TokenLoader(prepared, seq_len=40, batch_size=3, seed=1)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    it2 = iter(second)
    tail = [next(it2) for _ in range(len(reference) - k)]
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(reference, head + tail, strict=True)
    )
    other = D.TokenLoader(prepared, seq_len=41, batch_size=3, seed=1)
    with pytest.raises(ValueError, match="seq_len=40"):
        other.load_state_dict(first.state_dict())


def test_clear_errors(prepared, tmp_path, monkeypatch):
    shard = prepared / "shard_00000.bin"
    blob = shard.read_bytes()
    shard.write_bytes(blob[:-2])
    with pytest.raises(ValueError, match="is corrupt: 1998 bytes, the index says 2000"):
        D.TokenLoader(prepared, seq_len=8, batch_size=1)
    shard.write_bytes(bytes([blob[0] ^ 1]) + blob[1:])
    D.TokenLoader(prepared, seq_len=8, batch_size=1, verify=False)  # the size check alone passes
    for verify in ("auto", True):  # the default checks the sha256 too
        with pytest.raises(ValueError, match="sha256 differs"):
            D.TokenLoader(prepared, seq_len=8, batch_size=1, verify=verify)
    with pytest.raises(ValueError, match="has no documents"):
        D.prepare(
            str(jsonl(tmp_path / "empty.jsonl", [])),
            "byte",
            tmp_path / "e",
            split="all",
            progress=False,
        )
    with pytest.raises(ValueError, match="unknown source 'wikipedia-9000'; valid: 'stdlib-docs'"):
        D.prepare("wikipedia-9000", "byte", tmp_path / "u", progress=False)

    class Huge:
        eos_token_id = 0

        def __len__(self):
            return 70_000

    monkeypatch.setattr(shards_mod, "get_tokenizer", lambda name: Huge())
    with pytest.raises(ValueError, match="do not fit uint16"):
        D.prepare("stdlib-docs", "huge", tmp_path / "h", dtype="uint16", progress=False)
    with pytest.raises(ValueError, match="no index.json"):
        D.TokenLoader(tmp_path, seq_len=8, batch_size=1)


def test_data_prepare_command(tmp_path):
    import os
    import subprocess
    import sys

    def prepare_cli(source, out):
        cmd = [
            sys.executable,
            "-m",
            "ssmkit.cli",
            "data",
            "prepare",
            "--source",
            source,
            "--tokenizer",
            "byte",
            "--out",
            str(out),
            "--max-tokens",
            "5000",
            "--shard-tokens",
            "2000",
        ]
        return subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "SSMKIT_CACHE": str(tmp_path)}
        )

    done = prepare_cli("stdlib-docs", tmp_path / "o")
    assert done.returncode == 0 and "5,000 tokens" in done.stdout, done.stderr
    bad = prepare_cli("nowhere-corpus", tmp_path / "other")
    assert bad.returncode == 1 and "unknown source 'nowhere-corpus'" in bad.stderr


def test_local_parquet_txt_and_directory_sources(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder = tmp_path / "corpus"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["alpha doc", "beta doc"]}), folder / "a.parquet")
    (folder / "b.txt").write_text("gamma doc")
    jsonl(folder / "c.jsonl", ["delta doc"])
    docs = list(D.load_source(str(folder), "all"))
    assert [d.text for d in docs] == ["alpha doc", "beta doc", "gamma doc", "delta doc"]
    assert len({d.id for d in docs}) == 4
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no readable text files"):
        D.load_source(str(empty), "all")


def test_remote_corpus_offline_names_the_alternatives(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert set(D.REMOTE) == {
        "slimpajama",
        "slimpajama-6b",
        "fineweb-edu",
        "pile",
        "c4",
        "openwebtext2",
    }
    with pytest.raises(ValueError, match="Offline, use 'stdlib-docs' or local files"):
        D.load_source("fineweb-edu")


def test_loader_batches_train_a_model(prepared):
    import ssmkit

    loader = D.TokenLoader(prepared, seq_len=32, batch_size=4, seed=0)
    model = ssmkit.build_model(ssmkit.ModelConfig(d_model=32, n_layer=1, vocab_size=257))
    x, y = next(iter(loader))
    shifted = model(x, labels=y, shift_labels=False).loss
    aligned = model(torch.cat([x, y[:, -1:]], dim=1), labels=torch.cat([x, y[:, -1:]], dim=1)).loss
    torch.testing.assert_close(
        shifted, aligned, atol=1e-5, rtol=0
    )  # the two label conventions agree
