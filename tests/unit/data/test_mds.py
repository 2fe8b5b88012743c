"""MDS (MosaicML streaming) output: the bytes streaming's MDSWriter writes, round trips, errors.

The format facts checked by hand here come from mosaicml/streaming (v0.13,
streaming/base/format/mds/ writer.py, reader.py, encodings.py and base/format/base/writer.py). The
last test runs the real library, when an interpreter that has it is at hand: this one, or
``$SSMKIT_STREAMING_PYTHON``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import ssmkit.data as D
from ssmkit.data import mds as M
from ssmkit.io import LOCK_FILE


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSMKIT_CACHE", str(tmp_path / "cache"))


def fake_prepared(folder, tokens, dtype="uint16", shard_tokens=100):
    """A prepared directory (the layout ``prepare`` writes) holding exactly ``tokens``."""
    folder.mkdir(parents=True)
    tokens = np.asarray(tokens, dtype=dtype)
    shards = []
    for k, lo in enumerate(range(0, len(tokens), shard_tokens)):
        data = tokens[lo : lo + shard_tokens].tobytes()
        (folder / f"shard_{k:05d}.bin").write_bytes(data)
        shards.append(
            {
                "file": f"shard_{k:05d}.bin",
                "tokens": len(tokens[lo : lo + shard_tokens]),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    index = dict(
        version=1,
        tokenizer="test",
        vocab_size=int(tokens.max()) + 1,
        eos_token_id=0,
        dtype=dtype,
        total_tokens=len(tokens),
        documents=1,
        shards=shards,
        options={},
    )
    (folder / "index.json").write_text(json.dumps(index))
    return folder


def config_text(width, itemsize, dtype, size_limit, hashes=("sha256",)):
    """The shard config JSON as streaming writes it (json.dumps, sorted keys), spelled out."""
    # %-format on purpose: the JSON's own braces would need doubling in an f-string
    return (
        '{"column_encodings": ["ndarray:%s:%d"], "column_names": ["tokens"], '  # noqa: UP031
        '"column_sizes": [%d], "compression": null, "format": "mds", "hashes": [%s], '
        '"size_limit": %s, "version": 2}'
        % (
            dtype,
            width,
            width * itemsize,
            ", ".join(f'"{h}"' for h in hashes),
            "null" if size_limit is None else size_limit,
        )
    )


def expected_shard(windows, config):
    """An MDS shard by the format's definition: count, offsets (absolute, last = size), config,
    samples."""
    n, body = len(windows), b"".join(w.tobytes() for w in windows)
    start = 4 + 4 * (n + 1) + len(config)
    offsets = [start + sum(len(w.tobytes()) for w in windows[:i]) for i in range(n + 1)]
    return struct.pack("<I", n) + struct.pack(f"<{n + 1}I", *offsets) + config.encode() + body


def test_shard_bytes_and_index_are_streamings_format(tmp_path):
    # 23 tokens, seq_len 4: 5 windows of 5, 2 dropped
    tokens = np.arange(3, 3 + 23) * 1000 % 65536
    src = fake_prepared(tmp_path / "src", tokens, shard_tokens=7)  # windows cross the source shards
    config = config_text(5, 2, "uint16", 999).replace("999", "LLL")
    limit = 8 + len(config) + 3 * (10 + 4)  # a shard holds exactly three samples
    assert len(str(limit)) == 3
    config = config.replace("LLL", str(limit))
    assert config == json.dumps(M.shard_config("uint16", 4, limit, ["sha256"]), sort_keys=True)
    meta = D.write_mds(src, tmp_path / "mds", 4, size_limit=limit, progress=False)
    assert meta["samples"] == 5 and meta["shards"] == 2 and meta["tokens_covered"] == 21
    windows = [tokens[i * 4 : i * 4 + 5].astype(np.uint16) for i in range(5)]
    files = [expected_shard(windows[:3], config), expected_shard(windows[3:], config)]
    for k, data in enumerate(files):
        assert (tmp_path / "mds" / f"shard.{k:05d}.mds").read_bytes() == data
    assert (
        files[0][:4] == b"\x03\x00\x00\x00" and len(files[0]) == limit
    )  # full: 8 + config + 3 * (10 + 4)
    shards = [
        {
            "column_encodings": ["ndarray:uint16:5"],
            "column_names": ["tokens"],
            "column_sizes": [10],
            "compression": None,
            "format": "mds",
            "hashes": ["sha256"],
            "size_limit": limit,
            "version": 2,
            "samples": n,
            "zip_data": None,
            "raw_data": {
                "basename": f"shard.{k:05d}.mds",
                "bytes": len(data),
                "hashes": {"sha256": hashlib.sha256(data).hexdigest()},
            },
        }
        for k, (n, data) in enumerate(zip([3, 2], files))
    ]
    text = (tmp_path / "mds" / "index.json").read_text()
    # json.dump, sort_keys: exact text
    assert text == json.dumps({"version": 2, "shards": shards}, sort_keys=True)
    assert text.startswith('{"shards": [{"column_encodings": ["ndarray:uint16:5"]')
    # one byte less and a shard holds only two samples (streaming flushes when limit < size + next
    # sample)
    D.write_mds(src, tmp_path / "tight", 4, size_limit=limit - 1, progress=False)
    assert [
        s["samples"] for s in json.loads((tmp_path / "tight" / "index.json").read_text())["shards"]
    ] == [2, 2, 1]


def test_uint32_no_hashes_and_one_shard(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 100_000, 1000)
    src = fake_prepared(tmp_path / "src", tokens, dtype="uint32", shard_tokens=333)
    D.write_mds(src, tmp_path / "mds", 9, size_limit=None, hashes=None, progress=False)
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    (shard,) = index["shards"]
    assert shard["column_encodings"] == ["ndarray:uint32:10"] and shard["column_sizes"] == [40]
    assert (
        shard["hashes"] == [] and shard["raw_data"]["hashes"] == {} and shard["size_limit"] is None
    )
    config = config_text(10, 4, "uint32", None, hashes=())
    assert config == json.dumps(M.shard_config("uint32", 9, None, []), sort_keys=True)
    windows = [tokens[i * 9 : i * 9 + 10].astype(np.uint32) for i in range(111)]
    assert (tmp_path / "mds" / "shard.00000.mds").read_bytes() == expected_shard(windows, config)
    got = [s["tokens"] for s in D.read_mds(tmp_path / "mds", verify=True)]
    assert len(got) == 111 and all(
        g.dtype == np.uint32 and (g == w).all() for g, w in zip(got, windows)
    )


def jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


TEXTS = [f"doc {i}: " + "the quick brown fox " * (i % 5 + 1) for i in range(30)]


def test_prepare_with_mds_round_trips_the_loader_windows(tmp_path):
    out = tmp_path / "out"
    index = D.prepare(
        str(jsonl(tmp_path / "d.jsonl", TEXTS)),
        "byte",
        out,
        split="all",
        shard_tokens=300,
        progress=False,
        mds_seq_len=50,
    )
    stream = np.concatenate(
        [np.fromfile(out / s["file"], dtype=index["dtype"]) for s in index["shards"]]
    )
    samples = [s["tokens"] for s in D.read_mds(out / "mds", verify=True)]
    assert len(samples) == (len(stream) - 1) // 50 and len(index["shards"]) > 3
    loader = D.TokenLoader(out, seq_len=50, batch_size=1)
    for i, s in enumerate(samples):
        assert s.shape == (51,) and s.dtype == np.uint16 and not s.flags.writeable
        assert (s == stream[i * 50 : i * 50 + 51]).all()
        assert (s == loader._tokens(i * 50, i * 50 + 51)).all()  # the loader's window i
    meta = json.loads((out / "mds" / "ssmkit.json").read_text())
    assert (
        meta["tokenizer"] == "byte"
        and meta["eos_token_id"] == 256
        and meta["options"]["seq_len"] == 50
    )
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "mds").iterdir() if p.name != LOCK_FILE}
    D.prepare(
        str(tmp_path / "d.jsonl"),
        "byte",
        out,
        split="all",
        shard_tokens=300,
        progress=False,
        mds_seq_len=50,
    )
    assert {
        p.name: p.stat().st_mtime_ns for p in (out / "mds").iterdir() if p.name != LOCK_FILE
    } == mtimes
    with pytest.raises(ValueError, match="other options"):
        D.prepare(
            str(tmp_path / "d.jsonl"),
            "byte",
            out,
            split="all",
            shard_tokens=300,
            progress=False,
            mds_seq_len=64,
        )


def test_an_interrupted_conversion_is_redone_cleanly(tmp_path, monkeypatch):
    src = fake_prepared(tmp_path / "src", np.arange(2000) % 500, shard_tokens=600)
    kw = dict(seq_len=16, size_limit=300, progress=False)
    D.write_mds(src, tmp_path / "clean", **kw)
    calls, real = [0], M._ShardWriter.write_shard

    def crash_after_three(self, body):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        real(self, body)

    monkeypatch.setattr(M._ShardWriter, "write_shard", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        D.write_mds(src, tmp_path / "again", **kw)
    monkeypatch.setattr(M._ShardWriter, "write_shard", real)
    left = [p for p in (tmp_path / "again").iterdir() if p.name != LOCK_FILE]
    assert not (tmp_path / "again" / "index.json").exists() and len(left) == 3
    (tmp_path / "again" / "shard.09999.mds").write_bytes(b"stale")  # e.g. from a larger earlier try
    D.write_mds(src, tmp_path / "again", **kw)
    names = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == names
    for name in names:
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes()


def test_clear_errors(tmp_path):
    src = fake_prepared(tmp_path / "src", np.arange(100), shard_tokens=40)
    for bad in (0, -3, True, 2.5, "8"):
        with pytest.raises(ValueError, match="seq_len must be a positive integer"):
            D.write_mds(src, tmp_path / "m", bad, progress=False)
    with pytest.raises(ValueError, match="holds not one sample"):
        D.write_mds(src, tmp_path / "m", 8, size_limit=200, progress=False)
    for bad in (0, 1 << 32, "12 parsecs", -5, 1.5):
        with pytest.raises(ValueError, match="size_limit"):
            D.write_mds(src, tmp_path / "m", 8, size_limit=bad, progress=False)
    with pytest.raises(ValueError, match="unknown hash algorithm.*sha256"):
        D.write_mds(src, tmp_path / "m", 8, hashes=["sha257"], progress=False)
    with pytest.raises(
        ValueError, match="100 tokens: not one sample of seq_len \\+ 1 = 101 tokens"
    ):
        D.write_mds(src, tmp_path / "m", 100, progress=False)
    with pytest.raises(ValueError, match="has no index.json: prepare it first"):
        D.write_mds(tmp_path / "nothing", tmp_path / "m", 8, progress=False)
    with pytest.raises(ValueError, match="its own directory"):
        D.write_mds(src, src, 8, progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        D.write_mds(src, tmp_path / "busy", 8, progress=False)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    shard = src / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 1
    shard.write_bytes(bytes(data))  # same size, other bytes
    with pytest.raises(ValueError, match="shard_00001.bin is corrupt: its sha256"):
        D.write_mds(src, tmp_path / "m", 8, progress=False)
    D.write_mds(src, tmp_path / "m", 8, verify=False, progress=False)  # size checks alone pass
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match="shard_00001.bin is corrupt: 78 bytes"):
        D.write_mds(src, tmp_path / "m2", 8, progress=False)
    # before any tokenizing
    with pytest.raises(ValueError, match="mds_seq_len must be a positive integer"):
        D.prepare("no-such-corpus", "byte", tmp_path / "p", mds_seq_len=0, progress=False)


def test_read_mds_detects_corruption(tmp_path):
    src = fake_prepared(tmp_path / "src", np.arange(500), shard_tokens=200)
    D.write_mds(src, tmp_path / "m", 10, size_limit=400, progress=False)
    shard = tmp_path / "m" / "shard.00001.mds"
    good = shard.read_bytes()
    assert sum(1 for _ in D.read_mds(tmp_path / "m", verify=True)) == 49
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    assert sum(1 for _ in D.read_mds(tmp_path / "m")) == 49  # hashes only on request
    with pytest.raises(ValueError, match="shard.00001.mds is corrupt: its sha256 differs"):
        list(D.read_mds(tmp_path / "m", verify=True))
    shard.write_bytes(good[:-1])
    with pytest.raises(ValueError, match="corrupt: .* bytes, the index says"):
        list(D.read_mds(tmp_path / "m"))
    shard.write_bytes(struct.pack("<I", 99) + good[4:])
    with pytest.raises(ValueError, match="header says 99 samples"):
        list(D.read_mds(tmp_path / "m"))

    def offset_plus_one(k):  # the k-th offset, one byte on
        at = 4 + 4 * k
        return (
            good[:at]
            + struct.pack("<I", struct.unpack("<I", good[at : at + 4])[0] + 1)
            + good[at + 4 :]
        )

    shard.write_bytes(offset_plus_one(0))
    with pytest.raises(ValueError, match="offsets, config"):
        list(D.read_mds(tmp_path / "m"))
    shard.write_bytes(offset_plus_one(2))
    with pytest.raises(ValueError, match="a sample of 23 bytes, its columns need 22"):
        list(D.read_mds(tmp_path / "m"))
    shard.write_bytes(good)
    index = json.loads((tmp_path / "m" / "index.json").read_text())
    index["shards"][0]["compression"] = "zstd"
    (tmp_path / "m" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="compressed .zstd.; read it with mosaicml-streaming"):
        list(D.read_mds(tmp_path / "m"))
    with pytest.raises(ValueError, match="not an MDS dataset"):
        list(D.read_mds(tmp_path / "nowhere"))


def test_read_mds_decodes_streamings_other_encodings(tmp_path):
    """A shard built by hand from the format's definition: variable-size columns lead each sample
    with their uint32 sizes; a dynamic ndarray has a dtype byte, then (ndim << 2 | shape dtype) and
    the shape."""
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    columns = {
        "a": "ndarray",
        "b": "str",
        "c": "int",
        "d": "float32",
        "e": "json",
        "f": "ndarray:uint8",
    }
    values = {
        "a": bytes([33, (2 << 2) | 0, 2, 3]) + arr.tobytes(),
        "b": "héllo".encode(),
        "c": np.int64(-7).tobytes(),
        "d": np.float32(1.5).tobytes(),
        "e": b'{"k": [1, 2]}',
        "f": bytes([(1 << 2) | 1]) + np.uint16(4).tobytes() + bytes([9, 8, 7, 6]),
    }
    names = sorted(columns)
    sizes = [None if k in "abef" else len(values[k]) for k in names]
    sample = struct.pack("<4I", *(len(values[k]) for k in "abef")) + b"".join(
        values[k] for k in names
    )
    config = {
        "column_encodings": [columns[k] for k in names],
        "column_names": names,
        "column_sizes": sizes,
        "compression": None,
        "format": "mds",
        "hashes": [],
        "size_limit": None,
        "version": 2,
    }
    cfg = json.dumps(config, sort_keys=True).encode()
    start = 4 + 4 * 3 + len(cfg)
    data = (
        struct.pack("<4I", 2, start, start + len(sample), start + 2 * len(sample))
        + cfg
        + sample * 2
    )
    (tmp_path / "shard.00000.mds").write_bytes(data)
    raw = {"basename": "shard.00000.mds", "bytes": len(data), "hashes": {}}
    (tmp_path / "index.json").write_text(
        json.dumps(
            {"version": 2, "shards": [{**config, "samples": 2, "raw_data": raw, "zip_data": None}]}
        )
    )
    got = list(D.read_mds(tmp_path))
    assert len(got) == 2
    for s in got:
        assert (
            s["a"].dtype == np.int32
            and (s["a"] == arr).all()
            and s["b"] == "héllo"
            and s["c"] == -7
        )
        assert (
            s["d"] == np.float32(1.5)
            and s["e"] == {"k": [1, 2]}
            and s["f"].tolist() == [9, 8, 7, 6]
        )
    config["column_encodings"][0] = "jpeg"
    (tmp_path / "index.json").write_text(
        json.dumps(
            {"version": 2, "shards": [{**config, "samples": 2, "raw_data": raw, "zip_data": None}]}
        )
    )
    with pytest.raises(ValueError, match="'jpeg' needs mosaicml-streaming"):
        list(D.read_mds(tmp_path))


def test_data_prepare_command_writes_mds(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "ssmkit.cli",
        "data",
        "prepare",
        "--source",
        "stdlib-docs",
        "--tokenizer",
        "byte",
        "--out",
        str(tmp_path / "o"),
        "--max-tokens",
        "3000",
        "--shard-tokens",
        "1000",
        "--mds-seq-len",
        "99",
    ]
    env = {**os.environ, "SSMKIT_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "MDS:" in done.stdout, done.stderr
    assert sum(1 for _ in D.read_mds(tmp_path / "o" / "mds", verify=True)) == 30  # (3000 - 1) // 99
    bad = subprocess.run(
        cmd[:-1] + ["0"], capture_output=True, text=True, env=env
    )  # refused by argparse
    assert (
        bad.returncode == 2
        and "argument --mds-seq-len: '0' is not a positive integer" in bad.stderr
    )


# ---- against the real mosaicml-streaming ---------------------------------------------------------

STREAMING_SIDE = r"""
import json, sys
import numpy as np
from streaming import MDSWriter, StreamingDataset
from streaming.base.format.mds.reader import MDSReader
from streaming.base.util import clean_stale_shared_memory

mode, args = sys.argv[1], sys.argv[2:]
if mode == "read":      # our MDS -> StreamingDataset (local and via remote + hash check)
    local, cache, out = args
    clean_stale_shared_memory()
    rows = [s["tokens"] for s in StreamingDataset(local=local, shuffle=False, batch_size=1)]
    index = json.load(open(local + "/index.json"))
    readers = [(MDSReader.from_json(local, None, sh), sh["samples"]) for sh in index["shards"]]
    direct = [r.decode_sample(r.get_sample_data(i))["tokens"] for r, n in readers for i in range(n)]
    remote = [s["tokens"] for s in StreamingDataset(remote=local, local=cache, shuffle=False,
                                                    batch_size=1, validate_hash="sha256")]
    assert all((a == b).all() and (a == c).all() for a, b, c in zip(rows, direct, remote))
    assert len(rows) == len(direct) == len(remote)
    np.save(out, np.stack(rows))
elif mode == "write":   # the same samples through MDSWriter
    samples, out, encoding, size_limit, hashes = args
    size_limit = None if size_limit == "None" else int(size_limit)
    with MDSWriter(columns={"tokens": encoding}, out=out, size_limit=size_limit,
                   hashes=json.loads(hashes)) as w:
        for row in np.load(samples):
            w.write({"tokens": row})
elif mode == "mixed":   # other encodings, for our reader
    out, expected = args
    columns = {"arr": "ndarray", "i32": "ndarray:int32", "img": "ndarray:float32:2,3",
               "text": "str", "n": "int", "u8": "uint8", "f64": "float64", "meta": "json",
               "raw": "bytes", "si": "str_int"}
    rng, rows = np.random.default_rng(1), []
    with MDSWriter(columns=columns, out=out, size_limit=600, hashes=["md5", "sha1"]) as w:
        for i in range(40):
            s = {"arr": rng.integers(0, 300, (i % 3 + 1, 2)).astype("uint16"),
                 "i32": rng.integers(-5, 5, i % 4 + 1).astype("int32"),
                 "img": rng.standard_normal((2, 3)).astype("float32"), "text": "ü" * i, "n": i - 20,
                 "u8": i, "f64": i / 3, "meta": {"i": i, "l": [i] * (i % 3)},
                 "raw": bytes(range(i)), "si": i * 7}
            w.write(s)
            rows.append({k: (v.tolist() if isinstance(v, np.ndarray)
                             else (list(v) if isinstance(v, bytes) else v))
                         for k, v in s.items()})
    json.dump(rows, open(expected, "w"))
"""


def streaming_python():
    if importlib.util.find_spec("streaming") and importlib.util.find_spec(
        "streaming.base.format.mds"
    ):
        return sys.executable
    return os.environ.get("SSMKIT_STREAMING_PYTHON")


@pytest.mark.skipif(
    not streaming_python(),
    reason="mosaicml-streaming is not installed here (it pins "
    "huggingface-hub<1); set SSMKIT_STREAMING_PYTHON to a python that has it",
)
def test_against_real_mosaicml_streaming(tmp_path):
    script = tmp_path / "streaming_side.py"
    script.write_text(STREAMING_SIDE)

    def side(*args):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        done = subprocess.run(
            [streaming_python(), str(script), *map(str, args)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]

    for dtype, limit, hashes in (
        ("uint16", 3000, ["sha256"]),
        ("uint32", None, ["md5", "sha1", "sha256"]),
    ):
        tokens = np.random.default_rng(2).integers(0, 70_000 if dtype == "uint32" else 50_000, 5000)
        src = fake_prepared(tmp_path / f"src-{dtype}", tokens, dtype=dtype, shard_tokens=1234)
        ours = tmp_path / f"ours-{dtype}"
        D.write_mds(src, ours, 31, size_limit=limit, hashes=hashes, progress=False)
        side("read", ours, tmp_path / f"cache-{dtype}", tmp_path / f"read-{dtype}.npy")
        read = np.load(tmp_path / f"read-{dtype}.npy")
        ours_rows = np.stack([s["tokens"] for s in D.read_mds(ours)])
        assert (
            read.dtype == dtype
            and read.shape == ((5000 - 1) // 31, 32)
            and (read == ours_rows).all()
        )
        theirs = tmp_path / f"theirs-{dtype}"
        side(
            "write",
            tmp_path / f"read-{dtype}.npy",
            theirs,
            f"ndarray:{dtype}:32",
            limit,
            json.dumps(hashes),
        )
        names = sorted(p.name for p in theirs.iterdir())
        assert names == sorted(
            p.name for p in ours.iterdir() if p.name not in ("ssmkit.json", LOCK_FILE)
        )
        assert len(names) > 2 or limit is None
        for name in names:  # byte-identical shards and index.json
            assert (theirs / name).read_bytes() == (ours / name).read_bytes(), name
    side("mixed", tmp_path / "mixed", tmp_path / "mixed.json")
    expected = json.loads((tmp_path / "mixed.json").read_text())
    got = list(D.read_mds(tmp_path / "mixed", verify=True))
    assert len(json.loads((tmp_path / "mixed" / "index.json").read_text())["shards"]) > 1
    assert len(got) == len(expected) == 40
    for g, e in zip(got, expected):
        assert {
            k: v.tolist() if isinstance(v, np.ndarray) else (list(v) if isinstance(v, bytes) else v)
            for k, v in g.items()
        } == e
        assert (
            g["arr"].dtype == np.uint16 and g["img"].shape == (2, 3) and g["i32"].dtype == np.int32
        )
