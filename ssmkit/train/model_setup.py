"""The model a run trains: a preset built from scratch, or a pretrained checkpoint (``config.base``)
fine-tuned whole or through a LoRA adapter (``config.lora``), in the run's precision.

    from scratch      build_model(config.model_config(vocab)), seeded with config.seed
    full fine-tuning  from_pretrained(base): every weight trains (``freeze_embedding``: not the embedding,
                      nor an lm_head tied to it, which is the same matrix)
    LoRA              from_pretrained(base), then ssmkit.finetune.apply_lora(**config.lora) with the
                      adapter's random init seeded with config.seed: only the adapter trains, and a
                      checkpoint holds only the adapter and its optimizer state (see checkpoint.save)
    bf16-pure         the model cast to bf16 after the above (weights, gradients and AdamW states in bf16,
                      no fp32 master copy; Mamba-3's fp32 parameters stay fp32, as in mamba_ssm)

``base`` is anything :func:`ssmkit.from_pretrained` reads (a transformers or mamba_ssm directory, a hub
id where online) or a training run's out_dir / checkpoint (its ``model/``, see
:func:`ssmkit.train.checkpoint.find_model`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from ..hub import from_pretrained
from ..models import build_model
from .checkpoint import find_model
from .config import TrainConfig


def load_base(base: str) -> nn.Module:
    """The pretrained model ``base`` names (fp32, on the CPU): a local path (a model directory, a
    checkpoint, a run's out_dir) or a hub id."""
    if Path(base).exists():
        model_dir, _ = find_model(base)
        return from_pretrained(model_dir)
    return from_pretrained(base)


def fingerprint(model: nn.Module) -> str:
    """A short hash of a model's tensors (names, shapes, dtypes and up to 4096 evenly spaced values of
    each): what a LoRA checkpoint records of its base, so resuming on another base is refused. It tells
    checkpoints apart; it is no cryptographic seal of every weight."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if ".lora_" in name or "modules_to_save" in name:          # a peft model: only its base counts
            continue
        name = name.replace(".base_layer", "")
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def is_lora(model: nn.Module) -> bool:
    """True for a peft model (it has ``peft_config``)."""
    return hasattr(model, "peft_config")


def base_module(model: nn.Module) -> nn.Module:
    """The ssmkit (or transformers) model inside a peft model, or the model itself."""
    return model.get_base_model() if is_lora(model) else model


def _freeze_embedding(model: nn.Module):
    inner = base_module(model)
    backbone = getattr(inner, "backbone", None)
    embedding = getattr(backbone, "embedding", None)
    if embedding is None and hasattr(inner, "get_input_embeddings"):
        embedding = inner.get_input_embeddings()                # a transformers model
    if embedding is None:
        raise ValueError(f"freeze_embedding: {type(inner).__name__} has no backbone.embedding nor "
                         "get_input_embeddings()")
    weight = embedding.base_layer.weight if hasattr(embedding, "base_layer") else embedding.weight
    weight.requires_grad_(False)


def lora_kwargs(lora: dict) -> dict:
    """``config.lora`` as :func:`ssmkit.finetune.apply_lora`'s arguments (missing keys: its defaults)."""
    return {k: v for k, v in lora.items() if v is not None or k == "target_modules"}


def build_run_model(cfg: TrainConfig, vocab: int,
                    model: nn.Module | None = None) -> tuple[nn.Module, str | None]:
    """(the model to train, the base's :func:`fingerprint` for a LoRA run else None). ``model``: a model
    given to the Trainer instead of ``config.model`` / ``config.base`` (LoRA still applies to it)."""
    if model is not None and cfg.base is not None:
        raise ValueError(f"a model was given and config.base={cfg.base!r} names another: give one of them")
    if model is None:
        torch.manual_seed(cfg.seed)                              # the same initial weights on every rank
        model = load_base(cfg.base) if cfg.base is not None else build_model(cfg.model_config(vocab))
    base_print = None
    if cfg.lora is not None and not is_lora(model):
        from ..finetune import apply_lora

        base_print = fingerprint(model)
        torch.manual_seed(cfg.seed)                              # the adapter's init, the same on every rank
        model = apply_lora(model, **lora_kwargs(cfg.lora))
    elif is_lora(model):
        base_print = fingerprint(base_module(model))
    if cfg.freeze_embedding:
        _freeze_embedding(model)
    if cfg.precision == "bf16-pure":
        model = model.to(torch.bfloat16)
    return model, base_print


def load_model(path: str, dtype=None, device=None) -> tuple[nn.Module, Path, Path | None]:
    """Whatever a user points ``ssmkit generate`` / ``eval`` / ``convert`` at, as a plain ssmkit model:
    ``(model, the directory holding its tokenizer files, the checkpoint step_N/ or None)``.

    A model directory, a checkpoint or a run's out_dir load as :func:`find_model` finds them (checked
    against their manifest; a path that is none of them is its ValueError); ``owner/name`` that is no
    local path loads from the hub. A LoRA run's checkpoint (``adapter/``) loads its
    base (``config.base`` of its trainer.json), checks the base is the one the run trained on (the
    recorded fingerprint), puts the adapter on it and merges it (W + (alpha/r) B A): the model the run
    trained. dtype / device: as :func:`ssmkit.from_pretrained` takes them, applied after merging."""
    from ..io import read_json
    from .checkpoint import find_adapter, verify

    path = str(path)
    hub_id = not Path(path).exists() and path.count("/") == 1 and not path.startswith(".")
    step = None if hub_id else find_adapter(path)
    if step is None:
        if hub_id:
            return from_pretrained(path, dtype=dtype, device=device), Path(path), None
        model_dir, step = find_model(path)
        if step is not None:
            verify(step, prefix="model/")                 # the weights and tokenizer, as the manifest says
        return from_pretrained(model_dir, dtype=dtype, device=device), model_dir, step
    from ..finetune import load_adapter, merge

    verify(step, prefix="adapter/")
    state = read_json(step / "trainer.json", "checkpoint state")
    base = (state.get("config") or {}).get("base")
    if not base:
        raise ValueError(f"{step}/trainer.json names no base model (config.base): the adapter in "
                         f"{step / 'adapter'} cannot be loaded without the model it was trained on")
    model = load_base(base)
    if state.get("base_fingerprint") not in (None, fingerprint(model)):
        raise ValueError(f"the base {base!r} has changed since the run in {step} trained its adapter on it "
                         f"(fingerprint {state.get('base_fingerprint')}, now {fingerprint(model)}): the "
                         "adapter would not compute what was trained")
    model = merge(load_adapter(model, step / "adapter"))
    model = from_pretrained_like(model, dtype, device)
    return model, step / "adapter", step


def from_pretrained_like(model: nn.Module, dtype=None, device=None) -> nn.Module:
    """``model`` cast and moved as :func:`ssmkit.from_pretrained` would load it (names checked there)."""
    from ..env import pick_device
    from ..hub.load import _dtype

    dtype = _dtype(dtype)
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(pick_device(str(device)))
    return model.eval()
