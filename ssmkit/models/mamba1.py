"""The Mamba-1 mixer (Gu & Dao 2023, figure 3 and section 3.4).

Parameter names, shapes and initialisation follow mamba_ssm's ``mamba_simple.Mamba``, so official
checkpoints load by name:

    in_proj   (2 * d_inner, d_model)            x and the gate z
    conv1d    weight (d_inner, 1, d_conv), bias  causal depthwise conv
    x_proj    (dt_rank + 2 * d_state, d_inner)  the selection: Δ (low rank), B, C from x
    dt_proj   weight (d_inner, dt_rank), bias    Δ back to d_inner; bias = softplus⁻¹(Δ_init)
    A_log     (d_inner, d_state)                 A = -exp(A_log), S4D-real init A_n = -(n+1)
    D         (d_inner,)                         skip connection
    out_proj  (d_model, d_inner)
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from .. import ops
from . import lora_aware
from .cache import LayerState
from .mixer_parts import (
    check_packed,
    conv_with_state,
    init_dt_bias,
    packed_samples,
    steps_fit,
    store_sample_states,
    zero_padding,
)
from .norms import RMSNorm
from .ssm_config import Mamba1Config


def weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32 (FalconMamba's extra norm on Δ, B and C)."""
    return ops.rms_norm(x, torch.ones(x.shape[-1], device=x.device), eps=eps)


class Mamba1(nn.Module):
    """The Mamba block of Gu & Dao 2023 (figure 3): x, z = in_proj(u); x = SiLU(conv(x)) (or
    ``cfg.activation``);
    Δ, B, C = x_proj(x) (the selection, section 3.2); y = S6(x) (Algorithm 2) * SiLU(z);
    out_proj(y). (batch, seqlen, d_model) -> (batch, seqlen, d_model). ``cfg``: the model's
    ``mamba1`` group."""

    def __init__(self, d_model: int, cfg: Mamba1Config):
        super().__init__()
        self.d_model, self.d_inner, self.d_state = d_model, cfg.d_inner(d_model), cfg.d_state
        self.d_conv, self.dt_rank = cfg.d_conv, cfg.dt_rank_value(d_model)
        self.mixer_rms_eps = cfg.mixer_rms_eps
        self.activation = cfg.activation  # after the conv (SiLU but in Jamba configs saying else)
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=cfg.bias)
        self.conv1d = nn.Conv1d(
            self.d_inner,
            self.d_inner,
            cfg.d_conv,
            groups=self.d_inner,
            padding=cfg.d_conv - 1,
            bias=cfg.conv_bias,
        )
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, self.d_state))
        self.D = nn.Parameter(torch.empty(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=cfg.bias)
        if cfg.mixer_rms_weights:  # Jamba: RMSNorm with weights on Δ, B, C (transformers' names)
            self.dt_layernorm = RMSNorm(self.dt_rank, cfg.mixer_rms_eps)
            self.b_layernorm = RMSNorm(self.d_state, cfg.mixer_rms_eps)
            self.c_layernorm = RMSNorm(self.d_state, cfg.mixer_rms_eps)
        for p in (self.A_log, self.D, self.dt_proj.bias):
            p._no_weight_decay = True
        self.dt_proj.bias._no_reinit = True
        self.reset_ssm_parameters(cfg)

    @torch.no_grad()
    def reset_ssm_parameters(self, cfg: Mamba1Config):
        """mamba_ssm's init: dt_proj uniform/constant in ±dt_rank^-0.5 * dt_scale, S4D-real A, D
        = 1."""
        std = self.dt_rank**-0.5 * cfg.dt_scale
        if cfg.dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        else:
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        self.dt_proj.bias.copy_(init_dt_bias(self.d_inner, cfg))
        A = torch.arange(1, self.d_state + 1, dtype=torch.float32).repeat(
            self.d_inner, 1
        )  # A_n = -(n+1)
        self.A_log.copy_(torch.log(A))
        self.D.fill_(1.0)

    def _select(self, x):
        """The selection (section 3.2): Δ (rank dt_rank), B, C from x (..., d_inner), each (...,
        ·)."""
        dt, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        if hasattr(self, "dt_layernorm"):  # Jamba
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        elif self.mixer_rms_eps is not None:  # FalconMamba
            dt, B, C = (weightless_rms(t, self.mixer_rms_eps) for t in (dt, B, C))
        return dt, B, C

    def allocate_state(self, batch_size, dtype, device) -> LayerState:
        return LayerState(
            conv=torch.zeros(batch_size, self.d_inner, self.d_conv, dtype=dtype, device=device),
            ssm=torch.zeros(
                batch_size, self.d_inner, self.d_state, dtype=torch.float32, device=device
            ),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        state: LayerState | None = None,
        mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: (batch, seqlen, d_model) -> (batch, seqlen, d_model). With ``state`` the layer
        continues from it and leaves the new conv and SSM state there. mask: (batch, seqlen), 0 at
        left padding, which then leaves the conv and SSM states as if the row started later.
        seq_idx: (batch, seqlen) sample index of packed rows: conv and scan restart at every
        sample; with a (fresh) state of one row per sample, each sample's final conv and SSM
        states go to its own row (a packed prefill)."""
        check_packed(state, mask, seq_idx, per_sample=True)
        packed = state is not None and seq_idx is not None
        # a decode step or a few tokens: recurrent steps
        if not packed and steps_fit(hidden, state, mask):
            return self.step(hidden, state)
        A = -torch.exp(self.A_log.float())  # (d_inner, d_state)
        # Activations stay (batch, seqlen, channels) in memory; the ops get (batch, channels,
        # seqlen) views of them, which the scan turns time-major cheaply (rows of channels stay
        # contiguous).
        x, z = self.in_proj(hidden).chunk(2, dim=-1)  # (batch, seqlen, d_inner)
        # the conv sees zeros left of a row
        x = zero_padding(x, mask)
        # (batch, seqlen, d_inner)
        x = conv_with_state(
            x.transpose(1, 2), self.conv1d, state, self.activation, seq_idx=seq_idx
        ).transpose(1, 2)
        # Δ B x = 0: h stays at its zero start
        x = zero_padding(x, mask)
        dt, B, C = self._select(x)
        # Δ before its bias: (b, l, d_inner)
        dt = lora_aware.linear_no_bias(dt, self.dt_proj)
        out = ops.selective_scan(
            x.transpose(1, 2),
            dt.transpose(1, 2),
            A,
            B.transpose(1, 2),
            C.transpose(1, 2),
            D=self.D.float(),
            z=z.transpose(1, 2),
            delta_bias=lora_aware.bias(self.dt_proj).float(),
            delta_softplus=True,
            initial_state=None if state is None or packed else state.ssm,
            return_final_state=state is not None and not packed,
            seq_idx=seq_idx,
            return_sample_states=packed,
        )
        if packed:
            out, finals = out
            store_sample_states(state.ssm, finals, packed_samples(seq_idx)[0])
        elif state is not None:
            out, h = out
            state.ssm.copy_(h)
        return self.out_proj(out.transpose(1, 2))

    def step(self, hidden: torch.Tensor, state: LayerState) -> torch.Tensor:
        """k >= 1 tokens after the cached ones, as k recurrent steps in one call: hidden (batch, k,
        d_model) -> (batch, k, d_model), O(k) whatever the length so far (k = 1: a decode step; k >
        1: e.g. speculative decoding's verification of k drafted tokens). Equals k one-token
        calls. One token goes through the ops without a token axis, as a decode step."""
        one = hidden.shape[1] == 1
        x, z = self.in_proj(hidden[:, 0] if one else hidden).chunk(2, dim=-1)  # (b, [k,] d_inner)
        weight = rearrange(lora_aware.weight(self.conv1d, "conv1d"), "d 1 w -> d w")
        conv_bias = lora_aware.bias(self.conv1d)
        if one:
            x = ops.causal_conv1d_update(
                x, state.conv, weight, conv_bias, activation=self.activation
            )
        else:  # the conv takes (batch, dim, k)
            x = ops.causal_conv1d_update(
                x.transpose(1, 2), state.conv, weight, conv_bias, activation=self.activation
            ).transpose(1, 2)
        dt, B, C = self._select(x)
        dt = lora_aware.linear_no_bias(dt, self.dt_proj)  # (batch, [k,] d_inner)
        A = -torch.exp(self.A_log.float())
        y = ops.selective_state_update(  # with a token axis: k steps
            state.ssm,
            x,
            dt,
            A,
            B,
            C,
            D=self.D.float(),
            z=z,
            dt_bias=lora_aware.bias(self.dt_proj).float(),
            dt_softplus=True,
        )
        out = self.out_proj(y)
        return out[:, None] if one else out
