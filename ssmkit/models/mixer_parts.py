"""What the mixers share: Δ's bias at initialisation, the causal conv carried across calls, when a
cached call runs as recurrent steps, left padding zeroed, the check that packed samples come without
a cache or a padding mask, and the parameters that stay fp32 when a model is cast.

Glossary: Δ = ``dt`` (the step size), softplus⁻¹ its inverse (``dt_bias`` stores softplus⁻¹(Δ₀)),
``state.conv`` the last d_conv inputs of the conv (the cache of generation), ``seq_idx`` (batch,
seqlen) the sample each position of a packed row belongs to (:mod:`ssmkit.ops.packing`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from einops import rearrange

from .. import ops
from . import lora_aware
from .ssm_config import Mamba1Config, Mamba2Config, Mamba3Config

# A cached call of at most this many tokens (a decode step, a speculative draft being verified) runs
# as that many recurrent steps in one call: the decode ops over k tokens (the conv update, the state
# update), O(k) and exact on every backend, the kernels' included (mamba_ssm's Mamba-1 scan kernel
# cannot start from a state); a longer one (a prompt continued from a cache) runs as the chunked
# scan from the cached states, whose fixed cost per call the steps' cost per token overtakes: on a
# CPU the two cost about the same at this many tokens (Mamba-3 a little earlier, Mamba-2 later).
# Both equal k one-token calls.
STEP_TOKENS = 4


def steps_fit(hidden: torch.Tensor, state, mask: torch.Tensor | None) -> bool:
    """A mixer's call on hidden (batch, k, d_model) runs as k recurrent steps: a cache to continue,
    no padding mask (a prefill's), and k <= :data:`STEP_TOKENS`."""
    return state is not None and mask is None and hidden.shape[1] <= STEP_TOKENS


class KeepsFp32:
    """Mixed into a mixer (before ``nn.Module``): its parameters named in ``FP32_PARAMS`` keep their
    fp32 values when the model is cast to bf16 or fp16 (they are only moved), as mamba_ssm creates
    its SSM parameters in fp32 whatever the model's dtype: Δ, A and the like lose too much in 16
    bits, and complex tensors have no bf16 type at all."""

    FP32_PARAMS: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {
            name: getattr(self, name).data
            for name in self.FP32_PARAMS
            if hasattr(self, name) and getattr(self, name).dtype == torch.float32
        }
        super()._apply(fn, recurse)
        for name, data in kept.items():
            param = getattr(self, name)
            if param.dtype != torch.float32 and param.is_floating_point():
                param.data = data.to(device=param.device)
        return self


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y, i.e. x = y + log(1 - exp(-y))."""
    return y + torch.log(-torch.expm1(-y))


def init_dt_bias(n: int, cfg: Mamba1Config | Mamba2Config | Mamba3Config) -> torch.Tensor:
    """softplus⁻¹ of Δ drawn log-uniformly in [dt_min, dt_max] (floored at dt_init_floor): (n,)."""
    dt = torch.exp(
        torch.rand(n) * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min)
    )
    return inverse_softplus(dt.clamp(min=cfg.dt_init_floor))


def zero_padding(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """x: (batch, seqlen, channels) with the positions where mask (batch, seqlen) is 0 set to zero.

    Left padding must leave no trace in a recurrent layer: a zero conv input is what an unpadded
    run sees left of its first token, and a zero SSM input keeps the zero start state at zero.
    (transformers' Mamba does the same: apply_mask_to_padding_states.)"""
    return x if mask is None else x * mask[:, :, None].to(x.dtype)


def check_packed(state, mask: torch.Tensor | None, seq_idx: torch.Tensor | None) -> None:
    """A mixer's ``seq_idx`` (batch, seqlen) marks packed samples (:mod:`ssmkit.ops.packing`) of a
    forward from scratch: never with a state (which continues one sequence) nor with a left-padding
    mask."""
    if seq_idx is not None and (state is not None or mask is not None):
        conflict = (
            "an inference state (cache)" if state is not None else "a padding mask (attention_mask)"
        )
        raise ValueError(
            f"seq_idx (packed samples) cannot be combined with {conflict}: pass one of them"
        )


def conv_with_state(
    x: torch.Tensor,
    conv: nn.Conv1d,
    state,
    activation: str | None = "silu",
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """activation(causal conv) over x: (batch, dim, seqlen), continuing from ``state.conv`` if a
    state is given, which is then replaced by the last d_conv inputs. seq_idx: (batch, seqlen)
    packed samples (no state then): each sees zeros left of its first token."""
    weight = rearrange(
        lora_aware.weight(conv, "conv1d"), "d 1 w -> d w"
    )  # LoRA-aware: see lora_aware
    conv_bias = lora_aware.bias(conv)
    if state is None:
        return ops.causal_conv1d(x, weight, conv_bias, activation=activation, seq_idx=seq_idx)
    width, seqlen = weight.shape[1], x.shape[2]
    x_ext = torch.cat([state.conv[:, :, 1:].to(x.dtype), x], dim=2)  # previous W-1 inputs first
    state.conv.copy_(x_ext[:, :, -width:])
    return ops.causal_conv1d(x_ext, weight, conv_bias, activation=activation)[:, :, -seqlen:]
