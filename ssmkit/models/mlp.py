"""The gated MLP of hybrid blocks (mamba_ssm's ``modules/mlp.py``; the SwiGLU of Shazeer 2020).

    fc1  (2·h, d_model)   the value and the gate, in that order, in one matmul
    fc2  (d_model, h)
    mlp(x) = fc2(value ⊙ act(gate)),  value, gate = fc1(x).chunk(2)

act is SiLU (mamba_ssm's GatedMLP, SwiGLU) unless ``activation`` names another of
:data:`ssmkit.ops.ACTIVATIONS` (transformers' ``hidden_act`` names: Jamba's MLP is
down(act(gate) ⊙ up), the same function).

h = ``d_intermediate`` rounded up to a multiple of 128, as mamba_ssm does (so a checkpoint's
``d_intermediate`` gives its weights' shapes).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.activations import activation as _activation


def mlp_width(d_intermediate: int, multiple_of: int = 128) -> int:
    """mamba_ssm's rounding of the hidden width: up to a multiple of ``multiple_of``."""
    return (d_intermediate + multiple_of - 1) // multiple_of * multiple_of


class GatedMLP(nn.Module):
    """(..., d_model) -> (..., d_model)."""

    def __init__(
        self, d_model: int, d_intermediate: int, bias: bool = False, activation: str = "silu"
    ):
        super().__init__()
        _activation(activation, "activation")  # a known name (looked up by name in forward, so
        self.activation = activation  # the module pickles)
        hidden = mlp_width(d_intermediate)
        self.fc1 = nn.Linear(d_model, 2 * hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(value * _activation(self.activation)(gate))
