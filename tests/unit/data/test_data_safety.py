"""Data safety: every fault a user or the machine can cause is injected and must end in one clear
error (or be survived), never in silent wrong data, a half-written shard or a raw traceback.

Oracles: the bytes of a clean run, the token ids the byte tokenizer gives by definition (UTF-8
bytes, EOS = 256), and the files a fault must leave untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import jsonl

import ssmkit.data as D
from ssmkit import cli
from ssmkit.data import shards as S
from ssmkit.io import LOCK_FILE, DirLock, LockError

TEXTS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 5 + 1) for i in range(30)]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSMKIT_CACHE", str(tmp_path / "cache"))


def prep(src, out, **kw):
    return D.prepare(
        str(src), "byte", out, **{"split": "all", "shard_tokens": 500, "progress": False, **kw}
    )


def stream(folder):
    index = json.loads((folder / "index.json").read_text())
    return np.concatenate(
        [np.fromfile(folder / s["file"], dtype=index["dtype"]) for s in index["shards"]]
    )


def files(folder):
    """name -> bytes of what prepare leaves (the lock file aside)."""
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != LOCK_FILE
    }


def flip(path, at=0):
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def run_cli(capsys, *args):
    """``ssmkit data prepare ARGS`` in this process: (exit status, stderr)."""
    with pytest.raises(SystemExit) as done:
        cli.main(["data", "prepare", "--tokenizer", "byte", "--split", "all", *map(str, args)])
    return done.value.code, capsys.readouterr().err


def one_line(err):
    """The one line a terminal shows: a progress bar erased with carriage returns does not count."""
    lines = [line.split("\r")[-1].rstrip() for line in err.split("\n")]
    lines = [line for line in lines if line]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.fixture
def prepared(tmp_path):
    out = tmp_path / "w"
    prep(jsonl(tmp_path / "w.jsonl", TEXTS), out)
    return out


@pytest.fixture
def scans(monkeypatch):
    """Count the shard files read in full (sha256 + token ids); stamps count as settled at once."""
    calls, real = [], S._scan
    monkeypatch.setattr(
        S, "_scan", lambda path, dtype: calls.append(path.name) or real(path, dtype)
    )
    monkeypatch.setattr(S, "RACY_NS", 0)
    return calls


# ---- 1. shard checksums and token ids are verified -----------------------------------------------


def test_loader_verifies_once_then_trusts_unchanged_files(prepared, scans):
    n = len(json.loads((prepared / "index.json").read_text())["shards"])
    D.TokenLoader(prepared, seq_len=8, batch_size=2)
    assert len(scans) == n  # first open: every shard read
    D.TokenLoader(prepared, seq_len=8, batch_size=2)
    assert len(scans) == n  # second open: nothing read
    D.TokenLoader(prepared, seq_len=8, batch_size=2, verify=True)
    assert len(scans) == 2 * n  # True: always
    D.TokenLoader(prepared, seq_len=8, batch_size=2, verify=False)
    assert len(scans) == 2 * n  # False: sizes only
    with pytest.raises(ValueError, match="verify must be 'auto', True or False; got 'yes'"):
        D.TokenLoader(prepared, seq_len=8, batch_size=2, verify="yes")


def test_a_bit_flip_after_verification_is_still_caught(prepared, scans):
    D.TokenLoader(prepared, seq_len=8, batch_size=2)  # verified and remembered
    time.sleep(0.05)  # a later tick of the file clock
    shard = prepared / "shard_00001.bin"
    stamp = shard.stat()
    flip(shard, at=7)
    # same size, same mtime: ctime tells
    os.utime(shard, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    with pytest.raises(ValueError) as err:
        D.TokenLoader(prepared, seq_len=8, batch_size=2)
    message = str(err.value)
    assert (
        str(shard) in message and "sha256 differs" in message and "into a new directory" in message
    )
    flip(shard, at=7)  # repaired: accepted again
    D.TokenLoader(prepared, seq_len=8, batch_size=2)
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(
        ValueError, match=r"shard_00001.bin is corrupt: 998 bytes, the index says 1000; prepare"
    ):
        D.TokenLoader(prepared, seq_len=8, batch_size=2)
    shard.unlink()
    with pytest.raises(ValueError, match=r"shard_00001.bin is missing"):
        D.TokenLoader(prepared, seq_len=8, batch_size=2)


def test_files_changed_just_now_are_not_trusted_by_their_stamps(prepared, monkeypatch):
    calls, real = [], S._scan
    monkeypatch.setattr(
        S, "_scan", lambda path, dtype: calls.append(path.name) or real(path, dtype)
    )
    D.TokenLoader(prepared, seq_len=8, batch_size=2)
    D.TokenLoader(prepared, seq_len=8, batch_size=2)  # written < 2 s ago: read again
    n = len(json.loads((prepared / "index.json").read_text())["shards"])
    assert len(calls) == 2 * n


def test_token_ids_beyond_the_vocabulary_are_refused(prepared, tmp_path):
    index = json.loads((prepared / "index.json").read_text())
    index["vocab_size"] = 200  # the stream holds EOS = 256
    (prepared / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="holds token id 256, the index's vocab_size is 200"):
        D.TokenLoader(prepared, seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match="holds token id 256"):
        D.write_mds(prepared, tmp_path / "mds", 8, progress=False)
    D.TokenLoader(prepared, seq_len=8, batch_size=2, verify=False)  # sizes alone pass


def test_a_cache_that_cannot_be_read_or_written_does_not_break_loading(
    prepared, tmp_path, monkeypatch, scans
):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("SSMKIT_CACHE", str(blocker))  # mkdir under a file: OSError
    D.TokenLoader(prepared, seq_len=8, batch_size=2)
    D.TokenLoader(prepared, seq_len=8, batch_size=2)
    n = len(json.loads((prepared / "index.json").read_text())["shards"])
    # nothing remembered, still checked
    assert len(scans) == 2 * n
    monkeypatch.setenv("SSMKIT_CACHE", str(tmp_path / "cache2"))

    def read_only(*args, **kw):
        raise OSError(errno.EROFS, "Read-only file system")

    real_write_json = S.write_json
    monkeypatch.setattr(S, "write_json", read_only)
    D.TokenLoader(prepared, seq_len=8, batch_size=2)
    assert not (tmp_path / "cache2" / "verified").exists() or not any(
        (tmp_path / "cache2" / "verified").iterdir()
    )
    monkeypatch.setattr(S, "write_json", real_write_json)
    monkeypatch.setenv("SSMKIT_CACHE", str(tmp_path / "cache3"))
    D.TokenLoader(prepared, seq_len=8, batch_size=2)
    (cached,) = (tmp_path / "cache3" / "verified").iterdir()
    cached.write_text('{"dir": ')  # truncated: ignored, rewritten
    before = len(scans)
    D.TokenLoader(prepared, seq_len=8, batch_size=2)
    assert len(scans) == before + n and json.loads(cached.read_text())["dir"] == str(
        prepared.resolve()
    )


def test_prepare_checks_finished_shards_before_calling_them_done(tmp_path):
    src = jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "out"
    prep(src, out)
    shard = out / "shard_00002.bin"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(ValueError, match="shard_00002.bin is corrupt: 996 bytes"):
        prep(src, out)
    shard.write_bytes(b"\x00" * 1000)  # right size, wrong bytes
    with pytest.raises(ValueError, match="shard_00002.bin is corrupt: its sha256 differs"):
        prep(src, out)


# ---- 2. a local corpus edited after preparing ----------------------------------------------------


def test_source_fingerprint_follows_the_files(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    jsonl(folder / "a.jsonl", TEXTS[:3])
    first = D.source_fingerprint(str(folder))
    assert (
        isinstance(first, str) and len(first) == 16 and D.source_fingerprint(str(folder)) == first
    )
    (folder / "notes.md").write_text("not a source file")  # not read: no change
    assert D.source_fingerprint(str(folder)) == first
    jsonl(folder / "b.jsonl", TEXTS[3:4])
    second = D.source_fingerprint(str(folder))
    assert second != first
    # same size, new content and mtime
    jsonl(folder / "b.jsonl", TEXTS[4:5])
    assert D.source_fingerprint(str(folder)) != second
    assert D.source_fingerprint("stdlib-docs") == D.source_fingerprint("stdlib-docs") is not None
    assert (
        D.source_fingerprint("fineweb-edu") is None
        and D.source_fingerprint(str(tmp_path / "nope")) is None
    )


def test_an_edited_corpus_is_not_served_from_stale_shards(tmp_path):
    src = jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "out"
    first = prep(src, out)
    assert first["options"]["source_fingerprint"] == D.source_fingerprint(str(src))
    jsonl(src, TEXTS[::-1])  # same size, other order
    with pytest.raises(
        ValueError,
        match=r"the source .*d.jsonl' changed since .*out was prepared.*another directory",
    ):
        prep(src, out)
    again = prep(src, tmp_path / "new")
    expected = [b for t in TEXTS[::-1] for b in (*t.encode(), 256)]
    assert stream(tmp_path / "new").tolist() == expected and again["total_tokens"] == len(expected)


def test_an_edited_corpus_is_not_resumed_and_an_edit_during_prepare_is_caught(
    tmp_path, monkeypatch
):
    src = jsonl(tmp_path / "d.jsonl", TEXTS)
    real, calls = S.write_atomically, []

    def crash_on_second_shard(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(S, "write_atomically", crash_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        prep(src, tmp_path / "out")
    monkeypatch.setattr(S, "write_atomically", real)
    jsonl(src, TEXTS[:-1])
    with pytest.raises(ValueError, match="changed since"):
        prep(src, tmp_path / "out")
    real_load = S.load_source

    def edit_while_reading(name, split):
        for i, doc in enumerate(real_load(name, split)):
            if i == 5:
                jsonl(src, TEXTS)
            yield doc

    monkeypatch.setattr(S, "load_source", edit_while_reading)
    with pytest.raises(ValueError, match="changed while it was being prepared"):
        prep(src, tmp_path / "during")
    assert not (tmp_path / "during" / "index.json").exists()


# ---- 3. one writer per directory -----------------------------------------------------------------


def test_a_second_prepare_into_a_busy_directory_is_refused_naming_the_holder(tmp_path):
    src = jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "out"
    with DirLock(out, "data prepare"):
        with pytest.raises(LockError, match=r"in use by this process .*data prepare since"):
            prep(src, out)
    assert files(out) == {}  # nothing written meanwhile
    with DirLock(out / "mds", "MDS conversion"):
        with pytest.raises(LockError, match="MDS conversion"):
            prep(src, out, mds_seq_len=16)
    assert (out / "index.json").exists() and not (out / "mds" / "index.json").exists()


def test_a_second_process_holding_the_directory_is_named(tmp_path):
    """A real second process holds the directory: refused with its pid; after it exits, prepare
    runs."""
    src = jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "out"
    io_py = str(Path(S.__file__).parents[1] / "io.py")  # ssmkit.io alone: no torch import
    holder = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('io_only', {io_py!r})\n"
        "io = importlib.util.module_from_spec(spec); spec.loader.exec_module(io)\n"
        f"lock = io.DirLock({str(out)!r}, 'data prepare').acquire()\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LockError, match=rf"pid {child.pid} on .*data prepare"):
            prep(src, out)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert prep(src, out)["documents"] == len(TEXTS)


def test_lock_wait_waits_for_the_holder(tmp_path):
    src = jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "out"
    lock = DirLock(out, "data prepare").acquire()
    threading.Timer(0.5, lock.release).start()
    t0 = time.monotonic()
    assert prep(src, out, lock_wait=30)["documents"] == len(TEXTS)
    assert 0.4 < time.monotonic() - t0 < 25


# ---- 4. names read from index.json / progress.json stay inside their folder ----------------------


def test_a_shard_name_with_a_path_is_refused_everywhere(prepared, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"top secret token bytes!!" * 100)  # a plausible size for a shard
    index = json.loads((prepared / "index.json").read_text())
    index["shards"][0] = {
        "file": "../secret.txt",
        "tokens": len(secret.read_bytes()) // 2,
        "sha256": hashlib.sha256(secret.read_bytes()).hexdigest(),
    }
    index["total_tokens"] = sum(s["tokens"] for s in index["shards"])
    (prepared / "index.json").write_text(json.dumps(index))
    for verify in ("auto", True, False):
        with pytest.raises(ValueError, match=r"holds '../secret.txt'.*refusing to read outside"):
            D.TokenLoader(prepared, seq_len=8, batch_size=1, verify=verify)
    with pytest.raises(ValueError, match="refusing to read outside"):
        D.write_mds(prepared, tmp_path / "mds", 8, progress=False)


def test_progress_json_and_mds_index_names_are_checked_too(tmp_path, monkeypatch):
    src = jsonl(tmp_path / "d.jsonl", TEXTS)
    real, calls = S.write_atomically, []
    monkeypatch.setattr(
        S,
        "write_atomically",
        lambda p, d: (
            (calls.append(p), real(p, d))
            if len(calls) < 2
            else (_ for _ in ()).throw(KeyboardInterrupt)
        ),
    )
    with pytest.raises(KeyboardInterrupt):
        prep(src, tmp_path / "out")
    monkeypatch.setattr(S, "write_atomically", real)
    progress = tmp_path / "out" / "progress.json"
    state = json.loads(progress.read_text())
    state["shards"][0]["file"] = "/etc/hostname"
    progress.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"progress.json holds '/etc/hostname'"):
        prep(src, tmp_path / "out")
    # plain, but not the shard it must be
    state["shards"][0]["file"] = "index.json"
    progress.write_text(json.dumps(state))
    with pytest.raises(
        ValueError, match=r"progress.json holds 'index.json'; expected a name matching shard_00000"
    ):
        prep(src, tmp_path / "out")
    progress.write_text(json.dumps(state)[:40])  # truncated
    with pytest.raises(
        ValueError, match=r"progress file .*progress.json cannot be read .*truncated"
    ):
        prep(src, tmp_path / "out")

    src_dir = tmp_path / "w"
    prep(src, src_dir)
    D.write_mds(src_dir, tmp_path / "m", 8, progress=False)
    mds_index = tmp_path / "m" / "index.json"
    obj = json.loads(mds_index.read_text())
    obj["shards"][0]["raw_data"]["basename"] = "../w/shard_00000.bin"
    mds_index.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="refusing to read outside"):
        list(D.read_mds(tmp_path / "m"))
    del obj["shards"][0]["raw_data"]
    mds_index.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="a shard entry is malformed"):
        list(D.read_mds(tmp_path / "m"))
    mds_index.write_text("{")
    with pytest.raises(ValueError, match="MDS index .* cannot be read"):
        list(D.read_mds(tmp_path / "m"))


def test_a_truncated_or_foreign_index_is_one_clear_error(prepared):
    text = (prepared / "index.json").read_text()
    (prepared / "index.json").write_text(text[: len(text) // 2])
    with pytest.raises(
        ValueError, match=r"shard index .*index.json cannot be read .*corrupt or truncated"
    ):
        D.TokenLoader(prepared, seq_len=8, batch_size=1)
    with pytest.raises(ValueError, match="cannot be read"):
        D.prepare(
            str(prepared.parent / "w.jsonl"),
            "byte",
            prepared,
            split="all",
            shard_tokens=500,
            progress=False,
        )
    for foreign in (
        [1, 2],
        {"dtype": "float32", "shards": [], "vocab_size": 3},
        {"dtype": "uint16", "shards": {}},
    ):
        (prepared / "index.json").write_text(json.dumps(foreign))
        with pytest.raises(ValueError, match="index.json"):
            D.TokenLoader(prepared, seq_len=8, batch_size=1)


def test_shard_files_not_written_by_prepare_are_left_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard_00000.bin").write_bytes(b"mine")
    with pytest.raises(ValueError, match="shard_00000.bin but no index.json or progress.json"):
        prep(jsonl(tmp_path / "d.jsonl", TEXTS), out)
    assert (out / "shard_00000.bin").read_bytes() == b"mine"


# ---- 5. empty sources and bad arguments ----------------------------------------------------------


def test_blank_documents_are_skipped_and_an_all_blank_source_refused(tmp_path):
    mixed = ["", TEXTS[0], "   \n\t", TEXTS[1], "\n"]
    index = prep(jsonl(tmp_path / "m.jsonl", mixed), tmp_path / "m")
    assert stream(tmp_path / "m").tolist() == [b for t in TEXTS[:2] for b in (*t.encode(), 256)]
    assert index["documents"] == 5 and index["empty_documents"] == 3
    with pytest.raises(
        ValueError, match=r"source '.*blank.jsonl' \(all split\) has no text: its 3 documents are"
    ):
        prep(jsonl(tmp_path / "blank.jsonl", ["", " ", "\n\n"]), tmp_path / "b")
    with pytest.raises(ValueError, match=r"has no documents"):
        prep(jsonl(tmp_path / "none.jsonl", []), tmp_path / "n")
    assert not (tmp_path / "b" / "index.json").exists()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(workers=-3), "workers must be a positive integer; got -3"),
        (dict(workers=0), "workers must be a positive integer; got 0"),
        (dict(workers=True), "workers must be a positive integer; got True"),
        (dict(workers=2.0), "workers must be a positive integer; got 2.0"),
        (dict(max_tokens=0), "max_tokens must be a positive integer or None; got 0"),
        (dict(max_tokens="100"), "max_tokens must be a positive integer or None; got '100'"),
        (dict(shard_tokens=0), "shard_tokens must be a positive integer; got 0"),
        (dict(shard_tokens=False), "shard_tokens must be a positive integer; got False"),
        (dict(lock_wait=-1), "lock_wait must be a number >= 0; got -1"),
        (dict(lock_wait=True), "lock_wait must be a number >= 0"),
        (dict(dtype="int8"), "dtype 'int8' is not valid"),
        (dict(split="dev"), "split 'dev' is not valid; valid splits: train, validation, all"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prep(jsonl(tmp_path / "d.jsonl", TEXTS), tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()


def test_bad_sources_and_tokenizers_are_refused_before_anything_is_written(tmp_path):
    jsonl(tmp_path / "d.jsonl", TEXTS)
    for source, message in (
        (42, "source must be a name, a path or an iterable of Document; got int"),
        (b"x.jsonl", "source must be a name"),
        ("", "unknown source ''"),
    ):
        with pytest.raises(ValueError, match=message):
            D.prepare(source, "byte", tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="tokenizer must be a name"):
        D.prepare("stdlib-docs", None, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match=r"document 'x' has no text string \(got NoneType\)"):
        D.prepare([D.Document("x", None)], "byte", tmp_path / "docs", progress=False)
    assert not (tmp_path / "out").exists()
    # a Path works
    as_path = D.prepare(tmp_path / "d.jsonl", "byte", tmp_path / "p", split="all", progress=False)
    assert as_path["options"]["source"] == str(tmp_path / "d.jsonl")


@pytest.mark.parametrize(
    "option, value",
    [
        ("--workers", "-3"),
        ("--max-tokens", "0"),
        ("--shard-tokens", "0"),
        ("--workers", "two"),
        ("--mds-seq-len", "-1"),
    ],
)
def test_cli_refuses_bad_counts_at_the_door(tmp_path, capsys, option, value):
    code, err = run_cli(capsys, "--source", "stdlib-docs", "--out", tmp_path / "out", option, value)
    assert code == 2 and "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(f"argument {option}: {value!r} is not a positive integer")
    )
    assert not (tmp_path / "out").exists()


# ---- 6. malformed records: file and line named, one line on the command line ---------------------


@pytest.mark.parametrize(
    "line, what",
    [
        ('{"txt": "hello"}', "has no field 'text'"),
        ('{"text": 5}', "has 'text' of type int"),
        ('{"text": null}', "has 'text' of type NoneType"),
        ('["text"]', "is not a JSON object"),
        ('{"text": "unterminated', "not valid JSON"),
    ],
)
def test_a_bad_jsonl_line_names_file_line_and_field(tmp_path, capsys, line, what):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"d.jsonl, line 3: .*{what}"):
        prep(src, tmp_path / "out")
    code, err = run_cli(capsys, "--source", src, "--out", tmp_path / "cli")
    message = one_line(err)
    assert (
        code == 1 and message.startswith("ssmkit data prepare: ") and "d.jsonl, line 3" in message
    )
    assert "'text'" in message
    # fixed: the same command now runs
    jsonl(src, ["fine", "fixed"])
    prep(src, tmp_path / "out")
    assert stream(tmp_path / "out").tolist() == [*b"fine", 256, *b"fixed", 256]


def test_bad_parquet_arrow_and_text_files_name_the_file(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    cases = {}
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "nocol.parquet")
    cases["nocol.parquet"] = "no column 'text'; its columns: body"
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "null.parquet")
    cases["null.parquet"] = r"null.parquet, row 2: column 'text' is NoneType, expected a string"
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    cases["ints.parquet"] = r"ints.parquet, row 1: column 'text' is int"
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    cases["junk.parquet"] = r"junk.parquet: cannot be read as parquet"
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    cases["latin1.txt"] = r"latin1.txt: not UTF-8 text"
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message):
            prep(tmp_path / name, tmp_path / f"out-{name}")
        code, err = run_cli(capsys, "--source", tmp_path / name, "--out", tmp_path / f"cli-{name}")
        assert code == 1 and name in one_line(err)
    # the IPC *file* format reads too
    table = pa.table({"text": ["alpha", "beta"]})
    with pa.ipc.new_file(str(tmp_path / "f.arrow"), table.schema) as writer:
        writer.write_table(table)
    assert [d.text for d in D.load_source(str(tmp_path / "f.arrow"), "all")] == ["alpha", "beta"]


def test_cli_prints_one_line_for_data_errors(tmp_path, capsys, prepared):
    code, err = run_cli(
        capsys, "--source", tmp_path / "w.jsonl", "--out", prepared, "--shard-tokens", "7"
    )
    assert code == 1 and "other options (shard_tokens: 500 there, 7 now)" in one_line(err)
    with DirLock(tmp_path / "busy", "data prepare"):
        code, err = run_cli(capsys, "--source", tmp_path / "w.jsonl", "--out", tmp_path / "busy")
    assert code == 1 and "in use by" in one_line(err)
    flip(prepared / "shard_00000.bin")
    code, err = run_cli(
        capsys, "--source", tmp_path / "w.jsonl", "--out", prepared, "--shard-tokens", "500"
    )
    assert code == 1 and "shard_00000.bin is corrupt" in one_line(err)


# ---- 7. disk full, read-only: no half shard, one line, and a re-run finishes the same ------------


def fail_writes(monkeypatch, marker, err, times=1):
    """The next ``times`` fsyncs of a file whose name contains ``marker`` fail with OSError(err)."""
    real, left = os.fsync, [times]

    def fsync(fd):
        if marker in os.readlink(f"/proc/self/fd/{fd}") and left[0] > 0:
            left[0] -= 1
            raise OSError(err, os.strerror(err))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize(
    "err, hint", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only")]
)
def test_a_failed_shard_write_leaves_no_half_shard_and_a_rerun_matches(
    tmp_path, monkeypatch, capsys, err, hint
):
    src = jsonl(tmp_path / "d.jsonl", TEXTS)
    prep(src, tmp_path / "clean")
    fail_writes(monkeypatch, "shard_00002.bin", err)
    with pytest.raises(OSError) as exc:
        prep(src, tmp_path / "out")
    assert exc.value.errno == err and exc.value.filename.endswith("shard_00002.bin")
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    # no temp, no half shard
    assert left == [LOCK_FILE, "progress.json", "shard_00000.bin", "shard_00001.bin"]
    assert len(json.loads((tmp_path / "out" / "progress.json").read_text())["shards"]) == 2
    monkeypatch.undo()
    prep(src, tmp_path / "out")
    assert files(tmp_path / "out") == files(tmp_path / "clean")  # byte-identical
    fail_writes(monkeypatch, "shard_00001.bin", err)
    code, out = run_cli(capsys, "--source", src, "--out", tmp_path / "cli", "--shard-tokens", "500")
    message = one_line(out)
    assert code == 1 and "shard_00001.bin" in message and hint in message


def test_a_killed_run_s_temp_file_is_cleared_on_resume(tmp_path, monkeypatch):
    src = jsonl(tmp_path / "d.jsonl", TEXTS)
    prep(src, tmp_path / "clean")
    fail_writes(monkeypatch, "shard_00001.bin", errno.ENOSPC)
    with pytest.raises(OSError):
        prep(src, tmp_path / "out")
    monkeypatch.undo()
    (tmp_path / "out" / ".shard_00001.bin.tmp-4242").write_bytes(b"half")  # what a SIGKILL leaves
    prep(src, tmp_path / "out")
    assert files(tmp_path / "out") == files(tmp_path / "clean")


def test_a_failed_mds_write_leaves_no_half_shard_and_a_rerun_matches(
    prepared, tmp_path, monkeypatch, capsys
):
    kw = dict(seq_len=16, size_limit=600, progress=False)
    D.write_mds(prepared, tmp_path / "clean", **kw)
    fail_writes(monkeypatch, "shard.00002.mds", errno.ENOSPC)
    with pytest.raises(OSError) as exc:
        D.write_mds(prepared, tmp_path / "mds", **kw)
    assert exc.value.filename.endswith("shard.00002.mds")
    assert sorted(p.name for p in (tmp_path / "mds").iterdir()) == [
        LOCK_FILE,
        "shard.00000.mds",
        "shard.00001.mds",
    ]
    monkeypatch.undo()
    D.write_mds(prepared, tmp_path / "mds", **kw)
    assert files(tmp_path / "mds") == files(tmp_path / "clean")
    fail_writes(monkeypatch, "shard.00000.mds", errno.ENOSPC)
    code, err = run_cli(
        capsys,
        "--source",
        tmp_path / "w.jsonl",
        "--out",
        prepared,
        "--shard-tokens",
        "500",
        "--mds-seq-len",
        "16",
    )
    message = one_line(err)
    assert code == 1 and "shard.00000.mds: the disk is full" in message


# ---- 8. the rest ---------------------------------------------------------------------------------


def test_loader_arguments_and_state_are_checked(prepared):
    for kw in (
        dict(seq_len="8"),
        dict(seq_len=True),
        dict(batch_size=0),
        dict(rank=2, world_size=2),
    ):
        with pytest.raises(ValueError, match="need integers seq_len >= 1"):
            D.TokenLoader(prepared, **{"seq_len": 8, "batch_size": 2, **kw})
    loader = D.TokenLoader(prepared, seq_len=8, batch_size=2)
    state = loader.state_dict()
    for bad in (
        {k: v for k, v in state.items() if k != "step"},
        {**state, "epoch": -1},
        {**state, "step": 10**9},
    ):
        with pytest.raises(ValueError, match="loader state has epoch="):
            loader.load_state_dict(bad)
    with pytest.raises(ValueError, match="must be a dict"):
        loader.load_state_dict(None)


def test_mds_size_limit_infinity_is_a_clear_error(prepared, tmp_path):
    with pytest.raises(ValueError, match="size_limit 'inf mb' is not a size"):
        D.write_mds(prepared, tmp_path / "m", 8, size_limit="inf mb", progress=False)
    assert not (tmp_path / "m").exists()  # refused before the lock is made


def test_a_directory_named_like_a_text_file_is_not_read(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "chapter.txt").mkdir(parents=True)
    (folder / "real.txt").write_text("real text")
    assert [d.text for d in D.load_source(str(folder), "all")] == ["real text"]
