"""Zamba2's shared transformer block and its per-invocation adapters (see
:mod:`ssmkit.models.zamba2`).

A shared block reads x = concat(hidden, embeddings), 2 * d_model wide (Zamba, arXiv 2405.16712, fig.
2), and, exactly as transformers' ``Zamba2AttentionDecoderLayer``, has *no* residual connections:

    a = attn(RMSNorm_2d(x))              # (batch, seqlen, d_model): o_proj maps back to d_model
    y = mlp(RMSNorm_d(a))                # (batch, seqlen, d_model)

The attention's head_dim is 2 * d_model / num_attention_heads and its softmax scale is
1 / sqrt(head_dim / 2), not 1 / sqrt(head_dim) (transformers' ``Zamba2Attention``: the input is two
d_model-wide halves). The weights are shared by every layer that uses the block; the adapters
(arXiv 2411.15242, fig. 2) are not: each hybrid layer owns low-rank ``up(down(x))`` terms added to
q, k, v and to the MLP's gate_up projection (:class:`Zamba2Adapters`), so a shared block can act
differently at each depth for little memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.activations import activation
from .cache import KVState, LayerState
from .norms import RMSNorm


@dataclass
class HybridState:
    """The cache of a hybrid layer: its Mamba-2 state, the shared attention's keys and values at
    this depth, and ``first_real`` (batch,): the position of each row's first real token (left
    padding before it stays masked in every later step)."""

    mamba: LayerState
    kv: KVState
    first_real: torch.Tensor

    def nbytes(self) -> int:
        return self.mamba.nbytes() + self.kv.nbytes() + self.first_real.numel() * 8


class LowRank(nn.Module):
    """An adapter: x -> up(down(x)), rank r. (..., d_in) -> (..., d_out). transformers stores it as
    ``nn.Sequential(Linear(d_in, r), Linear(r, d_out))`` (``.0`` = down, ``.1`` = up)."""

    def __init__(self, d_in: int, rank: int, d_out: int):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class Zamba2Adapters(nn.Module):
    """The adapters of one hybrid layer (one invocation of a shared block): ``q``, ``k``, ``v``
    (with use_shared_attention_adapter) and ``gate_up`` (with use_shared_mlp_adapter); absent ones
    are None."""

    def __init__(self, d_model: int, z: dict):
        super().__init__()
        heads, kv_heads, r = z["num_attention_heads"], z["num_key_value_heads"], z["adapter_rank"]
        head_dim = 2 * d_model // heads
        self.q = self.k = self.v = self.gate_up = None
        if z["use_shared_attention_adapter"]:
            self.q = LowRank(2 * d_model, r, heads * head_dim)
            self.k = LowRank(2 * d_model, r, kv_heads * head_dim)
            self.v = LowRank(2 * d_model, r, kv_heads * head_dim)
        if z["use_shared_mlp_adapter"]:
            self.gate_up = LowRank(d_model, r, 2 * z["intermediate_size"])


def _plus(proj: nn.Linear, adapter: LowRank | None, x: torch.Tensor) -> torch.Tensor:
    """proj(x) + adapter(x): the shared projection plus this layer's low-rank term."""
    return proj(x) if adapter is None else proj(x) + adapter(x)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype
) -> tuple[torch.Tensor, ...]:
    """RoPE tables for positions (seqlen,): cos, sin of shape (seqlen, head_dim), halves repeated
    (transformers' "default" rope: inv_freq_i = theta^(-2i / head_dim), computed in fp32). Per-row
    positions (batch, seqlen) (packed samples) give (batch, 1, seqlen, head_dim), broadcast over
    heads."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # (..., seqlen, head_dim / 2)
    emb = torch.cat([freqs, freqs], dim=-1)
    if emb.dim() == 3:
        emb = emb[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seqlen, head_dim) rotated: x * cos + rotate_half(x) * sin, with
    rotate_half([x1, x2]) = [-x2, x1] (the two halves of head_dim, not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Zamba2SharedAttention(nn.Module):
    """Causal multi-head attention over x: (batch, seqlen, 2 * d_model) -> (batch, seqlen, d_model).

    q = W_q x (+ adapter), k = W_k x (+ adapter), v = W_v x (+ adapter), optionally RoPE on q, k;
    out = W_o softmax(q k^T / sqrt(head_dim / 2) + mask) v, with kv heads repeated for GQA."""

    def __init__(self, d_model: int, z: dict):
        super().__init__()
        self.heads, self.kv_heads = z["num_attention_heads"], z["num_key_value_heads"]
        self.head_dim = 2 * d_model // self.heads
        self.scale = (self.head_dim / 2) ** -0.5
        self.q_proj = nn.Linear(2 * d_model, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * d_model, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * d_model, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        adapters: Zamba2Adapters,
        positions: torch.Tensor,
        first_real: torch.Tensor | None,
        rope: tuple | None,
        kv: KVState | None,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (batch, seqlen, 2 * d_model) at ``positions`` (seqlen,). first_real: (batch,) the
        first non-padding position of each row, or None (no padding). kv: the cache to extend, or
        None.
        seq_idx: (batch, seqlen) packed samples (no cache): a query sees keys of its own sample
        only."""
        b, n, _ = x.shape
        q = _plus(self.q_proj, adapters.q, x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = (
            _plus(self.k_proj, adapters.k, x)
            .view(b, n, self.kv_heads, self.head_dim)
            .transpose(1, 2)
        )
        v = (
            _plus(self.v_proj, adapters.v, x)
            .view(b, n, self.kv_heads, self.head_dim)
            .transpose(1, 2)
        )
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        key_pos = positions
        if kv is not None:  # keys/values of every position so far: (b, kv_heads, L, hd)
            k, v, key_pos = kv.append(k, v)
        if self.kv_heads != self.heads:  # GQA: kv head j serves q heads j*rep .. (j+1)*rep - 1
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if first_real is None and kv is None and seq_idx is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            # key j is visible to query i iff 0 <= pos_j <= pos_i and pos_j is not left padding; a
            # padded query also sees itself, so its (unused) output is finite rather than NaN
            kp, qp = key_pos[None, None, :], positions[None, :, None]
            allowed = (kp >= 0) & (kp <= qp)
            if first_real is not None:
                allowed = (allowed & (kp >= first_real[:, None, None])) | (kp == qp)
            if seq_idx is not None:  # block-diagonal: one packed sample
                allowed = allowed & (seq_idx[:, :, None] == seq_idx[:, None, :])
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed[:, None], scale=self.scale
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class Zamba2SharedMLP(nn.Module):
    """(batch, seqlen, d_model) -> (batch, seqlen, d_model): g, u = gate_up(x) (+ adapter), halves;
    y = down(act(g) * u)  (transformers' ``Zamba2MLP``: the activation on the FIRST half)."""

    def __init__(self, d_model: int, z: dict):
        super().__init__()
        self.hidden_act = z["hidden_act"]  # a name in ssmkit.ops.ACTIVATIONS
        self.gate_up_proj = nn.Linear(
            d_model, 2 * z["intermediate_size"], bias=z["add_bias_linear"]
        )
        self.down_proj = nn.Linear(z["intermediate_size"], d_model, bias=z["add_bias_linear"])

    def forward(self, x: torch.Tensor, adapters: Zamba2Adapters) -> torch.Tensor:
        gate, up = _plus(self.gate_up_proj, adapters.gate_up, x).chunk(2, dim=-1)
        return self.down_proj(activation(self.hidden_act)(gate) * up)


class Zamba2SharedBlock(nn.Module):
    """One shared transformer block: (hidden, embeddings) (batch, seqlen, d_model) each ->
    (batch, seqlen, d_model) = mlp(norm2(attn(norm(concat(hidden, embeddings))))), no residuals."""

    def __init__(self, d_model: int, z: dict, eps: float):
        super().__init__()
        self.norm = RMSNorm(2 * d_model, eps)  # transformers: input_layernorm
        self.attn = Zamba2SharedAttention(d_model, z)
        self.norm2 = RMSNorm(d_model, eps)  # transformers: pre_ff_layernorm
        self.mlp = Zamba2SharedMLP(d_model, z)

    def forward(
        self,
        hidden: torch.Tensor,
        embeddings: torch.Tensor,
        adapters: Zamba2Adapters,
        positions: torch.Tensor,
        first_real: torch.Tensor | None,
        rope: tuple | None,
        kv: KVState | None,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.norm(torch.cat([hidden, embeddings], dim=-1))
        a = self.attn(x, adapters, positions, first_real, rope, kv, seq_idx)
        return self.mlp(self.norm2(a), adapters)


__all__ = [
    "HybridState",
    "LowRank",
    "Zamba2Adapters",
    "Zamba2SharedAttention",
    "Zamba2SharedBlock",
    "Zamba2SharedMLP",
    "apply_rope",
    "rope_cos_sin",
]
