"""The inference cache: what a Mamba layer needs to continue a sequence in O(1) per token.

Per layer there are two tensors, independent of how many tokens were seen:

* ``conv``: the last ``d_conv`` inputs of the causal conv, (batch, conv_dim, d_conv);
* ``ssm``:  the SSM state h_t, (batch, d_inner, d_state) for Mamba-1 and
  (batch, nheads, headdim, d_state) for Mamba-2, kept in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerState:
    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass
class InferenceCache:
    layers: list[LayerState] = field(default_factory=list)
    seqlen_offset: int = 0          # tokens already folded into the states

    @classmethod
    def allocate(cls, model, batch_size: int, dtype=None, device=None) -> InferenceCache:
        """Zero states for every layer of ``model`` (an :class:`ssmkit.models.MambaLM`)."""
        param = next(model.parameters())
        dtype = dtype or param.dtype
        device = device or param.device
        return cls([layer.mixer.allocate_state(batch_size, dtype, device) for layer in model.backbone.layers])

    def nbytes(self) -> int:
        """Memory held by the cache: constant in the sequence length."""
        return sum(s.conv.numel() * s.conv.element_size() + s.ssm.numel() * s.ssm.element_size()
                   for s in self.layers)
