"""Loading what :mod:`.resolve` found, top to bottom: resolve -> verify -> read config -> build ->
load weights, each step calling down, never back up.

    load_model(path, dtype, device)  what ``ssmkit generate`` / ``eval`` / ``convert`` load:
                                     (model, the :class:`.resolve.Resolved` record of ``path``)
    load_base(base)                  ``TrainConfig.base``: a whole model, fp32 on the CPU
    fingerprint(model)               what a LoRA run records of its base; checked here and on resume

A whole model (kind "model", "checkpoint", "hub"): a checkpoint's ``model/`` is checked against
its manifest, then :func:`ssmkit.from_pretrained` reads the config, builds the model and loads the
weights. A LoRA run (kind "lora"): its ``adapter/`` is checked against the manifest, the base its
trainer.json names (``config.base``) is loaded as a whole model, its :func:`fingerprint` compared
with the one the run recorded, and the adapter put on it and merged (W + (alpha/r) B A): the model
the run trained.
"""

from __future__ import annotations

import hashlib
import os

from torch import nn

from ..env import pick_device
from ..hub import from_pretrained, parse_dtype
from ..io import read_json
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


def _merged_lora_run(where: Resolved) -> nn.Module:
    """The base a LoRA run trained on with its adapter merged in (fp32, CPU), both checked first."""
    from ..finetune import load_adapter, merge

    step = where.step_dir
    verify(step, prefix="adapter/")
    state = read_json(step / "trainer.json", "checkpoint state")
    base = (state.get("config") or {}).get("base")
    if not base:
        raise ValueError(
            f"{step}/trainer.json names no base model (config.base): the adapter in "
            f"{where.adapter_dir} cannot be loaded without the model it was trained "
            "on"
        )
    model = load_base(base)
    recorded, now = state.get("base_fingerprint"), fingerprint(model)
    if recorded not in (None, now):
        raise ValueError(
            f"the base {base!r} has changed since the run in {step} trained its "
            f"adapter on it (fingerprint {recorded}, now {now}): the adapter would "
            "not compute what was trained"
        )
    return merge(load_adapter(model, where.adapter_dir))


def load_model(path: str | os.PathLike, dtype=None, device=None) -> tuple[nn.Module, Resolved]:
    """Whatever a user points ``ssmkit generate`` / ``eval`` / ``convert`` at, as a plain ssmkit
    model, and what :func:`.resolve.resolve` found there (``tokenizer_dir``, ``step_dir``, ...).

    A path that names nothing loadable is resolve's ValueError; a corrupt checkpoint is
    :class:`.manifest.CheckpointCorrupt`. A LoRA run loads as its base with the adapter merged in
    (in eval mode). dtype / device: as :func:`ssmkit.from_pretrained` takes them, checked before
    anything is read, applied after merging."""
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
