"""The Mamba-3 mixer (Lahoti et al. 2026, arXiv 2603.15569), SISO and MIMO, as mamba_ssm's
``Mamba3``.

Parameter names, shapes and initialisation follow mamba_ssm's ``modules/mamba3.py`` (R = mimo_rank
with is_mimo, else 1; G = ngroups; S = the number of rotation angles,
:func:`ssmkit.ops.rope_angles`):

    in_proj        (2·d_inner + 2·d_state·G·R + 3·nheads + S, d_model), no bias:
                   z, x, B, C, Δ, A, λ, angles
    dt_bias        (nheads,)            softplus⁻¹ of Δ_init, log-uniform in [dt_min, dt_max]  fp32
    B_bias, C_bias (nheads, R, d_state) ones                                                   fp32
    B_norm, C_norm weight (d_state,): RMSNorm of B and C (eps 1e-5), "QK-norm"
    mimo_x/z/o     (nheads, R, headdim) 1/R, 1, 1/R (MIMO only)                                fp32
    D              (nheads,)            ones                                                   fp32
    norm           weight (d_inner,): gated RMSNorm per head, before the gate (is_outproj_norm only)
    out_proj       (d_model, d_inner), no bias

No conv1d and no A_log: the trapezoid rule mixes in the previous input (the job of Mamba-1/2's
short conv), and A_t is computed per token, A_t = -max(f(a_t), A_floor), with f chosen by
``a_activation``: heavy_tail (mamba_ssm's current Mamba3) or softplus (its earlier versions, and
PyPI's mamba-ssm 2.3.2). The fp32 parameters stay fp32 when the model is cast to bf16 or fp16
(mamba_ssm creates them in fp32 whatever the model's dtype); the rest follows the cast.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from .cache import Mamba3State
from .mixer_parts import (
    KeepsFp32,
    check_packed,
    init_dt_bias,
    packed_samples,
    steps_fit,
    store_sample_states,
)
from .norms import RMSNorm, RMSNormGated
from .ssm_config import Mamba3Config

FP32_PARAMS = ("dt_bias", "B_bias", "C_bias", "mimo_x", "mimo_z", "mimo_o", "D")


class Mamba3(KeepsFp32, nn.Module):
    """Mamba-3: z, x, B, C, Δ, A, λ, angles from one in_proj; B and C normed, biased per head and
    rotated by angles accumulated with Δ; the exponential-trapezoidal scan
    (:func:`ssmkit.ops.mamba3_scan`), gated by silu(z); out_proj. MIMO runs the scan on
    ``mimo_rank`` projections of x at once.
    (batch, seqlen, d_model) -> (batch, seqlen, d_model). ``cfg``: the model's ``mamba3`` group (its
    chunk_size given, as ModelConfig fills it in)."""

    FP32_PARAMS = FP32_PARAMS

    def __init__(self, d_model: int, cfg: Mamba3Config):
        super().__init__()
        if cfg.chunk_size is None:
            raise ValueError(
                "Mamba3 needs cfg.chunk_size: take the mamba3 group of a ModelConfig, "
                "which fills it in, or give one (mamba_ssm's default: 64)"
            )
        self.d_model, self.d_inner, self.d_state = d_model, cfg.d_inner(d_model), cfg.d_state
        self.headdim, self.ngroups, self.nheads = cfg.headdim, cfg.ngroups, cfg.nheads(d_model)
        self.chunk_size, self.A_floor, self.a_activation = (
            cfg.chunk_size,
            cfg.A_floor,
            cfg.a_activation,
        )
        self.is_mimo, self.is_outproj_norm = cfg.is_mimo, cfg.is_outproj_norm
        self.rank = cfg.mimo_rank if cfg.is_mimo else 1
        self.nangles = ops.rope_angles(cfg.d_state, cfg.rope_fraction)
        bc = self.d_state * self.ngroups * self.rank
        self.sizes = [
            self.d_inner,
            self.d_inner,
            bc,
            bc,
            self.nheads,
            self.nheads,
            self.nheads,
            self.nangles,
        ]
        self.in_proj = nn.Linear(d_model, sum(self.sizes), bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.B_bias = nn.Parameter(torch.empty(self.nheads, self.rank, self.d_state))
        self.C_bias = nn.Parameter(torch.empty(self.nheads, self.rank, self.d_state))
        self.B_norm = RMSNorm(self.d_state, eps=1e-5)
        self.C_norm = RMSNorm(self.d_state, eps=1e-5)
        if self.is_mimo:
            for name in ("mimo_x", "mimo_z", "mimo_o"):
                setattr(self, name, nn.Parameter(torch.empty(self.nheads, self.rank, self.headdim)))
        self.D = nn.Parameter(torch.empty(self.nheads))
        if self.is_outproj_norm:
            self.norm = RMSNormGated(
                self.d_inner, eps=1e-5, group_size=self.headdim, norm_before_gate=True
            )
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)
        # mamba_ssm exempts dt_bias and D from weight decay; ssmkit also the biases and the MIMO
        # scales
        for name in FP32_PARAMS:
            if hasattr(self, name):
                getattr(self, name)._no_weight_decay = True
        self.reset_ssm_parameters(cfg)

    @torch.no_grad()
    def reset_ssm_parameters(self, cfg: Mamba3Config):
        """mamba_ssm's init: Δ log-uniform in [dt_min, dt_max], B and C biases 1, D = 1,
        mimo_x = mimo_o = 1/R, mimo_z = 1."""
        self.dt_bias.copy_(init_dt_bias(self.nheads, cfg))
        for p in (self.B_bias, self.C_bias, self.D):
            p.fill_(1.0)
        if self.is_mimo:
            self.mimo_x.fill_(1.0 / self.rank)
            self.mimo_z.fill_(1.0)
            self.mimo_o.fill_(1.0 / self.rank)

    def allocate_state(self, batch_size, dtype, device) -> Mamba3State:
        new = lambda *shape, dt=dtype: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        return Mamba3State(
            angle=new(batch_size, self.nheads, self.nangles, dt=torch.float32),
            ssm=new(batch_size, self.nheads, self.headdim, self.d_state, dt=torch.float32),
            k=new(batch_size, self.rank, self.nheads, self.d_state),
            v=new(batch_size, self.nheads, self.headdim),
        )

    def _inputs(self, proj: torch.Tensor) -> dict:
        """in_proj's output (..., sum(sizes)) -> the scan's inputs, keyed as
        :func:`ssmkit.ops.mamba3_scan` takes them, and z for the output (ranks, groups and heads
        split out; Δ, A in fp32)."""
        z, x, B, C, dt, a, trap, angles = torch.split(proj, self.sizes, dim=-1)
        split = (self.rank, self.ngroups, self.d_state)
        return (
            dict(
                x=x.unflatten(-1, (self.nheads, self.headdim)),
                dt=F.softplus(dt.float() + self.dt_bias.float()),  # Δ_t
                A=-ops.a_activation(a.float(), self.a_activation).clamp(
                    min=self.A_floor
                ),  # A_t <= -A_floor
                trap=trap,  # λ_t = sigmoid(trap)
                B=self.B_norm(B.unflatten(-1, split)),
                C=self.C_norm(C.unflatten(-1, split)),
                angles=angles.unsqueeze(-2).expand(*angles.shape[:-1], self.nheads, self.nangles),
                B_bias=self.B_bias,
                C_bias=self.C_bias,
                D=self.D,
                **(
                    {"mimo_x": self.mimo_x, "mimo_z": self.mimo_z, "mimo_o": self.mimo_o}
                    if self.is_mimo
                    else {}
                ),
            ),
            z.unflatten(-1, (self.nheads, self.headdim)),
        )

    def _gated(self, inputs: dict, z: torch.Tensor) -> dict:
        """Without is_outproj_norm the scan applies the gate (and MIMO's down-projection) itself;
        with it the scan returns what the norm takes: ungated, and per rank for MIMO."""
        if not self.is_outproj_norm:
            return dict(inputs, z=z)
        return dict(inputs, mimo_o=None) if self.is_mimo else inputs

    def _output(self, y: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
        """The scan's output (..., [rank,] nheads, headdim) -> out_proj's output (..., d_model)."""
        if self.is_outproj_norm:
            if (
                self.is_mimo
            ):  # the norm per rank on its own gate z ⊙ mimo_z[r], then Σ_r mimo_o[r] y_r
                zr = z.float()[..., None, :, :] * self.mimo_z.float().transpose(0, 1)
                y = self.norm(y.float().flatten(-2), zr.flatten(-2)).unflatten(-1, y.shape[-2:])
                y = (y.float() * self.mimo_o.float().transpose(0, 1)).sum(dim=-3)
            else:
                y = self.norm(y.flatten(-2), z.flatten(-2)).unflatten(
                    -1, (self.nheads, self.headdim)
                )
        return self.out_proj(y.flatten(-2).to(dtype))

    def forward(
        self,
        hidden: torch.Tensor,
        state: Mamba3State | None = None,
        mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: (batch, seqlen, d_model) -> (batch, seqlen, d_model); continues from ``state`` if
        given. mask: (batch, seqlen), 0 at left padding, which then leaves no trace in the state.
        seq_idx: (batch, seqlen) sample index of packed rows: the scan (state, previous input,
        angle) restarts at every sample; with a (fresh) state of one row per sample, each sample's
        final angle, state, key and input go to its own row (a packed prefill)."""
        check_packed(state, mask, seq_idx, per_sample=True)
        packed = state is not None and seq_idx is not None
        # a decode step or a few tokens: recurrent steps
        if not packed and steps_fit(hidden, state, mask):
            return self.step(hidden, state)
        inputs, z = self._inputs(self.in_proj(hidden))
        if mask is not None:
            # Δ = 0 at padding: no input, no decay, no turn (an exact identity); x = 0 there, so the
            # first real token's trapezoid sees a zero "previous input", as at the start of an
            # unpadded row
            inputs["dt"] = inputs["dt"] * mask[:, :, None]
            inputs["x"] = inputs["x"] * mask[:, :, None, None].to(inputs["x"].dtype)
        fresh = state is None or state.seen == 0 or packed
        out = ops.mamba3_scan(
            **self._gated(inputs, z),
            chunk_size=self.chunk_size,
            initial_states=None if fresh else state.tensors(),
            return_final_states=state is not None and not packed,
            seq_idx=seq_idx,
            return_sample_states=packed,
        )
        if packed:
            out, finals = out
            number, _, start, end = packed_samples(seq_idx)
            for old, new in zip(state.tensors(), finals):
                store_sample_states(old, new, number)
            state.seen = int((end - start).max())
        elif state is not None:
            out, final = out
            for old, new in zip(state.tensors(), final):
                old.copy_(new)
            state.seen += hidden.shape[1]
        return self._output(out, z, hidden.dtype)

    def step(self, hidden: torch.Tensor, state: Mamba3State) -> torch.Tensor:
        """k >= 1 tokens after the cached ones, as k recurrent steps in one call: (batch, k,
        d_model) -> (batch, k, d_model), O(k) whatever the length so far. Equals k one-token
        calls. One token goes through the ops without a token axis, as a decode step."""
        one = hidden.shape[1] == 1
        inputs, z = self._inputs(self.in_proj(hidden[:, 0] if one else hidden))
        y = ops.mamba3_step(state.tensors(), **self._gated(inputs, z))  # with a token axis: k steps
        state.seen += hidden.shape[1]
        out = self._output(y, z, hidden.dtype)
        return out[:, None] if one else out
