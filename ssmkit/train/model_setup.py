"""The model a run trains: a preset built from scratch, or a pretrained checkpoint (``config.base``)
fine-tuned whole or through a LoRA adapter (``config.lora``), in the run's precision.

    from scratch      build_model(config.model_config(vocab)), seeded with config.seed
    full fine-tuning  from_pretrained(base): every weight trains (``freeze_embedding``: not the
                      embedding, nor an lm_head tied to it, which is the same matrix)
    LoRA              from_pretrained(base), then ssmkit.finetune.apply_lora(**config.lora)
                      with the adapter's random init seeded with config.seed: only the
                      adapter trains, and a checkpoint holds only the adapter and its
                      optimizer state (see checkpoint.save)
    bf16-pure         the model cast to bf16 after the above (weights, gradients
                      and AdamW states in bf16, no fp32 master copy; Mamba-3's
                      fp32 parameters stay fp32, as in mamba_ssm)

``base`` is anything :func:`ssmkit.from_pretrained` reads (a transformers or mamba_ssm directory, a
hub id where online) or a training run's out_dir / checkpoint (its ``model/``):
:func:`.load.load_base` loads it as :mod:`.resolve` reads the path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models import build_model
from .config import TrainConfig
from .load import fingerprint, load_base


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
        embedding = inner.get_input_embeddings()  # a transformers model
    if embedding is None:
        raise ValueError(
            f"freeze_embedding: {type(inner).__name__} has no backbone.embedding nor "
            "get_input_embeddings()"
        )
    weight = embedding.base_layer.weight if hasattr(embedding, "base_layer") else embedding.weight
    weight.requires_grad_(False)


def long_context(model: nn.Module, cfg: TrainConfig) -> int:
    """Switch on activation checkpointing and the chunked loss, which only ssmkit models have.
    Returns the loss chunk size in effect: ``cfg.loss_chunk_size``, or 0 for another model (a
    transformers baseline trained with an ssmkit run config computes its loss whole, and a line
    says so); activation checkpointing on another model is refused."""
    backbone = getattr(model, "backbone", None)
    if not hasattr(backbone, "gradient_checkpointing") or not hasattr(model, "loss_chunk_size"):
        if cfg.activation_checkpointing:
            raise ValueError(
                f"activation_checkpointing needs an ssmkit model; {type(model).__name__} has "
                "none (set it to false)"
            )
        print(
            f"loss_chunk_size {cfg.loss_chunk_size}: {type(model).__name__} computes its loss "
            "over all positions at once (the chunked loss is ssmkit's models')",
            flush=True,
        )
        return 0
    backbone.gradient_checkpointing = cfg.activation_checkpointing
    model.loss_chunk_size = cfg.loss_chunk_size
    return cfg.loss_chunk_size


def lora_kwargs(lora: dict) -> dict:
    """``config.lora`` as :func:`ssmkit.finetune.apply_lora`'s arguments (missing keys: its
    defaults)."""
    return {k: v for k, v in lora.items() if v is not None or k == "target_modules"}


def build_run_model(
    cfg: TrainConfig, vocab: int, model: nn.Module | None = None
) -> tuple[nn.Module, str | None]:
    """(the model to train, the base's :func:`fingerprint` for a LoRA run else None). ``model``: a
    model given to the Trainer instead of ``config.model`` / ``config.base`` (LoRA still applies to
    it)."""
    if model is not None and cfg.base is not None:
        raise ValueError(
            f"a model was given and config.base={cfg.base!r} names another: give one of them"
        )
    if model is None:
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = (
            load_base(cfg.base) if cfg.base is not None else build_model(cfg.model_config(vocab))
        )
    base_print = None
    if cfg.lora is not None and not is_lora(model):
        from ..finetune import apply_lora

        base_print = fingerprint(model)
        torch.manual_seed(cfg.seed)  # the adapter's init, the same on every rank
        model = apply_lora(model, **lora_kwargs(cfg.lora))
    elif is_lora(model):
        base_print = fingerprint(base_module(model))
    if cfg.freeze_embedding:
        _freeze_embedding(model)
    if cfg.precision == "bf16-pure":
        model = model.to(torch.bfloat16)
    return model, base_print
