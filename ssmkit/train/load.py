"""Loading what :mod:`.resolve` found, top to bottom: resolve -> verify -> read config -> build ->
load weights, each step calling down, never back up.

    load_model(path, dtype, device)  what ``ssmkit generate`` / ``eval`` / ``convert`` load:
                                     (model, the :class:`.resolve.Resolved` record of ``path``)
    load_base(base)                  ``TrainConfig.base``: a whole model, fp32 on the CPU
    fingerprint(model)               what a LoRA run records of its base; checked here and on resume

A whole model (kind "model", "checkpoint", "hub"): a checkpoint's ``model/`` is checked against
its manifest, then :func:`ssmkit.from_pretrained` reads the config, builds the model and loads the
weights. A LoRA run (kind "lora"): its ``adapter/`` and ``trainer.json`` are checked against the
manifest, the base trainer.json names (``base_path``, the absolute location recorded at training
time, else ``config.base`` as written) is loaded as a whole model, its :func:`fingerprint` compared
with the one the run recorded (none recorded: refused), and the adapter put on it and merged (W +
(alpha/r) B A): the model the run trained.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from torch import nn

from ..env import pick_device
from ..hub import from_pretrained, parse_dtype
from ..io import read_json
from ..ops.compiled import check_setting as check_compile_setting
from .manifest import verify
from .resolve import Resolved, resolve


def fingerprint(model: nn.Module) -> str:
    """A short hash of a model's tensors (names, shapes, dtypes and up to 4096 evenly spaced values
    of each): what a LoRA checkpoint records of its base, so resuming or loading it on another base
    is refused. It tells checkpoints apart; it is no cryptographic seal of every weight."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if ".lora_" in name or "modules_to_save" in name:  # a peft model: only its base counts
            continue
        name = name.replace(".base_layer", "")
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def _whole_model(where: Resolved, dtype=None, device=None) -> nn.Module:
    """A model directory or hub id (a LoRA run is refused: :meth:`.Resolved.model_source`), its
    files verified first when they belong to a Trainer checkpoint."""
    source = where.model_source()
    if where.step_dir is not None:
        verify(where.step_dir, prefix="model/")  # the weights and tokenizer, as listed there
    return from_pretrained(source, dtype=dtype, device=device)


def load_base(base: str | os.PathLike) -> nn.Module:
    """The pretrained model ``base`` names (fp32, on the CPU): a model directory, a checkpoint, a
    run's out_dir (:func:`.resolve.resolve`) or a hub id; a LoRA run is not a base."""
    return _whole_model(resolve(base))


def base_location(base: str | os.PathLike) -> str | None:
    """Where a local ``base`` is, as an absolute path (None for a hub id): what a LoRA run records
    at training time, so it loads from any directory later."""
    path = Path(base).expanduser()
    return str(path.resolve()) if path.exists() else None


def _recorded_base(step: Path, state: dict) -> str:
    """The base a LoRA run's trainer.json names: the absolute ``base_path`` recorded at training
    time (runs since issue #26), else ``config.base`` as written (relative to the directory the run
    was trained from, which may not be this one)."""
    base = (state.get("config") or {}).get("base")
    if not base:
        raise ValueError(
            f"{step}/trainer.json names no base model (config.base): the adapter in "
            f"{step / 'adapter'} cannot be loaded without the model it was trained on"
        )
    where = state.get("base_path")
    if where:
        if not Path(where).exists():
            raise ValueError(
                f"the base recorded in {step}/trainer.json, {where} (given as {base!r}), does "
                "not exist: put the model the adapter was trained on back there"
            )
        return where
    return base


def _merged_lora_run(where: Resolved) -> nn.Module:
    """The base a LoRA run trained on with its adapter merged in (fp32, CPU), both checked first:
    adapter/ and trainer.json (which names the base and its fingerprint) against the manifest, the
    base's fingerprint against the recorded one."""
    from ..finetune import load_adapter, merge

    step = where.step_dir
    verify(step, prefix="adapter/")
    verify(step, prefix="trainer.json")
    state = read_json(step / "trainer.json", "checkpoint state")
    base = _recorded_base(step, state)
    recorded = state.get("base_fingerprint")
    if not recorded:
        raise ValueError(
            f"{step}/trainer.json records no base_fingerprint, so the base {base!r} cannot be "
            "checked to be the model the adapter was trained on (every LoRA checkpoint ssmkit "
            "writes records it)"
        )
    try:
        model = load_base(base)
    except (ValueError, OSError) as exc:  # a run from before base_path: relative to its cwd
        if state.get("base_path") or Path(base).expanduser().is_absolute():
            raise
        raise ValueError(
            f"the base recorded in {step}/trainer.json, {base!r}, is read relative to the "
            f"directory the run was trained in, and from {Path.cwd()} it fails: {exc}"
        ) from None
    now = fingerprint(model)
    if recorded != now:
        raise ValueError(
            f"the base {base!r} (named in {step}/trainer.json) has changed since the run in "
            f"{step} trained its adapter on it (fingerprint {recorded}, now {now}): the adapter "
            "would not compute what was trained"
        )
    return merge(load_adapter(model, where.adapter_dir))


def load_model(path: str | os.PathLike, dtype=None, device=None) -> tuple[nn.Module, Resolved]:
    """Whatever a user points ``ssmkit generate`` / ``eval`` / ``convert`` at, as a plain ssmkit
    model, and what :func:`.resolve.resolve` found there (``tokenizer_dir``, ``step_dir``, ...).

    A path that names nothing loadable is resolve's ValueError; a corrupt checkpoint is
    :class:`.manifest.CheckpointCorrupt`. A LoRA run loads as its base with the adapter merged in
    (in eval mode). dtype / device: as :func:`ssmkit.from_pretrained` takes them, checked before
    anything is read, applied after merging."""
    check_compile_setting()  # SSMKIT_COMPILE_SCAN: now, not at the first forward pass
    dtype = parse_dtype(dtype)
    device = pick_device(str(device)) if device is not None else None
    where = resolve(path)
    if where.kind != "lora":
        return _whole_model(where, dtype, device), where
    model = _merged_lora_run(where)
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    return model.eval(), where
