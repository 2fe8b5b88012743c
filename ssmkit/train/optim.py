"""AdamW with the official parameter groups and the learning-rate schedules.

Weight decay (Mamba's recipe, as in GPT-2/3 training code): matrices of linear and conv layers
decay; norms, biases, embeddings and the SSM parameters A_log, D and dt_bias do not (the mixers
tag those with ``p._no_weight_decay = True``, as mamba_ssm does).

Schedules, for step s of S with W warmup steps, peak lr η and floor η_min:

    warmup    η · (s + 1) / W                                    s < W
    cosine    η_min + (η - η_min) · ½ (1 + cos(π · (s - W) / (S - W)))
    wsd       η until the last ``decay_frac`` of the steps, then linear to η_min
    constant  η
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig


def split_parameters(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the parameters with and without weight decay (tied weights listed once)."""
    decay, no_decay, seen = [], [], set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{module_name}.{name}" if module_name else name
            skip = (
                p.ndim < 2
                or getattr(p, "_no_weight_decay", False)
                or isinstance(module, nn.Embedding)
                or "norm" in type(module).__name__.lower()
            )
            (no_decay if skip else decay).append(full)
    return decay, no_decay


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, _ = split_parameters(model)
    decay = set(decay)
    params = dict(model.named_parameters())  # tied weights once, under their first name
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    groups = [
        {
            "params": [p for n, p in trainable.items() if n in decay],
            "weight_decay": cfg.weight_decay,
        },
        {"params": [p for n, p in trainable.items() if n not in decay], "weight_decay": 0.0},
    ]
    fused = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None)


def lr_at(step: int, cfg: TrainConfig, total_steps: int | None = None) -> float:
    """The learning rate of optimizer step ``step`` (0-based)."""
    total = total_steps or cfg.total_steps()
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_frac * total))
        start = max(cfg.warmup_steps, total - decay_steps)
        if step < start:
            return cfg.lr
        return cfg.lr + (cfg.min_lr - cfg.lr) * min(1.0, (step - start + 1) / (total - start))
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
