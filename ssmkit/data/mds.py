"""MosaicML streaming (MDS) copies of prepared token shards, without the ``streaming`` package.

    ssmkit.data.write_mds("data/sp-gpt2", "data/sp-gpt2/mds", seq_len=2048)
    # or prepare(..., mds_seq_len=2048)
    for sample in ssmkit.data.read_mds("data/sp-gpt2/mds"):  # {"tokens": array (2049,)}
        ...
    # on a GPU cluster, with mosaicml-streaming installed:
    streaming.StreamingDataset(local="data/sp-gpt2/mds")[i]["tokens"]  # the same arrays

Samples. Sample ``i`` holds one column, ``tokens``: the numpy array of tokens
``[i * seq_len, i * seq_len + seq_len + 1)`` of the prepared stream (shape ``(seq_len + 1,)``, dtype
the shards' ``uint16`` or ``uint32``), exactly :class:`~ssmkit.data.TokenLoader`'s window ``i``:
``input_ids = s[:-1]``, ``labels = s[1:]``. Consecutive samples share one token; the tail shorter
than a window is left out. The column's encoding is ``ndarray:<dtype>:<seq_len + 1>`` (fixed dtype
and shape, so a sample is just its raw values).

Files (MDS format version 2, as streaming's ``MDSWriter`` writes it, uncompressed; little-endian):

* ``shard.NNNNN.mds``: ``uint32`` sample count ``n``; ``uint32`` offsets ``[n + 1]``, the absolute
  byte position of each sample and, last, the file size; the shard config as JSON (sorted keys:
  ``column_encodings, column_names, column_sizes, compression, format, hashes, size_limit,
  version``); then the samples. A sample starts with a ``uint32`` size per variable-size column
  (none here) and then the columns' bytes in column-name order.
* ``index.json``: ``{"shards": [...], "version": 2}`` (one line, as
  ``json.dump(obj, sort_keys=True)`` writes it); each shard entry is its config plus ``samples``,
  ``raw_data`` (``basename``, ``bytes``, ``hashes``: algorithm -> hex digest of the file) and
  ``zip_data: null``.
* A shard holds as many samples as fit in ``size_limit`` bytes, counting 8 bytes plus the config
  per shard and the sample plus 4 bytes per sample: the same split as ``MDSWriter``, so both write
  byte-identical files for the same samples and options.
* ``ssmkit.json`` (ignored by streaming): the options and the source (tokenizer, vocabulary,
  dtype, EOS id, fingerprint of the source shards), so a re-run with the same options does nothing.
* ``.ssmkit.lock`` (ignored by streaming): the :class:`~ssmkit.io.DirLock` a conversion holds.

Shards are written to temporary names and renamed; ``index.json`` is written last, so a directory
with an ``index.json`` is complete, and an interrupted conversion is redone from scratch on re-run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from decimal import Decimal
from pathlib import Path

import numpy as np

from .. import checks
from ..io import LOCK_FILE, DirLock, plain_name, read_json, write_atomically, write_json
from .shards import INDEX, open_shards, progress_bar

META = "ssmkit.json"
MDS_VERSION = 2
COLUMN = "tokens"
_SHARD = re.compile(r"shard\.\d{5}\.mds")
_UNITS = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}

# Value dtypes of streaming's ``ndarray`` encoding (with the byte that tags a dynamic dtype) and the
# shape dtypes of a dynamic shape (tagged by the low two bits of the shape byte).
_VALUE_DTYPES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
_SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")
_SCALARS = set(_VALUE_DTYPES.values())


def _hashers() -> dict:
    """Hash algorithms by the names streaming gives them: hashlib's, and xxhash's where
    installed."""
    algos = {
        a: getattr(hashlib, a)
        for a in hashlib.algorithms_available
        if hasattr(hashlib, a) and not a.startswith("shake_")
    }
    try:
        import xxhash

        algos.update({a: getattr(xxhash, a) for a in xxhash.algorithms_available})
    except ImportError:
        pass
    return algos


def _size_limit(value) -> int | None:
    """``size_limit`` as bytes: an int, or a string such as ``"64mb"`` (units of 1024, as
    streaming)."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        unit = next((u for u in _UNITS if text.endswith(u)), None)
        try:
            value = (
                int(float(text[: -len(unit)]) * _UNITS[unit])
                if unit
                else int(text.removesuffix("b"))
            )
        except (ValueError, OverflowError):
            raise ValueError(
                f"size_limit {value!r} is not a size: use bytes or a number with kb, mb, gb"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"size_limit {value!r} is not a size: use bytes or a number with kb, mb, gb"
        )
    if not 0 < value < 1 << 32:
        raise ValueError(
            f"size_limit {value} must be positive and below 2**32 (MDS offsets are uint32)"
        )
    return value


def _hash_names(hashes: Sequence[str] | str | None) -> list[str]:
    hashes = [hashes] if isinstance(hashes, str) else list(hashes or [])
    known = _hashers()
    unknown = [h for h in hashes if h not in known]
    if unknown:
        raise ValueError(
            f"unknown hash algorithm(s) {unknown}; available: {', '.join(sorted(known))}"
        )
    return sorted(set(hashes))  # streaming requires sorted, unique


def shard_config(dtype: str, seq_len: int, size_limit: int | None, hashes: list[str]) -> dict:
    """The config streaming's ``MDSWriter`` records for a one-column ``tokens`` dataset."""
    width = seq_len + 1
    return {
        "version": MDS_VERSION,
        "format": "mds",
        "compression": None,
        "hashes": hashes,
        "size_limit": size_limit,
        "column_names": [COLUMN],
        "column_encodings": [f"ndarray:{dtype}:{width}"],
        "column_sizes": [width * np.dtype(dtype).itemsize],
    }


class _ShardWriter:
    """Fixed-size samples into MDS shards, split exactly as streaming's ``MDSWriter`` splits
    them."""

    def __init__(self, out: Path, config: dict, sample_bytes: int):
        self.out, self.config, self.sample_bytes = out, config, sample_bytes
        self.config_data = json.dumps(config, sort_keys=True).encode()
        self.shards: list[dict] = []
        fixed, limit = 8 + len(self.config_data), config["size_limit"]
        if limit is None:  # one shard: its offsets must fit uint32
            self.per_shard = None
        elif limit < fixed + sample_bytes + 4:
            raise ValueError(
                f"size_limit {limit} bytes holds not one sample: a shard needs {fixed} bytes of "
                f"header and {sample_bytes + 4} per sample of {config['column_sizes'][0]} bytes"
            )
        else:
            self.per_shard = (limit - fixed) // (sample_bytes + 4)

    def write_shard(self, body: np.ndarray):
        """One shard holding the samples ``body`` (shape ``(n, sample width)``, C order)."""
        n = len(body)
        start = 4 + 4 * (n + 1) + len(self.config_data)
        if start + n * self.sample_bytes >= 1 << 32:
            raise ValueError(
                f"a shard of {n} samples exceeds 4 GiB, beyond uint32 offsets: set a size_limit"
            )
        offsets = start + self.sample_bytes * np.arange(n + 1, dtype=np.int64)
        parts = [
            np.uint32(n).astype("<u4").tobytes(),
            offsets.astype("<u4").tobytes(),
            self.config_data,
            np.ascontiguousarray(body).data,
        ]
        name = f"shard.{len(self.shards):05d}.mds"
        hashers = {algo: _hashers()[algo]() for algo in self.config["hashes"]}
        tmp = self.out / f".{name}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
                    for h in hashers.values():
                        h.update(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.out / name)
        except BaseException as exc:  # disk full, interrupted: no half shard stays
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                exc.filename = exc.filename or str(self.out / name)
            raise
        raw = {
            "basename": name,
            "bytes": start + n * self.sample_bytes,
            "hashes": {a: h.hexdigest() for a, h in hashers.items()},
        }
        self.shards.append({**self.config, "samples": n, "raw_data": raw, "zip_data": None})

    def write_index(self):
        obj = {"version": MDS_VERSION, "shards": self.shards}
        write_atomically(self.out / INDEX, json.dumps(obj, sort_keys=True).encode())


def _span(maps: list[np.ndarray], starts: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Tokens ``[lo, hi)`` of the flat stream, across shard files."""
    out, k = [], int(np.searchsorted(starts, lo, side="right")) - 1
    while lo < hi:
        take = min(hi, starts[k + 1]) - lo
        out.append(maps[k][lo - starts[k] : lo - starts[k] + take])
        lo, k = lo + take, k + 1
    return np.concatenate(out) if len(out) > 1 else np.asarray(out[0])


def _clear_partial(out: Path):
    """Remove what an interrupted conversion left (it had no index.json yet); refuse foreign
    files."""

    def ours(name):
        return (
            _SHARD.fullmatch(name)
            or name in (META, LOCK_FILE)
            or name.startswith((".shard.", f".{META}.", f".{INDEX}."))
        )

    foreign = [p.name for p in out.iterdir() if not ours(p.name)]
    if foreign:
        raise ValueError(
            f"{out} is not empty ({', '.join(sorted(foreign)[:5])}...) "
            "and holds no MDS dataset: use another directory"
        )
    for p in out.iterdir():
        if p.name != LOCK_FILE:
            p.unlink()


def write_mds(
    shard_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    seq_len: int,
    *,
    size_limit: int | str | None = 1 << 26,
    hashes: Sequence[str] | str | None = ("sha256",),
    verify: bool | str = True,
    progress: bool = True,
) -> dict:
    """Write the prepared shards of ``shard_dir`` as an MDS dataset of ``seq_len + 1``-token
    windows.

    ``size_limit``: bytes per MDS shard (an int or e.g. ``"64mb"``; ``None``: one shard), as
    streaming's ``MDSWriter`` (default ``1 << 26``). ``hashes``: algorithms whose digests of each
    shard file go into ``index.json`` (streaming's ``validate_hash``). ``verify``: check the source
    shards first, as :func:`~ssmkit.data.shards.check_shards` does (True: sha256 and token ids of
    every file; "auto": once, remembered; False: sizes only). Returns the contents of
    ``out_dir/ssmkit.json``; re-running with the same options does nothing. The conversion holds
    ``out_dir``'s :class:`~ssmkit.io.DirLock`.
    """
    src, out = Path(shard_dir), Path(out_dir)
    seq_len = checks.integer(seq_len, "seq_len", minimum=1)  # samples hold seq_len + 1 tokens
    limit, hash_names = _size_limit(size_limit), _hash_names(hashes)
    if out.resolve() == src.resolve():
        raise ValueError(
            f"write the MDS copy into its own directory, not {src} itself (e.g. {src / 'mds'})"
        )
    index, maps = open_shards(src, verify=False)  # cheap checks before anything is written
    dtype = np.dtype(index["dtype"]).name
    fingerprint = hashlib.sha256(
        json.dumps([s["sha256"] for s in index["shards"]]).encode()
    ).hexdigest()
    options = dict(
        seq_len=seq_len,
        size_limit=limit,
        hashes=hash_names,
        column=COLUMN,
        encoding=f"ndarray:{dtype}:{seq_len + 1}",
        source_fingerprint=fingerprint,
    )
    samples = max(0, (index["total_tokens"] - 1) // seq_len)
    if samples == 0:
        raise ValueError(
            f"{src} holds {index['total_tokens']} tokens: "
            f"not one sample of seq_len + 1 = {seq_len + 1} tokens"
        )
    sample_bytes = (seq_len + 1) * np.dtype(dtype).itemsize
    writer = _ShardWriter(out, shard_config(dtype, seq_len, limit, hash_names), sample_bytes)
    with DirLock(out, "MDS conversion"):
        return _write_mds(src, out, index, maps, options, writer, samples, verify, progress)


def _write_mds(
    src: Path,
    out: Path,
    index: dict,
    maps: list,
    options: dict,
    writer: _ShardWriter,
    samples: int,
    verify,
    progress: bool,
) -> dict:
    seq_len, dtype, total = options["seq_len"], np.dtype(index["dtype"]).name, index["total_tokens"]
    if (out / INDEX).exists():
        meta = read_json(out / META, "MDS metadata") if (out / META).exists() else {}
        if isinstance(meta, dict) and meta.get("options") == options:
            return meta  # finished before: nothing to do
        if not isinstance(meta, dict) or not meta:
            raise ValueError(
                f"{out} already holds a dataset not written by ssmkit: use another directory"
            )
        raise ValueError(
            f"{out} already holds an MDS copy made with other options {meta.get('options')}; "
            "use another directory or delete it"
        )
    if verify is not False:
        open_shards(src, verify)
    width = seq_len + 1
    _clear_partial(out)
    starts = np.cumsum([0] + [len(m) for m in maps])
    per_shard = writer.per_shard or samples
    with progress_bar(
        total=samples, unit="sample", unit_scale=True, disable=not progress, desc=f"mds {out}"
    ) as bar:
        for first in range(0, samples, per_shard):
            n = min(per_shard, samples - first)
            span = _span(maps, starts, first * seq_len, (first + n) * seq_len + 1)
            writer.write_shard(np.lib.stride_tricks.sliding_window_view(span, width)[::seq_len])
            bar.update(n)
    meta = dict(
        options=options,
        samples=samples,
        tokens_covered=samples * seq_len + 1,
        total_tokens=total,
        shards=len(writer.shards),
        dtype=dtype,
        tokenizer=index.get("tokenizer"),
        vocab_size=index.get("vocab_size"),
        eos_token_id=index.get("eos_token_id"),
        source=str(src.resolve()),
        sample="tokens[i*seq_len : i*seq_len + seq_len + 1] of the source stream; "
        "input_ids = s[:-1], labels = s[1:]",
    )
    write_json(out / META, meta)
    writer.write_index()  # last: its presence means complete
    return meta


def _decoder(encoding: str):
    """bytes -> value for one MDS column encoding (those that need nothing beyond numpy)."""
    name, _, arg = encoding.partition(":")
    if name == "ndarray":
        parts = arg.split(":") if arg else []
        dtype = parts[0] if parts else None
        shape = tuple(int(d) for d in parts[1].split(",")) if len(parts) > 1 else None
        if len(parts) > 2 or (dtype is not None and dtype not in _VALUE_DTYPES.values()):
            raise ValueError(f"unsupported MDS encoding {encoding!r}")

        def ndarray(data: bytes):
            i, kind = 0, dtype
            if kind is None:
                kind, i = _VALUE_DTYPES[data[0]], 1
            dims = shape
            if dims is None:
                ndim, shape_dtype = data[i] >> 2, np.dtype(_SHAPE_DTYPES[data[i] & 3])
                dims = tuple(int(d) for d in np.frombuffer(data, shape_dtype, ndim, i + 1))
                i += 1 + ndim * shape_dtype.itemsize
            return np.frombuffer(data, kind, offset=i).reshape(dims)

        return ndarray
    if arg:
        raise ValueError(f"unsupported MDS encoding {encoding!r}")
    if name == "int":
        return lambda data: int(np.frombuffer(data, np.int64)[0])
    if name in _SCALARS:
        return lambda data: np.frombuffer(data, name)[0]
    simple = {
        "bytes": bytes,
        "str": lambda d: d.decode(),
        "str_int": lambda d: int(d.decode()),
        "str_float": lambda d: float(d.decode()),
        "str_decimal": lambda d: Decimal(d.decode()),
        "json": lambda d: json.loads(d.decode()),
    }
    if name not in simple:
        raise ValueError(
            f"MDS encoding {encoding!r} needs mosaicml-streaming to decode "
            f"(ssmkit reads ndarray, bytes, str, int, numeric scalars, str_int, str_float, "
            f"str_decimal and json)"
        )
    return simple[name]


def read_mds(mds_dir: str | os.PathLike, *, verify: bool = False) -> Iterator[dict]:
    """Every sample of an (uncompressed) MDS dataset, in order, as a dict column -> value.

    Checks each shard's header against ``index.json`` (sample count, offsets, config, file size);
    ``verify`` also checks the file hashes recorded there. ``ndarray`` columns come back as
    read-only numpy arrays, as streaming returns them.
    """
    root = Path(mds_dir)
    if not (root / INDEX).exists():
        raise ValueError(
            f"{root} has no {INDEX}: not an MDS dataset (write one with ssmkit.data.write_mds)"
        )
    index = read_json(root / INDEX, "MDS index")
    if (
        not isinstance(index, dict)
        or index.get("version") != MDS_VERSION
        or not isinstance(index.get("shards"), list)
    ):
        version = index.get("version") if isinstance(index, dict) else None
        raise ValueError(
            f"{root / INDEX}: MDS index version {version!r} with a list of shards expected "
            f"(version {MDS_VERSION})"
        )
    algos = _hashers()
    for shard in index["shards"]:
        try:
            if shard.get("format") != "mds" or shard.get("version") != MDS_VERSION:
                raise ValueError(
                    f"{root / INDEX}: shard format {shard.get('format')!r} version "
                    f"{shard.get('version')!r}, expected 'mds' version {MDS_VERSION}"
                )
            raw = shard["raw_data"]
            name = plain_name(raw["basename"], f"{root / INDEX}")
            if shard.get("zip_data") or shard.get("compression"):
                raise ValueError(
                    f"{root}: shard {name} is compressed ({shard.get('compression')}); "
                    "read it with mosaicml-streaming"
                )
            names, encodings, sizes = (
                shard["column_names"],
                shard["column_encodings"],
                shard["column_sizes"],
            )
            if not len(names) == len(encodings) == len(sizes):
                raise TypeError("column_names, column_encodings and column_sizes differ in length")
            columns = list(zip(names, [_decoder(e) for e in encodings], sizes))
            expected, hashes, samples = (
                int(raw["bytes"]),
                dict(raw.get("hashes") or {}),
                int(shard["samples"]),
            )
            config = {
                k: shard[k]
                for k in (
                    "column_encodings",
                    "column_names",
                    "column_sizes",
                    "compression",
                    "format",
                    "hashes",
                    "size_limit",
                    "version",
                )
            }
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{root / INDEX}: a shard entry is malformed ({type(exc).__name__}: {exc}); "
                "not an index written by streaming or ssmkit"
            ) from None
        path = root / name
        data = path.read_bytes() if path.exists() else None
        if data is None or len(data) != expected:
            raise ValueError(
                f"MDS shard {path} is corrupt: "
                f"{'missing' if data is None else f'{len(data)} bytes'}, "
                f"the index says {expected}"
            )
        if verify:
            for algo, digest in hashes.items():
                if algo not in algos:
                    raise ValueError(
                        f"cannot verify {path}: hash algorithm {algo!r} is not available"
                    )
                if algos[algo](data).hexdigest() != digest:
                    raise ValueError(
                        f"MDS shard {path} is corrupt: its {algo} differs from the index"
                    )
        n = int(np.frombuffer(data, "<u4", 1)[0]) if len(data) >= 4 else -1
        if n != samples or len(data) < 4 * (n + 2):
            raise ValueError(
                f"MDS shard {path} is corrupt: header says {n} samples, the index {samples}"
            )
        offsets = np.frombuffer(data, "<u4", n + 1, 4).astype(np.int64)
        config_data = json.dumps(config, sort_keys=True).encode()
        head = 4 * (n + 2)
        if (
            data[head : head + len(config_data)] != config_data
            or offsets[0] != head + len(config_data)
            or offsets[-1] != len(data)
            or np.any(np.diff(offsets) < 0)
        ):
            raise ValueError(
                f"MDS shard {path} is corrupt: "
                "its header (offsets, config) disagrees with the index"
            )
        for lo, hi in zip(offsets[:-1], offsets[1:]):
            sample, i = data[lo:hi], 0
            sizes = []
            for _, _, size in columns:  # variable sizes lead the sample
                if size is None:
                    size, i = int(np.frombuffer(sample, "<u4", 1, i)[0]), i + 4
                sizes.append(size)
            if i + sum(sizes) != len(sample):
                raise ValueError(
                    f"MDS shard {path} is corrupt: a sample of {len(sample)} bytes, its columns "
                    f"need {i + sum(sizes)}"
                )
            record = {}
            for (column, decode, _), size in zip(columns, sizes):
                record[column] = decode(sample[i : i + size])
                i += size
            yield record
