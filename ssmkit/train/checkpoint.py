"""Training checkpoints: atomic, verified before loading, resumable at another world size.

    out_dir/checkpoints/
        latest                  the name of the newest committed checkpoint, e.g. "step_00000200"
        step_00000200/
            model/              save_pretrained: loads with ssmkit.from_pretrained, exports
                                to HF; with the tokenizer's files (trainer.json "tokenizer"),
                                so `ssmkit generate` and
                                ssmkit.data.get_tokenizer(".../model") need nothing else
            adapter/            instead of model/ for a LoRA run (``adapter_only``): the
                                adapter in peft's format (ssmkit.finetune.load_adapter
                                onto the base), with the tokenizer
            state/              torch.distributed.checkpoint of {"model", "optim"} (sharded
                                under FSDP; DCP reshards on load, so 2 processes can resume
                                with 1); for a LoRA run only the trainable tensors (the
                                adapter) and their optimizer state
            trainer.json        step, tokens seen, data loader position, scaler,
                                skipped steps, config
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

Trust. A checkpoint is verified against its manifest (:mod:`.manifest`) before anything is read (a
truncated or bit-flipped file is refused), RNG states are JSON, and the DCP state is read through
:mod:`.safe_load` (DCP's metadata unpickled only as its own record types, non-tensor entries with
``torch.load(weights_only=True)``): nothing in a checkpoint directory can run code on load. What a
path names (a run, a checkpoint, its ``latest`` file) is :mod:`.resolve`'s business.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

from torch import nn

from ..hub.save import save_tokenizer
from ..io import plain_name, read_json, write_atomically, write_json
from .distributed import Dist
from .manifest import MANIFEST, CheckpointCorrupt, verify, write_manifest
from .rng import rng_state, set_rng_state

# torch.distributed.checkpoint (DCP) is imported inside the functions that save or load: importing
# it pulls in torch._dynamo, about a second per process, which the commands that never touch a
# training checkpoint (plan, generate, eval, convert) should not pay.

LATEST = "latest"
STEP = re.compile(r"step_\d{8}")


def _commit_point(where: str):
    """Called between the steps of the commit sequence; tests replace it to simulate a crash
    there."""


def _quiet(fn, *args, **kwargs):
    # "torch.distributed ... uninitialized ... single process": intended
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        return fn(*args, **kwargs)


@contextlib.contextmanager
def _no_hf_bars():
    """transformers' progress bars off for the duration, then as they were: ``save_pretrained`` of
    a transformers model (the Llama baseline) draws a "Writing model shards" bar inside the training
    cell."""
    if "transformers" not in sys.modules:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    was_on, hub_was_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
        if hub_was_off:
            disable_progress_bars()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the disk full, most often); the message is one line that
    says which step, where, and which step ``latest`` still names."""


def _is_checkpoint_exception(exc: BaseException) -> bool:
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(exc, CheckpointException)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, the errors torch's CheckpointException wraps (per rank), and their causes."""
    seen, todo = [], [exc]
    while todo and len(seen) < 32:  # breadth first: the wrapped errors before their contexts
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo.extend(f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple))
        todo.extend([e.__cause__, e.__context__])
    return seen


def _disk_full(exc: BaseException, root: Path) -> bool:
    """Whether ``exc`` came from a full disk: an ENOSPC / EDQUOT among its causes, or (torch's zip
    writer reports a short write as "unexpected pos ...") under 1 MiB left where it wrote."""
    if any(
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _causes(exc)
    ):
        return True
    try:
        return shutil.disk_usage(root).free < (1 << 20)
    except OSError:
        return False


def _write_failure(exc: BaseException, root: Path, step: int, full: bool) -> str:
    """One line: what failed writing checkpoint ``step`` under ``root``, and what is still there."""
    pointer = root / LATEST
    try:
        kept = f"{LATEST} still points at {pointer.read_text().strip()}"
    except OSError:
        kept = "no earlier checkpoint was committed"
    if full:
        what = "the disk is full (free space, or choose another out_dir, then --resume)"
    else:
        cause = next((e for e in _causes(exc) if not _is_checkpoint_exception(e)), exc)
        first = (str(cause).strip().splitlines() or [""])[0]
        what = f"{type(cause).__name__}: {first}"
    return f"could not write checkpoint step {step} to {root}: {what}; {kept}"


def is_complete(folder: Path) -> bool:
    """A committed checkpoint directory: named step_N, holding trainer.json and manifest.json."""
    folder = Path(folder)
    return (
        STEP.fullmatch(folder.name) is not None
        and (folder / MANIFEST).is_file()
        and (folder / "trainer.json").is_file()
    )


# --- save, recover, latest, load -----------------------------------------------------------


def _model_state(model: nn.Module, optimizer, adapter_only: bool):
    """DCP's (model, optimizer) state dicts; ``adapter_only``: the trainable tensors only (the
    frozen base, a head tied to a frozen embedding included, is the base checkpoint's, not the
    run's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(
        model, optimizer, options=StateDictOptions(ignore_frozen_params=adapter_only)
    )
    if adapter_only:
        trainable = {
            n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
        }
        msd = {k: v for k, v in msd.items() if k in trainable}
    return msd, osd


def save(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer,
    trainer_state: dict,
    d: Dist,
    keep_last: int = 3,
    adapter_only: bool = False,
) -> Path:
    """Write checkpoint ``step`` under ``root`` (every rank calls this); see the commit sequence
    above. ``adapter_only`` (a LoRA run): only the trainable tensors, and ``adapter/`` instead of
    ``model/``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    root = Path(root)
    name = f"step_{step:08d}"
    final, tmp, old = root / name, root / f".tmp-{name}", root / f".old-{name}"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    d.barrier()
    try:
        msd, osd = _model_state(model, optimizer, adapter_only)
        _quiet(dcp.save, {"model": msd, "optim": osd}, checkpoint_id=str(tmp / "state"))
        write_json(tmp / "rng" / f"rank_{d.rank:05d}.json", rng_state(), indent=None)
        sharded = d.world_size > 1 and not adapter_only  # gather the full tensors (a collective)
        full = (
            get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if sharded
            else None
        )
        if d.is_main:
            if adapter_only:
                from ..finetune import save_adapter

                save_adapter(model, tmp / "adapter")
                save_tokenizer(trainer_state.get("tokenizer"), tmp / "adapter", model)
            elif hasattr(model, "save_pretrained"):
                with _no_hf_bars():  # no "Writing model shards" bar
                    model.save_pretrained(
                        tmp / "model", **({"state_dict": full} if sharded else {})
                    )
                save_tokenizer(trainer_state.get("tokenizer"), tmp / "model", model)
            write_json(tmp / "trainer.json", trainer_state)
        d.barrier()
        if d.is_main:
            write_manifest(tmp)
    except BaseException as exc:  # disk full, read-only, Ctrl-C...: no partial checkpoint left
        # torch's writer raises CheckpointException, a BaseException: `except Exception` missed it
        torch_writer = _is_checkpoint_exception(exc)
        full = (torch_writer or isinstance(exc, (OSError, RuntimeError))) and _disk_full(exc, root)
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if torch_writer or full:
            raise CheckpointWriteError(_write_failure(exc, root, step, full)) from exc
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
        for stale in sorted(
            p for p in root.glob("step_*") if p.is_dir() and STEP.fullmatch(p.name)
        )[:-keep_last]:
            shutil.rmtree(stale)
    d.barrier()
    return final


def recover(root: Path) -> list[str]:
    """Finish or undo a commit sequence a crash interrupted (rank 0, before a run writes);
    returns what it did.

    ``.tmp-step_N`` (never committed) is removed; ``.old-step_N`` is renamed back when ``step_N`` is
    missing (the crash came between steps 2 and 3), else removed; temporary files of ``latest`` are
    removed. Only names ssmkit writes are touched."""
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
    """The checkpoint to resume from: the one ``latest`` names, or, when that is missing or points
    at nothing complete, the newest complete ``step_*`` (with a warning); None when there is
    none."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.exists():
        # never a path outside root
        name = plain_name(pointer.read_text().strip(), str(pointer), STEP.pattern)
        if is_complete(root / name):
            return root / name
        warnings.warn(
            f"{pointer} names {name}, which is not a complete checkpoint; "
            "using the newest complete one",
            stacklevel=2,
        )
    candidates = sorted(p for p in root.glob("step_*") if p.is_dir() and is_complete(p))
    if candidates and not pointer.exists():
        warnings.warn(
            f"{root} has no {LATEST} pointer; resuming from the newest complete checkpoint "
            f"{candidates[-1].name}",
            stacklevel=2,
        )
    return candidates[-1] if candidates else None


def saved_shapes(path: Path) -> dict[str, tuple]:
    """Name -> shape of every model tensor in the checkpoint's DCP state (read safely)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .safe_load import SafeReader

    metadata = SafeReader(str(Path(path) / "state")).read_metadata()
    return {
        k.removeprefix("model."): tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }


def check_model(
    path: Path,
    model: nn.Module,
    saved_config: dict | None = None,
    config: dict | None = None,
    adapter_only: bool = False,
):
    """Refuse a checkpoint whose model tensors differ from ``model``'s (names or shapes;
    ``adapter_only``: the trainable ones), naming the first differences and the config keys that
    changed."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    mine = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    if adapter_only:
        trainable = {
            n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
        }
        mine = {k: v for k, v in mine.items() if k in trainable}
    theirs = saved_shapes(path)
    diff = [
        f"{k}: {theirs.get(k, 'absent')} there, {mine.get(k, 'absent')} here"
        for k in sorted(set(mine) | set(theirs))
        if mine.get(k) != theirs.get(k)
    ]
    if diff:
        keys = ("model", "model_overrides", "base", "lora")
        changed = [
            f"{k}={(saved_config or {}).get(k)!r} -> {(config or {}).get(k)!r}"
            for k in keys
            if (saved_config or {}).get(k) != (config or {}).get(k)
        ]
        raise ValueError(
            f"cannot resume {path}: its model differs from this run's ({'; '.join(diff[:3])}"
            f"{' ...' if len(diff) > 3 else ''})"
            f"{' after ' + ', '.join(changed) if changed else ''}. "
            "Resume with the model config the checkpoint was made with, or start a new out_dir"
        )


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


def load(
    path: Path,
    model: nn.Module,
    optimizer,
    d: Dist,
    verified: bool = False,
    adapter_only: bool = False,
) -> dict:
    """Verify ``path`` (unless ``verified``), then restore model (``adapter_only``: its trainable
    tensors, the rest stays as built), optimizer and this rank's RNG; return trainer.json's
    contents."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from .safe_load import SafePlanner, SafeReader

    path = Path(path)
    if not verified:
        verify_everywhere(path, d)
    state_json = read_json(path / "trainer.json", "checkpoint state")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    msd, osd = _model_state(model, optimizer, adapter_only)
    state = {"model": msd, "optim": osd}
    _quiet(dcp.load, state, storage_reader=SafeReader(str(path / "state")), planner=SafePlanner())
    options = StateDictOptions(ignore_frozen_params=True, strict=False) if adapter_only else None
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    # torch 2.13 drops a group's lr/betas/eps/weight_decay when an FSDP save loads unsharded
    for group, h in zip(optimizer.param_groups, hyper):
        group.update({k: v for k, v in h.items() if k not in group})
    rng = path / "rng" / f"rank_{d.rank:05d}.json"
    if rng.exists():  # a rank new to this run (world size grew) keeps its seeded RNG
        try:
            set_rng_state(read_json(rng, "RNG state"))
        except ValueError as exc:  # a malformed state: nothing was set
            raise CheckpointCorrupt(f"{rng}: {exc}") from None
    return state_json
