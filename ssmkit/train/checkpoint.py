"""Training checkpoints: atomic, verified before loading, resumable at another world size.

    out_dir/checkpoints/
        latest                  the name of the newest committed checkpoint, e.g. "step_00000200"
        step_00000200/
            model/              save_pretrained: loads with ssmkit.from_pretrained, exports to HF; with
                                the tokenizer's files (trainer.json "tokenizer"), so `ssmkit generate`
                                and ssmkit.data.get_tokenizer(".../model") need nothing else
            state/              torch.distributed.checkpoint of {"model", "optim"} (sharded under FSDP;
                                DCP reshards on load, so 2 processes can resume with 1)
            trainer.json        step, tokens seen, data loader position, scaler, skipped steps, config
            rng/rank_00000.json every RNG state of each rank (python, numpy, torch, cuda), as JSON
            manifest.json       bytes and sha256 of every file above; written last

Commit sequence of :func:`save` (a crash at any point leaves the newest committed checkpoint
loadable; the tests inject a crash at each point):

    1. write everything into ``.tmp-step_N/``, ``manifest.json`` last
    2. if ``step_N`` exists (the same step saved again): rename it to ``.old-step_N``
    3. rename ``.tmp-step_N`` to ``step_N``
    4. point ``latest`` at it (written atomically)
    5. delete ``.old-step_N``, then the checkpoints beyond ``keep_last``

:func:`recover` (run before a run touches the directory) finishes or undoes an interrupted
sequence, and :func:`latest` falls back to the newest complete ``step_*`` when ``latest`` is
missing or points at nothing.

Trust. A checkpoint is verified against its manifest before anything is read (a truncated or
bit-flipped file is refused), RNG states are JSON, the DCP metadata is read by an unpickler that
accepts only torch.distributed.checkpoint's own record types, and DCP's non-tensor entries with
``torch.load(weights_only=True)``: nothing in a checkpoint directory can run code on load. The
manifest detects corruption, not forgery: someone who can rewrite the files can rewrite it too.
"""

from __future__ import annotations

import base64
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ..io import plain_name, read_json, sha256_file, write_atomically, write_json
from .distributed import Dist

LATEST, MANIFEST = "latest", "manifest.json"
STEP = re.compile(r"step_\d{8}")


class CheckpointCorrupt(ValueError):
    """A checkpoint that fails verification (missing, truncated or altered files) or cannot be read."""


def _commit_point(where: str):
    """Called between the steps of the commit sequence; tests replace it to simulate a crash there."""


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():     # "torch.distributed ... uninitialized ... single process": intended
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        return fn(*args, **kwargs)


# --- RNG states as JSON ---------------------------------------------------------------------------

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_state() -> dict:
    """Every RNG state of this process as plain JSON values."""
    version, keys, gauss = random.getstate()
    name, mt, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(keys), gauss], "numpy": [name, mt.tolist(), pos, has_gauss, cached],
             "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict):
    """Restore :func:`rng_state`'s output; a malformed state raises CheckpointCorrupt before anything
    is set."""
    try:
        version, keys, gauss = state["python"]
        name, mt, pos, has_gauss, cached = state["numpy"]
        python = (int(version), tuple(int(k) for k in keys), None if gauss is None else float(gauss))
        numpy = (str(name), np.asarray(mt, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
        cpu = _bytes_tensor(state["torch"])
        cuda = [_bytes_tensor(s) for s in state.get("cuda", [])]
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointCorrupt(f"malformed RNG state ({type(exc).__name__}: {exc})") from None
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


# --- reading DCP without running code -------------------------------------------------------------

_DCP_TYPES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "BytesStorageMetadata",
                                              "StorageMeta", "ChunkStorageMetadata", "TensorStorageMetadata",
                                              "TensorProperties", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: its own record types, torch dtypes and sizes, nothing else."""

    def find_class(self, module, name):
        if name in _DCP_TYPES.get(module, ()) or (module == "torch" and (
                name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)))):
            return super().find_class(module, name)
        raise CheckpointCorrupt(f"the checkpoint's DCP metadata refers to {module}.{name}, which is not "
                                "one of torch.distributed.checkpoint's record types: refusing to load it")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(dcp.DefaultLoadPlanner):
    """DCP's planner, but a non-tensor entry (an optimizer hyper-parameter) must first load with
    ``torch.load(weights_only=True)``: plain values only, never an arbitrary pickle."""

    def load_bytes(self, read_item, value):
        try:
            torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointCorrupt(f"the checkpoint entry {read_item.dest_index.fqn} is not a plain value "
                                    f"({type(exc).__name__}): refusing to unpickle it") from None
        value.seek(0)
        super().load_bytes(read_item, value)


# --- manifest -------------------------------------------------------------------------------------

def _sha256_all(paths: list[Path]) -> list[str]:
    """sha256 of each file, several at a time: hashlib releases the GIL, so threads use every core (a
    22 GB checkpoint of the 1.4B preset hashes at ~1.6 GB/s per core)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_file, paths))


def write_manifest(folder: Path) -> dict:
    """``folder/manifest.json``: bytes and sha256 of every file under ``folder`` (relative POSIX paths)."""
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": digest}
             for p, digest in zip(paths, _sha256_all(paths))}
    write_json(folder / MANIFEST, {"version": 1, "files": files})
    return files


def verify(folder: Path, prefix: str = ""):
    """Check every file listed in ``folder/manifest.json`` (present, size, sha256), or only those whose
    path starts with ``prefix`` (``"model/"``: the weights and tokenizer); CheckpointCorrupt otherwise."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise CheckpointCorrupt(f"{folder} has no {MANIFEST}: it is not a complete ssmkit checkpoint")
    try:
        files = read_json(folder / MANIFEST, "checkpoint manifest")["files"]
        entries = [(name, int(e["bytes"]), str(e["sha256"])) for name, e in files.items()
                   if name.startswith(prefix)]
        for name, _, _ in entries:
            for part in name.split("/"):
                plain_name(part, f"{folder / MANIFEST}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{folder / MANIFEST} is malformed: {exc}") from None
    for name, size, _ in entries:                   # cheap checks first: a missing or truncated file
        path = folder / name
        if not path.is_file():
            raise CheckpointCorrupt(f"checkpoint {folder} is incomplete: {name} is missing")
        if path.stat().st_size != size:
            raise CheckpointCorrupt(f"checkpoint {folder} is corrupt: {name} has {path.stat().st_size} "
                                    f"bytes, the manifest says {size} (truncated?)")
    digests = _sha256_all([folder / name for name, _, _ in entries])
    for (name, _, digest), actual in zip(entries, digests):
        if actual != digest:
            raise CheckpointCorrupt(f"checkpoint {folder} is corrupt: the sha256 of {name} differs from "
                                    "its manifest")


def is_complete(folder: Path) -> bool:
    """A committed checkpoint directory: named step_N, holding trainer.json and manifest.json."""
    folder = Path(folder)
    return STEP.fullmatch(folder.name) is not None and (folder / MANIFEST).is_file() and \
        (folder / "trainer.json").is_file()


# --- the tokenizer beside the weights --------------------------------------------------------------

def save_tokenizer(name: str | None, folder: Path, model: nn.Module) -> bool:
    """Write the files of tokenizer ``name`` (the training data's ``index.json`` "tokenizer") into
    ``folder`` (a checkpoint's ``model/``), so the checkpoint loads with its tokenizer. False, with a
    warning, when there is no name, it cannot be loaded, or it does not fit the model's vocabulary (a
    checkpoint is never lost for want of its tokenizer); errors writing the files (disk full) propagate."""
    from ..data.tokenizers import loaded_tokenizer

    if not name:
        return False
    try:
        tok = loaded_tokenizer(name)
    except (ValueError, RuntimeError, OSError) as exc:
        warnings.warn(f"the checkpoint is saved without its tokenizer {name!r}, which cannot be loaded "
                      f"({exc}); pass --tokenizer to `ssmkit generate`", stacklevel=3)
        return False
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        warnings.warn(f"the checkpoint is saved without the tokenizer {name!r}: its {len(tok)} tokens do not "
                      f"fit the model's vocabulary of {vocab}", stacklevel=3)
        return False
    tok.save_pretrained(str(folder))
    return True


# --- save, recover, find, load --------------------------------------------------------------------

def save(root: Path, step: int, model: nn.Module, optimizer, trainer_state: dict, d: Dist,
         keep_last: int = 3) -> Path:
    """Write checkpoint ``step`` under ``root`` (every rank calls this); see the commit sequence above."""
    root = Path(root)
    name = f"step_{step:08d}"
    final, tmp, old = root / name, root / f".tmp-{name}", root / f".old-{name}"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    d.barrier()
    try:
        msd, osd = get_state_dict(model, optimizer)
        _quiet(dcp.save, {"model": msd, "optim": osd}, checkpoint_id=str(tmp / "state"))
        write_json(tmp / "rng" / f"rank_{d.rank:05d}.json", rng_state(), indent=None)
        sharded = d.world_size > 1          # gather the full tensors (a collective: every rank takes part)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
            if sharded else None
        if d.is_main:
            if hasattr(model, "save_pretrained"):
                model.save_pretrained(tmp / "model", **({"state_dict": full} if sharded else {}))
                save_tokenizer(trainer_state.get("tokenizer"), tmp / "model", model)
            write_json(tmp / "trainer.json", trainer_state)
        d.barrier()
        if d.is_main:
            write_manifest(tmp)
    except Exception:                       # disk full, read-only...: leave no partial checkpoint behind
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _commit_point("written")
    if d.is_main:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            _commit_point("old moved aside")
        os.replace(tmp, final)
        _commit_point("renamed")
        write_atomically(root / LATEST, name + "\n")
        _commit_point("latest written")
        shutil.rmtree(old, ignore_errors=True)
        for stale in sorted(p for p in root.glob("step_*")
                            if p.is_dir() and STEP.fullmatch(p.name))[:-keep_last]:
            shutil.rmtree(stale)
    d.barrier()
    return final


def recover(root: Path) -> list[str]:
    """Finish or undo a commit sequence a crash interrupted (rank 0, before a run writes);
    returns what it did.

    ``.tmp-step_N`` (never committed) is removed; ``.old-step_N`` is renamed back when ``step_N`` is missing
    (the crash came between steps 2 and 3), else removed; temporary files of ``latest`` are removed.
    Only names ssmkit writes are touched."""
    root = Path(root)
    done: list[str] = []
    if not root.is_dir():
        return done
    for p in sorted(root.iterdir()):
        if p.name.startswith(".tmp-step_") and p.is_dir():
            shutil.rmtree(p)
            done.append(f"removed the unfinished {p.name}")
        elif p.name.startswith(f".{LATEST}.tmp-") and p.is_file():
            p.unlink()
        elif p.name.startswith(".old-step_") and p.is_dir():
            final = root / p.name.removeprefix(".old-")
            if is_complete(final):
                shutil.rmtree(p)
                done.append(f"removed {p.name} (replaced by {final.name})")
            else:
                if final.exists():
                    shutil.rmtree(final)
                os.replace(p, final)
                done.append(f"restored {final.name} from {p.name}")
    return done


def latest(root: Path) -> Path | None:
    """The checkpoint to resume from: the one ``latest`` names, or, when that is missing or points at
    nothing complete, the newest complete ``step_*`` (with a warning); None when there is none."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.exists():
        # never a path outside root
        name = plain_name(pointer.read_text().strip(), str(pointer), STEP.pattern)
        if is_complete(root / name):
            return root / name
        warnings.warn(f"{pointer} names {name}, which is not a complete checkpoint; "
                      "using the newest complete one", stacklevel=2)
    candidates = sorted(p for p in root.glob("step_*") if p.is_dir() and is_complete(p))
    if candidates and not pointer.exists():
        warnings.warn(f"{root} has no {LATEST} pointer; resuming from the newest complete checkpoint "
                      f"{candidates[-1].name}", stacklevel=2)
    return candidates[-1] if candidates else None


def saved_shapes(path: Path) -> dict[str, tuple]:
    """Name -> shape of every model tensor in the checkpoint's DCP state (read safely)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _SafeReader(str(Path(path) / "state")).read_metadata()
    return {k.removeprefix("model."): tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def check_model(path: Path, model: nn.Module, saved_config: dict | None = None, config: dict | None = None):
    """Refuse a checkpoint whose model tensors differ from ``model``'s (names or shapes), naming the first
    differences and the config keys that changed."""
    mine = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    theirs = saved_shapes(path)
    diff = [f"{k}: {theirs.get(k, 'absent')} there, {mine.get(k, 'absent')} here"
            for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if diff:
        keys = ("model", "model_overrides")
        changed = [f"{k}={(saved_config or {}).get(k)!r} -> {(config or {}).get(k)!r}" for k in keys
                   if (saved_config or {}).get(k) != (config or {}).get(k)]
        raise ValueError(f"cannot resume {path}: its model differs from this run's ({'; '.join(diff[:3])}"
                         f"{' ...' if len(diff) > 3 else ''})"
                         f"{' after ' + ', '.join(changed) if changed else ''}. "
                         "Resume with the model config the checkpoint was made with, or start a new out_dir")


def verify_everywhere(path: Path, d: Dist):
    """:func:`verify` on rank 0; every rank raises if it fails (a collective)."""
    error = None
    if d.is_main:
        try:
            verify(path)
        except CheckpointCorrupt as exc:
            error = exc
    if d.any(error is not None):
        raise error or CheckpointCorrupt(f"rank 0 refused the checkpoint {path}")


def load(path: Path, model: nn.Module, optimizer, d: Dist, verified: bool = False) -> dict:
    """Verify ``path`` (unless ``verified``), then restore model, optimizer and this rank's RNG; return
    trainer.json's contents."""
    path = Path(path)
    if not verified:
        verify_everywhere(path, d)
    state_json = read_json(path / "trainer.json", "checkpoint state")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    _quiet(dcp.load, state, storage_reader=_SafeReader(str(path / "state")), planner=_SafePlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # torch 2.13 drops a group's lr/betas/eps/weight_decay when an FSDP save loads unsharded
    for group, h in zip(optimizer.param_groups, hyper):
        group.update({k: v for k, v in h.items() if k not in group})
    rng = path / "rng" / f"rank_{d.rank:05d}.json"
    if rng.exists():                       # a rank new to this run (world size grew) keeps its seeded RNG
        set_rng_state(read_json(rng, "RNG state"))
    return state_json


def find_model(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """The model directory behind ``path`` and the training checkpoint holding it (None for a plain model
    directory). ``path`` may be a model directory (``config.json``), a checkpoint ``step_N/`` (its
    ``model/``), a ``checkpoints/`` directory or its ``latest`` file (the checkpoint it names, as
    :func:`latest` reads it: plain names only), or a run's ``out_dir`` (its ``checkpoints/``). A path that
    is none of these is a ValueError saying what is accepted."""
    given = Path(path)
    accepted = ("expected a model directory (config.json), a checkpoint step_N/ (with model/), a "
                "checkpoints/ directory or its latest file, or a run's out_dir (with checkpoints/)")
    if given.is_file():
        if given.name != LATEST:
            raise ValueError(f"{given} is a file: {accepted}")
        step = latest(given.parent)
    elif not given.is_dir():
        raise ValueError(f"{given} does not exist: {accepted}")
    elif (given / "config.json").is_file():
        parent = given.parent if given.name == "model" and is_complete(given.parent) else None
        return given, parent
    elif (given / "trainer.json").is_file():
        step = given
    else:
        root = given / "checkpoints" if (given / "checkpoints").is_dir() else given
        step = latest(root)
        if step is None:
            raise ValueError(f"{given} holds no model and no complete checkpoint: {accepted}")
    if step is None:
        raise ValueError(f"{given} names no complete checkpoint in {given.parent}: {accepted}")
    if not (step / "model" / "config.json").is_file():
        raise ValueError(f"checkpoint {step} has no model/ (its model has no save_pretrained); "
                         "load it with Trainer(..., resume=True) instead")
    return step / "model", step
