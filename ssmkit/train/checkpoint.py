"""Training checkpoints: atomic, complete, resumable at another world size.

    out_dir/checkpoints/
        latest                  the name of the newest complete checkpoint (written last, atomically)
        step_00000200/
            model/              save_pretrained: loads with ssmkit.from_pretrained, exports to HF
            state/              torch.distributed.checkpoint of {"model", "optim"} (sharded under FSDP;
                                DCP reshards on load, so 2 processes can resume with 1)
            trainer.json        step, tokens seen, data loader position, scaler, skipped steps, config
            rng/rank_00000.pt   every RNG state of each rank (python, numpy, torch, cuda)

A checkpoint is written into ``.tmp-step_...`` and renamed when every rank has finished, so a crash
leaves the previous checkpoints intact; only the last ``keep_last`` are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from ..data.shards import write_atomically
from .distributed import Dist

LATEST = "latest"


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():     # "torch.distributed ... uninitialized ... single process": intended
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        return fn(*args, **kwargs)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: Path, step: int, model: nn.Module, optimizer, trainer_state: dict, d: Dist, keep_last: int = 3) -> Path:
    """Write checkpoint ``step`` under ``root`` (every rank calls this)."""
    root = Path(root)
    name = f"step_{step:08d}"
    final, tmp = root / name, root / f".tmp-{name}"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    d.barrier()
    msd, osd = get_state_dict(model, optimizer)
    _quiet(dcp.save, {"model": msd, "optim": osd}, checkpoint_id=str(tmp / "state"))
    torch.save(rng_state(), tmp / "rng" / f"rank_{d.rank:05d}.pt")
    sharded = d.world_size > 1            # gather the full tensors (a collective: every rank takes part)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) if sharded else None
    if d.is_main:
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(tmp / "model", **({"state_dict": full} if sharded else {}))
        (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
    d.barrier()
    if d.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomically(root / LATEST, name + "\n")
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old)
    d.barrier()
    return final


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "trainer.json").exists():
        raise ValueError(f"{pointer} points to {path}, which is not a complete checkpoint; "
                         f"point it at one of {sorted(p.name for p in root.glob('step_*'))} or remove it")
    return path


def load(path: Path, model: nn.Module, optimizer, d: Dist) -> dict:
    """Restore model, optimizer and this rank's RNG from ``path``; return trainer.json's contents."""
    path = Path(path)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    _quiet(dcp.load, state, checkpoint_id=str(path / "state"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for group, h in zip(optimizer.param_groups, hyper):    # torch 2.13 drops a group's lr/betas/eps/weight_decay
        group.update({k: v for k, v in h.items() if k not in group})   # when an FSDP save loads unsharded
    rng = path / "rng" / f"rank_{d.rank:05d}.pt"
    if rng.exists():                       # a rank new to this run (world size grew) keeps its seeded RNG
        set_rng_state(torch.load(rng, weights_only=False))
    return json.loads((path / "trainer.json").read_text())
