"""The Mamba-2 mixer (Dao & Gu 2024, figure 6 "parallel Mamba-2 block", section 7).

Parameter names, shapes and initialisation follow mamba_ssm's ``mamba2.Mamba2``:

    in_proj   (2 * d_inner + 2 * ngroups * d_state + nheads, d_model)  z, xBC, dt in one matmul
    conv1d    weight (conv_dim, 1, d_conv), bias; conv_dim = d_inner + 2 * ngroups * d_state
    dt_bias   (nheads,)      softplus⁻¹(Δ_init)
    A_log     (nheads,)      A = -exp(A_log), A_init ~ U(A_init_range)
    D         (nheads,)      or (nheads, headdim) with D_has_hdim
    norm      weight (d_inner,): gated RMSNorm, groups of d_inner / ngroups channels
    out_proj  (d_model, d_inner)
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange
from torch.utils.checkpoint import checkpoint

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
from .norms import RMSNormGated
from .ssm_config import Mamba2Config


class Mamba2(nn.Module):
    """The parallel Mamba-2 block of Dao & Gu 2024 (figure 6): z, x, B, C, Δ all from one in_proj;
    x, B, C = SiLU(conv(x, B, C)); y = SSD(x) (section 6); out_proj(RMSNorm(y * SiLU(z))).
    (batch, seqlen, d_model) -> (batch, seqlen, d_model). ``cfg``: the model's ``mamba2`` group;
    ``norm_epsilon``: of the gated RMSNorm (the model's)."""

    def __init__(self, d_model: int, cfg: Mamba2Config, norm_epsilon: float = 1e-5):
        super().__init__()
        self.d_model, self.d_inner, self.d_state = d_model, cfg.d_inner(d_model), cfg.d_state
        self.d_conv, self.headdim, self.ngroups = cfg.d_conv, cfg.headdim, cfg.ngroups
        self.nheads, self.chunk_size = cfg.nheads(d_model), cfg.chunk_size
        self.dt_limit = cfg.dt_limit
        self.conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + self.nheads, bias=cfg.bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            cfg.d_conv,
            groups=self.conv_dim,
            padding=cfg.d_conv - 1,
            bias=cfg.conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.D = nn.Parameter(
            torch.empty((self.nheads, self.headdim) if cfg.D_has_hdim else (self.nheads,))
        )
        self.norm = RMSNormGated(
            self.d_inner,
            eps=norm_epsilon,
            group_size=self.d_inner // self.ngroups,
            norm_before_gate=cfg.norm_before_gate,
        )
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=cfg.bias)
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        self.reset_ssm_parameters(cfg)

    @torch.no_grad()
    def reset_ssm_parameters(self, cfg: Mamba2Config):
        """mamba_ssm's init: Δ log-uniform in [dt_min, dt_max], A ~ U(A_init_range), D = 1."""
        self.dt_bias.copy_(init_dt_bias(self.nheads, cfg))
        lo, hi = cfg.A_init_range
        self.A_log.copy_(torch.log(torch.empty(self.nheads).uniform_(lo, hi)))
        self.D.fill_(1.0)
        self.norm.weight.fill_(1.0)

    def allocate_state(self, batch_size, dtype, device) -> LayerState:
        return LayerState(
            conv=torch.zeros(batch_size, self.conv_dim, self.d_conv, dtype=dtype, device=device),
            ssm=torch.zeros(
                batch_size,
                self.nheads,
                self.headdim,
                self.d_state,
                dtype=torch.float32,
                device=device,
            ),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        state: LayerState | None = None,
        mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: (batch, seqlen, d_model) -> (batch, seqlen, d_model); continues from ``state`` if
        given. mask: (batch, seqlen), 0 at left padding, which then leaves no trace in the conv or
        SSM state. seq_idx: (batch, seqlen) sample index of packed rows: conv and scan restart at
        every sample; with a (fresh) state of one row per sample, each sample's final conv and SSM
        states go to its own row (a packed prefill)."""
        check_packed(state, mask, seq_idx, per_sample=True)
        packed = state is not None and seq_idx is not None
        # a decode step or a few tokens: recurrent steps
        if not packed and steps_fit(hidden, state, mask):
            return self.step(hidden, state)
        A = -torch.exp(self.A_log.float())  # (nheads,)
        z, xBC, dt = torch.split(
            self.in_proj(hidden), [self.d_inner, self.conv_dim, self.nheads], dim=-1
        )
        # Training on more than RECOMPUTE_FROM tokens (ssmkit.ops.ssd), on the torch ops: besides
        # the SSD (which ssd_scan then recomputes by segments), the conv + SiLU and the gated norm
        # with out_proj are recomputed in the backward from their inputs (which stay alive anyway:
        # views of in_proj's output, the scan's output) instead of keeping the conv's padded copy
        # and pre-SiLU values, the norm's three intermediates and its output (out_proj's input):
        # 2 conv_dim + 4 d_inner floats a token. Like the SSD's, these recomputations cost time at
        # every length, so shorter calls keep everything; ops.ssd_recompute() forces both ways. The
        # kernels' own functions (causal_conv1d_fn, rmsnorm_fn) save only their inputs.
        recompute = (
            state is None
            and torch.is_grad_enabled()
            and ops.ssd.recomputes(hidden.shape[0] * hidden.shape[1])
        )

        def conv(xBC):  # (batch, seqlen, conv_dim); the conv sees zeros left of a row
            xBC = rearrange(zero_padding(xBC, mask), "b l d -> b d l")
            return rearrange(
                conv_with_state(xBC, self.conv1d, state, seq_idx=seq_idx), "b d l -> b l d"
            )

        xBC = _maybe_recomputed(conv, xBC, on=recompute and _torch_op("causal_conv1d", xBC))
        x, B, C = torch.split(
            xBC, [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1
        )
        dt_args = dict(dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit)
        if mask is not None:
            # Δ = 0 at padding: such a step neither feeds nor decays the state, an exact identity
            # (the scan pads its own tail the same way), so what the conv left there (SiLU of its
            # bias) never enters it. Zeroing x instead would keep the padding's decay in the chunk's
            # prefix sums of Δ·A, which costs precision when the padding is long.
            dt = ops.discretize_dt(dt, self.dt_bias, True, self.dt_limit) * mask[:, :, None]
            dt_args = dict(dt_bias=None, dt_softplus=False)
        out = ops.ssd_scan(
            rearrange(x, "b l (h p) -> b l h p", p=self.headdim),
            dt,
            A,
            rearrange(B, "b l (g n) -> b l g n", g=self.ngroups),
            rearrange(C, "b l (g n) -> b l g n", g=self.ngroups),
            self.chunk_size,
            D=self.D,
            initial_states=None if state is None or packed else state.ssm,
            return_final_states=state is not None and not packed,
            seq_idx=seq_idx,
            return_sample_states=packed,
            **dt_args,
        )
        if packed:
            out, finals = out
            store_sample_states(state.ssm, finals, packed_samples(seq_idx)[0])
        elif state is not None:
            out, h = out
            state.ssm.copy_(h)
        return _maybe_recomputed(
            self._gated_norm_out,
            rearrange(out, "b l h p -> b l (h p)"),
            z,
            on=recompute and _torch_op("rms_norm_gated", z),
        )

    def _gated_norm_out(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_proj(RMSNorm(y * SiLU(z))): (batch, seqlen, d_inner) x 2 -> (batch, seqlen,
        d_model)."""
        return self.out_proj(self.norm(y, z))

    def step(self, hidden: torch.Tensor, state: LayerState) -> torch.Tensor:
        """k >= 1 tokens after the cached ones, as k recurrent steps in one call: (batch, k,
        d_model) -> (batch, k, d_model), O(k) whatever the length so far. Equals k one-token
        calls. One token goes through the ops without a token axis, as a decode step."""
        one = hidden.shape[1] == 1
        z, xBC, dt = torch.split(
            self.in_proj(hidden[:, 0] if one else hidden),
            [self.d_inner, self.conv_dim, self.nheads],
            dim=-1,
        )  # (batch, [k,] ·)
        conv = (
            rearrange(lora_aware.weight(self.conv1d, "conv1d"), "d 1 w -> d w"),
            lora_aware.bias(self.conv1d),
        )
        if one:
            xBC = ops.causal_conv1d_update(xBC, state.conv, *conv, activation="silu")
        else:  # the conv takes (batch, dim, k)
            xBC = ops.causal_conv1d_update(
                xBC.transpose(1, 2), state.conv, *conv, activation="silu"
            ).transpose(1, 2)
        x, B, C = torch.split(
            xBC, [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1
        )
        P, N = self.headdim, self.d_state
        # A, Δ, its bias and D one per head, broadcast over headdim (and dstate) with stride 0: the
        # layout mamba_ssm's Mamba2.step passes (the kernel's tie_hdim)
        A = (-torch.exp(self.A_log.float()))[:, None, None].expand(self.nheads, P, N)
        D = self.D if self.D.dim() == 2 else self.D[:, None].expand(self.nheads, P)
        dt_bias, softplus = self.dt_bias[:, None].expand(self.nheads, P), True
        if tuple(self.dt_limit) != (0.0, float("inf")):  # clamp Δ here, as the chunked scan does
            dt, dt_bias, softplus = (
                ops.discretize_dt(dt, self.dt_bias, True, self.dt_limit),
                None,
                False,
            )
        y = ops.selective_state_update(  # with a token axis: k steps
            state.ssm,
            x.unflatten(-1, (self.nheads, P)),
            dt[..., None].expand(*dt.shape, P),
            A,
            B.unflatten(-1, (self.ngroups, N)),
            C.unflatten(-1, (self.ngroups, N)),
            D=D,
            dt_bias=dt_bias,
            dt_softplus=softplus,
        )
        out = self.out_proj(self.norm(y.flatten(-2), z))
        return out[:, None] if one else out


def _torch_op(op: str, x: torch.Tensor) -> bool:
    """Whether ``op`` runs on ssmkit's PyTorch path for ``x`` (not a CUDA kernel)."""
    return ops.backend.select(op, x) != "cuda"


def _maybe_recomputed(fn, *args, on: bool):
    """``fn(*args)``; with ``on``, under ``torch.utils.checkpoint``: only the arguments are kept for
    the backward, which runs ``fn`` again (activation checkpointing of one small step)."""
    return checkpoint(fn, *args, use_reentrant=False) if on else fn(*args)
