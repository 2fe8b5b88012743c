"""A checkpoint's manifest: the bytes and sha256 of every file in it, written last, checked before
any file is read.

    step_N/manifest.json   {"version": 1, "files": {"trainer.json": {"bytes": ..., "sha256": ...},
                           "model/model.safetensors": {...}, ...}}   (relative POSIX paths)

:func:`write_manifest` is the last write of a checkpoint (a checkpoint without one is incomplete);
:func:`verify` refuses a missing, truncated or altered file with :class:`CheckpointCorrupt`. The
manifest detects corruption, not forgery: someone who can rewrite the files can rewrite it too.
"""

from __future__ import annotations

from pathlib import Path

from ..io import plain_name, read_json, sha256_files, write_json

MANIFEST = "manifest.json"


class CheckpointCorrupt(ValueError):
    """A checkpoint that fails verification (missing, truncated or altered files) or cannot be
    read."""


def write_manifest(folder: Path) -> dict:
    """Write ``folder/manifest.json``: bytes and sha256 of every file under ``folder`` (relative
    POSIX paths); returns its "files"."""
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]
    files = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": digest}
        for p, digest in zip(paths, sha256_files(paths))
    }
    write_json(folder / MANIFEST, {"version": 1, "files": files})
    return files


def verify(folder: Path, prefix: str = ""):
    """Check every file listed in ``folder/manifest.json`` (present, size, sha256), or only those
    whose path starts with ``prefix`` (``"model/"``: the weights and tokenizer; a prefix that lists
    nothing is refused too); CheckpointCorrupt otherwise."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise CheckpointCorrupt(
            f"{folder} has no {MANIFEST}: it is not a complete ssmkit checkpoint"
        )
    try:
        files = read_json(folder / MANIFEST, "checkpoint manifest")["files"]
        entries = [
            (name, int(e["bytes"]), str(e["sha256"]))
            for name, e in files.items()
            if name.startswith(prefix)
        ]
        for name, _, _ in entries:
            for part in name.split("/"):
                plain_name(part, f"{folder / MANIFEST}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{folder / MANIFEST} is malformed: {exc}") from None
    if prefix and not entries:  # what the caller is about to trust would go unchecked
        raise CheckpointCorrupt(
            f"{folder / MANIFEST} lists no {prefix}: it was edited or is foreign"
        )
    for name, size, _ in entries:  # cheap checks first: a missing or truncated file
        path = folder / name
        if not path.is_file():
            raise CheckpointCorrupt(f"checkpoint {folder} is incomplete: {name} is missing")
        if path.stat().st_size != size:
            raise CheckpointCorrupt(
                f"checkpoint {folder} is corrupt: {name} has "
                f"{path.stat().st_size} bytes, the manifest says {size} "
                "(truncated?)"
            )
    digests = sha256_files([folder / name for name, _, _ in entries])
    for (name, _, digest), actual in zip(entries, digests):
        if actual != digest:
            raise CheckpointCorrupt(
                f"checkpoint {folder} is corrupt: the sha256 of {name} differs from its manifest"
            )
