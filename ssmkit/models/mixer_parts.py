"""What the mixers share: Δ's bias at initialisation, the causal conv carried across calls, when a
cached call runs as recurrent steps, left padding zeroed, the check that packed samples come without
a padding mask (and with a cache only where the mixer keeps one state per sample), the packed
samples a prefill writes into a cache, and the parameters that stay fp32 when a model is cast.

Glossary: Δ = ``dt`` (the step size), softplus⁻¹ its inverse (``dt_bias`` stores softplus⁻¹(Δ₀)),
``state.conv`` the last d_conv inputs of the conv (the cache of generation), ``seq_idx`` (batch,
seqlen) the sample each position of a packed row belongs to (:mod:`ssmkit.ops.packing`).

A packed prefill (``seq_idx`` together with a fresh cache of one row per sample) writes sample i's
final states into row i of every layer's state, the samples numbered as
:func:`ssmkit.ops.packing.sample_numbers` numbers them, those of :data:`IGNORED_SAMPLE` left out.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from einops import rearrange

from .. import ops
from ..ops.packing import sample_spans
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


# The sample index MambaLM.forward gives the positions it ignores (seq_idx -1), once it has moved
# them to the end of their row: one more sample, larger than any real one (the row stays
# non-decreasing), whose outputs are dropped and whose states go into no cache row. Fits int32, the
# kernels' seq_idx dtype.
IGNORED_SAMPLE = 2**31 - 1


def check_packed(
    state, mask: torch.Tensor | None, seq_idx: torch.Tensor | None, per_sample: bool = False
) -> None:
    """A mixer's ``seq_idx`` (batch, seqlen) marks packed samples (:mod:`ssmkit.ops.packing`): never
    with a left-padding mask; with a state only where the mixer keeps one state per sample
    (``per_sample``: a packed prefill, :func:`packed_samples`), since a state otherwise continues
    one sequence per row."""
    if seq_idx is None or (state is None and mask is None):
        return
    if mask is not None:
        conflict = "a padding mask (attention_mask)"
    elif per_sample:
        return
    else:
        conflict = "an inference state (cache) in this mixer, which has no per-sample states"
    raise ValueError(
        f"seq_idx (packed samples) cannot be combined with {conflict}: pass one of them"
    )


def packed_samples(seq_idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The samples of a packed prefill that own a cache row: ``(number, row, start, end)``, four
    (n,) int64 tensors; ``number`` is each one's index among all samples of ``seq_idx`` (batch,
    seqlen) as :func:`ssmkit.ops.packing.sample_numbers` counts them (the ops' per-sample states),
    the rest as :func:`ssmkit.ops.packing.sample_spans`. Samples of :data:`IGNORED_SAMPLE` are left
    out, so cache row i holds the i-th real sample. Reads the values (a GPU sync)."""
    row, start, end = sample_spans(seq_idx)
    real = (seq_idx[row, start] != IGNORED_SAMPLE).nonzero().reshape(-1)
    return real, row[real], start[real], end[real]


def store_sample_states(cache_tensor: torch.Tensor, finals: torch.Tensor, number: torch.Tensor):
    """cache_tensor (n, ...) := finals[number]: each real sample's final state (the ops' per-sample
    states, one per sample of the packed rows) into its own cache row."""
    if cache_tensor.shape[0] != number.shape[0]:
        raise ValueError(
            f"the cache has {cache_tensor.shape[0]} rows for {number.shape[0]} packed samples: "
            "allocate_cache(n_samples), one row per sample"
        )
    cache_tensor.copy_(finals[number])


def conv_with_state(
    x: torch.Tensor,
    conv: nn.Conv1d,
    state,
    activation: str | None = "silu",
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """activation(causal conv) over x: (batch, dim, seqlen), continuing from ``state.conv`` if a
    state is given, which is then replaced by the last d_conv inputs. seq_idx: (batch, seqlen)
    packed samples: each sees zeros left of its first token; with a state as well (a packed
    prefill into a fresh cache of one row per sample), row i of ``state.conv`` (n, dim, d_conv)
    receives sample i's last d_conv - 1 inputs in its last slots (causal-conv1d's
    ``return_final_states``; the first slot is the one the next step drops)."""
    weight = rearrange(
        lora_aware.weight(conv, "conv1d"), "d 1 w -> d w"
    )  # LoRA-aware: see lora_aware
    conv_bias = lora_aware.bias(conv)
    if state is None:
        return ops.causal_conv1d(x, weight, conv_bias, activation=activation, seq_idx=seq_idx)
    width, seqlen = weight.shape[1], x.shape[2]
    if seq_idx is not None:
        y, finals = ops.causal_conv1d(
            x, weight, conv_bias, activation=activation, seq_idx=seq_idx, return_sample_states=True
        )
        state.conv.zero_()
        store_sample_states(state.conv[:, :, 1:], finals, packed_samples(seq_idx)[0])
        return y
    x_ext = torch.cat([state.conv[:, :, 1:].to(x.dtype), x], dim=2)  # previous W-1 inputs first
    state.conv.copy_(x_ext[:, :, -width:])
    return ops.causal_conv1d(x_ext, weight, conv_bias, activation=activation)[:, :, -seqlen:]
