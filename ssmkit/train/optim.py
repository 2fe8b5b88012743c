"""AdamW with the official parameter groups, the learning-rate schedules, and FLOPs per token.

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
            skip = (p.ndim < 2 or getattr(p, "_no_weight_decay", False) or isinstance(module, nn.Embedding)
                    or "norm" in type(module).__name__.lower())
            (no_decay if skip else decay).append(full)
    return decay, no_decay


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, _ = split_parameters(model)
    decay = set(decay)
    params = dict(model.named_parameters())                          # tied weights once, under their first name
    groups = [
        {"params": [p for n, p in params.items() if n in decay and p.requires_grad], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in params.items() if n not in decay and p.requires_grad], "weight_decay": 0.0},
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


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), an estimate for MFU.

    Matmuls: 6 per weight of every linear/conv (embedding lookups are free; a tied LM head counts).
    Mamba-1 scan: 9 · d_inner · d_state per token forward (Gu & Dao 2023, section 3.3.2).
    Mamba-2 SSD with chunk Q, per token and head: 2Q·N (C·Bᵀ, per group) + 2Q·P (mask·X) + 4N·P (states).
    Attention (other models with num_attention_heads): 12 · n_layer · d_model · seq_len (PaLM, appendix B).
    """
    cfg = getattr(model, "config", None)
    matmul = 0
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            matmul += module.weight.numel()
    flops = 6.0 * matmul
    mixers = getattr(cfg, "mixers", None)
    if mixers is not None:
        for mixer in mixers:
            if mixer == "mamba1":
                flops += 3 * 9 * cfg.d_inner * cfg.d_state
            else:
                q = min(cfg.chunk_size, seq_len)
                flops += 3 * (cfg.ngroups * 2 * q * cfg.d_state
                              + cfg.nheads * (2 * q * cfg.headdim + 4 * cfg.d_state * cfg.headdim))
    elif cfg is not None and hasattr(cfg, "num_attention_heads"):
        flops += 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
    return flops


# dense bf16 tensor-core peaks (vendor datasheets), for MFU on GPUs
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L40S": 362e12, "L4": 121e12,
                   "4090": 165e12, "V100": 125e12}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's peak FLOP/s for ``precision``, or None when unknown (CPUs: MFU is not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value if precision != "fp32" else value / 2     # TF32 is half the bf16 rate
    return None
