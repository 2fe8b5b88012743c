"""Norm modules; the math is in :mod:`ssmkit.ops.norm`."""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import ops


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim. x: (..., d) -> (..., d)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, eps=self.eps)


class RMSNormGated(nn.Module):
    """Mamba-2's gated, grouped RMSNorm: RMSNorm(x * silu(z)) (or RMSNorm(x) * silu(z))."""

    def __init__(
        self,
        d: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = False,
    ):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return ops.rms_norm_gated(
            x,
            self.weight,
            z,
            eps=self.eps,
            group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
        )
