"""Zamba2 (Zyphra; Glorioso et al. 2024, arXiv 2411.15242): Mamba-2 layers and shared attention
blocks.

Computed exactly as transformers' ``Zamba2Model`` (fp32 logits agree to 1e-4,
tests/unit/models/test_zamba2.py):

    e = embedding(ids);  h = e
    for layer i:
        if i in hybrid_layer_ids (the k-th of them):
            t = linear_i(shared[k % num_mem_blocks](h, e, adapters_i))    # zamba2_blocks.py
            h = h + mamba_i(norm_i(h + t))     # t enters the Mamba input only, not the residual
        else:
            h = h + mamba_i(norm_i(h))
    hidden = norm_f(h)

(transformers' ``Zamba2HybridLayer`` + ``Zamba2MambaDecoderLayer``; Zamba, arXiv 2405.16712, eq. 6.)
The shared blocks live in ``backbone.shared``; everything a hybrid layer owns alone (its ``linear``,
its adapters, its Mamba-2 mixer and norm) lives in ``backbone.layers[i]``, so wrapping each layer
(FSDP, activation checkpointing) never splits a shared weight. The residual stream stays in the
model's dtype, as in transformers (``residual_in_fp32`` does not apply).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..ops.packing import positions_in_sample
from .cache import InferenceCache, KVState, LayerState
from .config import ModelConfig
from .mamba2 import Mamba2
from .norms import RMSNorm
from .zamba2_blocks import HybridState, Zamba2Adapters, Zamba2SharedBlock, rope_cos_sin

# transformers' Zamba2MambaMixer builds its gated RMSNorm with eps 1e-5 whatever rms_norm_eps says
MIXER_NORM_EPS = 1e-5


class Zamba2Layer(nn.Module):
    """One Mamba-2 layer, with (``hybrid``) the shared block's per-layer parts: ``linear`` and
    ``adapters``; ``block`` is the index of the shared block it uses. (batch, seqlen, d_model) ->
    (batch, seqlen, d_model)."""

    def __init__(self, cfg: ModelConfig, hybrid_index: int | None):
        super().__init__()
        z = cfg.zamba2
        self.norm = RMSNorm(cfg.d_model, cfg.norm_epsilon)  # transformers: input_layernorm
        self.mixer = Mamba2(cfg.d_model, cfg.mamba2, cfg.norm_epsilon)
        self.mixer.norm.eps = MIXER_NORM_EPS
        self.hybrid = hybrid_index is not None
        self.block = None if hybrid_index is None else hybrid_index % z["num_mem_blocks"]
        if self.hybrid:
            self.linear = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
            self.adapters = Zamba2Adapters(cfg.d_model, z)

    def forward(
        self,
        hidden: torch.Tensor,
        embeddings: torch.Tensor,
        shared: Zamba2SharedBlock | None,
        state: LayerState | HybridState | None,
        mask: torch.Tensor | None,
        attn: dict,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden, embeddings: (batch, seqlen, d_model); shared: the block of a hybrid layer; attn:
        the shared attention's positions, first_real and rope (see :meth:`Zamba2Backbone.forward`);
        seq_idx: (batch, seqlen) packed samples, for the shared attention and the Mamba-2 mixer
        alike."""
        x = hidden
        if self.hybrid:
            kv = None if state is None else state.kv
            t = shared(hidden, embeddings, self.adapters, kv=kv, seq_idx=seq_idx, **attn)
            x = hidden + self.linear(t)
            state = None if state is None else state.mamba
        return hidden + self.mixer(self.norm(x), state, mask, seq_idx=seq_idx)


class Zamba2Backbone(nn.Module):
    """embedding -> Zamba2 layers -> norm_f. ``forward(input_ids, cache, mask)`` -> hidden
    (batch, seqlen, d_model) after the final norm (the LM head is the caller's)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        z = cfg.zamba2
        if not z:
            raise ValueError("Zamba2Backbone needs cfg.zamba2 (see ssmkit.models.zamba2_config)")
        if set(cfg.mixers) != {"mamba2"} or not cfg.rms_norm or cfg.d_intermediate:
            raise ValueError(
                f"zamba2 models are Mamba-2 layers with RMSNorm and no per-layer MLP: need "
                f"mixer='mamba2' in every layer, rms_norm=True, d_intermediate=0; got mixers "
                f"{sorted(set(cfg.mixers))}, rms_norm={cfg.rms_norm}, "
                f"d_intermediate={cfg.d_intermediate}"
            )
        self.config = cfg
        self.embedding = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        hybrid = {layer: k for k, layer in enumerate(z["hybrid_layer_ids"])}
        self.shared = nn.ModuleList(
            Zamba2SharedBlock(cfg.d_model, z, cfg.norm_epsilon)
            for _ in range(min(z["num_mem_blocks"], len(hybrid)))
        )
        self.layers = nn.ModuleList(Zamba2Layer(cfg, hybrid.get(i)) for i in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_epsilon)  # transformers: final_layernorm
        self.head_dim = 2 * cfg.d_model // z["num_attention_heads"]
        self.gradient_checkpointing = False  # recompute each layer in the backward (long context)
        self._init_shared()

    @torch.no_grad()
    def _init_shared(self):
        """transformers' init of the attention, MLP, adapter and ``linear`` weights: N(0,
        initializer_range) (MambaLM's own init then zeroes biases and sets the Mamba layers)."""
        owned = [
            part for layer in self.layers if layer.hybrid for part in (layer.linear, layer.adapters)
        ]
        for part in [*self.shared, *owned]:
            for module in part.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=self.config.initializer_range)

    def allocate_states(self, batch_size: int, dtype, device) -> list:
        """One state per layer: LayerState (Mamba-2) or, for a hybrid layer, a HybridState that also
        holds the shared attention's keys and values at that depth."""
        z, states = self.config.zamba2, []
        for layer in self.layers:
            mamba = layer.mixer.allocate_state(batch_size, dtype, device)
            if layer.hybrid:
                kv = KVState(batch_size, z["num_key_value_heads"], self.head_dim, dtype, device)
                first = torch.zeros(batch_size, dtype=torch.long, device=device)
                states.append(HybridState(mamba, kv, first))
            else:
                states.append(mamba)
        return states

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: InferenceCache | None = None,
        mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: (batch, seqlen); cache: continue from and update these states (its
        ``seqlen_offset`` gives the positions); mask: (batch, seqlen), 0 at LEFT padding, or None;
        seq_idx: (batch, seqlen) packed samples (no cache, no mask): RoPE positions restart at each
        sample's first token, attention and scans stay inside each sample."""
        z = self.config.zamba2
        embeddings = self.embedding(input_ids)  # transformers: original_hidden_states
        offset = 0 if cache is None else cache.seqlen_offset
        positions = torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)
        first_real = None if mask is None else (mask == 0).sum(dim=1)  # left padding: its length
        if cache is not None:
            hybrid_states = [s for s in cache.layers if isinstance(s, HybridState)]
            if offset == 0:  # the prefill: remember each row's padding
                for s in hybrid_states:
                    s.first_real.copy_(
                        torch.zeros_like(s.first_real) if first_real is None else first_real
                    )
            first_real = hybrid_states[0].first_real if hybrid_states else None
        rope_pos = positions if seq_idx is None else positions_in_sample(seq_idx)  # (L,) or (b, L)
        rope = (
            rope_cos_sin(rope_pos, self.head_dim, z["rope_theta"], embeddings.dtype)
            if z["use_mem_rope"]
            else None
        )
        attn = dict(positions=positions, first_real=first_real, rope=rope)
        hidden = embeddings
        recompute = (
            self.gradient_checkpointing
            and self.training
            and cache is None
            and torch.is_grad_enabled()
        )
        for i, layer in enumerate(self.layers):
            shared = self.shared[layer.block] if layer.hybrid else None
            if recompute:
                hidden = checkpoint(
                    layer,
                    hidden,
                    embeddings,
                    shared,
                    None,
                    mask,
                    attn,
                    seq_idx,
                    use_reentrant=False,
                )
            else:
                hidden = layer(
                    hidden,
                    embeddings,
                    shared,
                    None if cache is None else cache.layers[i],
                    mask,
                    attn,
                    seq_idx,
                )
        return self.norm_f(hidden)


__all__ = ["MIXER_NORM_EPS", "Zamba2Backbone", "Zamba2Layer"]
