"""FLOPs per token, the accelerator's peak FLOP/s, and model FLOPs utilisation (MFU).

MFU (PaLM, Chowdhery et al. 2022, appendix B) is the fraction of the hardware's peak that the
model's own arithmetic uses, counting no rematerialisation:

    MFU = flops_per_token · tokens_per_s / (peak_flops · world_size)

Glossary (fields of the model config's mixer groups, ``cfg.mamba2.d_state`` ...): ``d_inner`` =
E·D (expanded width), ``d_state`` = N, ``headdim`` = P, ``chunk_size`` = Q, ``ngroups`` = G (heads
sharing one B and C), ``nheads`` = H.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models.moe import SparseMoE


def lti_flops(channels: int, d_state: int, seq_len: int) -> float:
    """Forward FLOPs per token of ``channels`` linear time-invariant SSMs of state size N =
    ``d_state`` (N/2 complex modes) run as FFT convolutions (:mod:`ssmkit.ops.lti`): per channel
    two real FFTs of length n = 2L (the input's and the product's inverse; 2.5·n·log₂ n each, half a
    complex radix-2 FFT) and the complex product (6 per frequency), per token; and the kernel's
    Vandermonde product, 8 per mode and position, counted once per sequence as if it were batch 1
    (an upper bound: larger batches share it)."""
    n = 2 * seq_len
    per_channel = 2 * 2.5 * n * math.log2(n) / seq_len + 6 * (seq_len + 1) / seq_len
    return channels * (per_channel + 8 * d_state / 2)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), an estimate for MFU.

    Matmuls: 6 per weight of every linear/conv (embedding lookups are free; a tied LM head counts);
    a mixture of experts counts its router and the k experts a token runs through, not all E
    (FLOPs follow the active parameters, ``model.num_parameters(active=True)``).
    Mamba-1 scan: 9 · d_inner · d_state per token forward (Gu & Dao 2023, section 3.3.2).
    Mamba-2 SSD with chunk Q, per token and head: 2Q·N (C·Bᵀ, per group) + 2Q·P (mask·X) + 4N·P
    (states). Mamba-3 with chunk Q and MIMO rank R (1 for SISO), per token and head: 2Q·R²·N (q·kᵀ:
    per head, since biases and rotations differ between heads) + 2Q·R²·P + 4R·N·P; its elementwise
    rotations are not counted. S4D and H3: their FFT convolutions (:func:`lti_flops`) over S4D's
    d_inner channels, and over H3's d_model · head_dim entries of k vᵀ (plus the products k vᵀ and
    qᵀ(...), 3 per entry; the shift SSM is a conv, counted with the matmuls). Attention: 12 ·
    (heads · head_dim) · keys per layer, keys = seq_len (a sliding window: at most its size); other
    models with num_attention_heads: 12 · n_layer · d_model · seq_len (PaLM, appendix B).

    model: an ssmkit LM (``model.config.mixers`` lists each layer's mixer) or a transformers model;
    seq_len: the training length L (the SSD chunk is min(Q, L); attention costs grow with L).
    """
    cfg = getattr(model, "config", None)
    matmul = 0
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            matmul += module.weight.numel()
        elif isinstance(module, SparseMoE):  # its experts' linears are counted above, all E
            matmul -= module.inactive_numel()
    flops = 6.0 * matmul
    mixers = getattr(cfg, "mixers", None)
    if mixers is not None:
        for mixer in mixers:
            if mixer in ("attn", "swa"):  # scores and values: 12 · (H·head_dim) · keys seen (PaLM)
                a = cfg.attn_cfg
                keys = seq_len if mixer == "attn" else min(seq_len, a["window_size"])
                flops += 12 * a["num_heads"] * a["head_dim"] * keys
            elif mixer == "mamba1":
                m = cfg.mamba1
                flops += 3 * 9 * m.d_inner(cfg.d_model) * m.d_state
            elif mixer == "s4d":
                m = cfg.s4d
                flops += 3 * lti_flops(m.d_inner(cfg.d_model), m.d_state, seq_len)
            elif mixer == "h3":
                m = cfg.h3
                entries = cfg.d_model * m.head_dim
                flops += 3 * (lti_flops(entries, m.d_state, seq_len) + 3 * entries)
            elif mixer == "mamba3":  # per head: (q kᵀ and its product with x, per head) + states
                m = cfg.mamba3
                q, r = min(m.chunk_size, seq_len), m.mimo_rank if m.is_mimo else 1
                flops += (
                    3
                    * m.nheads(cfg.d_model)
                    * (2 * q * r * r * (m.d_state + m.headdim) + 4 * r * m.d_state * m.headdim)
                )
            else:
                m = cfg.mamba2
                q, H = min(m.chunk_size, seq_len), m.nheads(cfg.d_model)
                flops += 3 * (
                    m.ngroups * 2 * q * m.d_state
                    + H * (2 * q * m.headdim + 4 * m.d_state * m.headdim)
                )
    elif cfg is not None and hasattr(cfg, "num_attention_heads"):
        flops += 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
    return flops


# dense bf16 tensor-core peaks (vendor datasheets), for MFU on GPUs
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "4090": 165e12,
    "V100": 125e12,
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's peak FLOP/s for ``precision`` ("bf16", "fp16", "fp32"), or None when unknown
    (CPUs: MFU is not reported). fp32 counts TF32, half the bf16 rate (the datasheets' dense
    figures)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value if precision != "fp32" else value / 2  # TF32 is half the bf16 rate
    return None


def mfu(
    flops_per_token: float, tokens_per_s: float, peak: float | None, world_size: int = 1
) -> float | None:
    """Model FLOPs utilisation: flops_per_token · tokens_per_s / (peak · world_size) (PaLM, appendix
    B).

    tokens_per_s: the whole run's rate (all ranks); peak: one device's FLOP/s (:func:`peak_flops`),
    None or 0 where unknown, and then the MFU is None too."""
    if not peak:
        return None
    return flops_per_token * tokens_per_s / (peak * world_size)
