"""Causal multi-head attention for hybrid models, with mamba_ssm's ``MHA`` names and shapes.

A Jamba / Samba-style hybrid puts a few attention layers among the SSM layers: attention gives exact
recall of any earlier token (what a fixed-size state cannot), the SSM layers carry the rest cheaply.
Parameters, as in mamba_ssm's ``modules/mha.py`` so its hybrid checkpoints load by name:

    in_proj   (H·d + 2·H_kv·d + mlp_dim, d_model)   q (all H heads), then k, then v (H_kv heads
                                                    each), then the parallel MLP's up and gate
    conv1d    (qkv_dim, 1, d_conv), bias            optional short causal conv over q, k, v
                                                    (no activation)
    out_proj  (d_model, H·d + mlp_dim / 2)          attention output, then the MLP's, in one matmul

Per head, with rotary position embedding R_t on the first ``rotary_emb_dim`` dims of q and k:

    o_t = Σ_{s ∈ S(t)} softmax_s(scale · (R_t q_t)·(R_s k_s)) v_s,
    S(t) = {s ≤ t}  or  {t - w < s ≤ t}

with scale = softmax_scale or head_dim^-1/2 and w = ``window_size`` (sliding-window attention,
Samba). Keys and values are shared by groups of H / H_kv query heads (GQA; H_kv = 1 is MQA).

Packed samples (``seq_idx`` (batch, seqlen), :mod:`ssmkit.ops.packing`): S(t) also requires
seq_idx_s = seq_idx_t (a block-diagonal causal mask, the window still applied), the conv restarts at
each sample and the rotary position t counts from each sample's first token, so every sample attends
as if it ran alone. Long packed rows attend sample by sample (no (seqlen x seqlen) mask). With a
fresh cache of one row per sample (a packed prefill) each sample's keys and values go to its own
row (:meth:`ssmkit.models.cache.KVState.load_samples`), and decoding continues them as one batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ..ops.packing import positions_in_sample, sample_spans
from .cache import KVState
from .mixer_parts import check_packed, conv_with_state, packed_samples, zero_padding

# A packed call whose block-diagonal mask (batch x seqlen x seqlen) would hold more elements than
# this attends one sample at a time instead, each with SDPA's own causal (or windowed) path.
PACKED_MASK_LIMIT = 1 << 22


def rotary(
    x: torch.Tensor, positions: torch.Tensor, dim: int, base: float, interleaved: bool
) -> torch.Tensor:
    """Rotate the first ``dim`` channels of each head (Su et al. 2021, RoFormer eq. 34).

    x: (batch, heads, seqlen, head_dim); positions: (batch, seqlen) -> x rotated. Channel pair i
    turns by angle position · base^(-2i/dim). Pairs are (2i, 2i+1) when ``interleaved`` (GPT-J),
    else (i, i + dim/2) (GPT-NeoX, flash_attn's default), computed in fp32."""
    if dim == 0:
        return x
    inv_freq = base ** (
        -torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim
    )  # (dim/2,)
    angle = positions.float()[:, None, :, None] * inv_freq  # (batch, 1, seqlen, dim/2)
    cos, sin = angle.cos(), angle.sin()
    rot, rest = x[..., :dim].float(), x[..., dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = rot.chunk(2, dim=-1)
        turned = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([turned.to(x.dtype), rest], dim=-1)


def attention_mask(
    q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, start: torch.Tensor | None
) -> torch.Tensor:
    """Which keys each query sees, from absolute positions: (batch, 1, n_q, n_k) bool.

    q_pos: (n_q,), key_pos: (n_k,) (-1 = an empty cache slot); start: (batch,) the first real
    position of each row (left padding before it), or None. A query sees key s when start <= s <= t
    (and t - s < window). A padded query (t < start) sees only itself, so its (unused) output stays
    finite."""
    q, k = q_pos[:, None], key_pos[None, :]
    ok = (k <= q) & (k >= 0)
    if window is not None:
        ok &= k > q - window
    ok = ok[None, None]
    if start is not None:
        s = start[:, None, None, None]
        ok = (ok & (k >= s)) | ((q < s) & (k == q))
    return ok


def same_sample(q_idx: torch.Tensor, key_idx: torch.Tensor) -> torch.Tensor:
    """(batch, 1, n_q, n_k) bool: query and key belong to one packed sample. q_idx: (batch, n_q),
    key_idx: (batch, n_k), their seq_idx."""
    return (q_idx[:, :, None] == key_idx[:, None, :])[:, None]


class Attention(nn.Module):
    """mamba_ssm's MHA, always causal. (batch, seqlen, d_model) -> (batch, seqlen, d_model).

    ``window``: attend to the last ``window`` positions only (sliding-window attention), honoured in
    training, prefill and cached decoding alike; None = full causal attention."""

    def __init__(self, d_model: int, attn_cfg: dict, window: int | None = None):
        super().__init__()
        c = attn_cfg
        self.num_heads, self.num_heads_kv, self.head_dim = (
            c["num_heads"],
            c["num_heads_kv"],
            c["head_dim"],
        )
        self.softmax_scale = c["softmax_scale"]
        self.d_conv, self.window = c["d_conv"], window
        self.rotary_dim, self.rotary_base = c["rotary_emb_dim"], c["rotary_emb_base"]
        self.rotary_interleaved = c["rotary_emb_interleaved"]
        self.mlp_dim = math.ceil(c["mlp_dim"] / 256) * 256  # mamba_ssm rounds the MLP up to 256
        self.qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        self.in_proj = nn.Linear(d_model, self.qkv_dim + self.mlp_dim, bias=c["qkv_proj_bias"])
        if self.d_conv > 0:
            self.conv1d = nn.Conv1d(
                self.qkv_dim,
                self.qkv_dim,
                self.d_conv,
                padding=self.d_conv - 1,
                groups=self.qkv_dim,
            )
        self.out_proj = nn.Linear(
            self.head_dim * self.num_heads + self.mlp_dim // 2, d_model, bias=c["out_proj_bias"]
        )

    def allocate_state(self, batch_size, dtype, device) -> KVState:
        conv = (
            torch.zeros(batch_size, self.qkv_dim, self.d_conv, dtype=dtype, device=device)
            if self.d_conv > 0
            else None
        )
        return KVState(
            batch_size,
            self.num_heads_kv,
            self.head_dim,
            dtype,
            device,
            window=self.window,
            conv=conv,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        state: KVState | None = None,
        mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: (batch, seqlen, d_model); state: this layer's KV cache (continued and updated);
        mask: (batch, seqlen), 0 at LEFT padding, only on a fresh cache or without one; seq_idx:
        (batch, seqlen) sample index of packed rows (no mask): attention within each sample only;
        with a fresh ``state`` of one row per sample, each sample's keys and values (and conv
        inputs) go to its own row (a packed prefill)."""
        check_packed(state, mask, seq_idx, per_sample=True)
        b, n, _ = hidden.shape
        offset = 0 if state is None else state.length
        if state is not None and mask is not None:
            state.start = (1 - mask.long()).sum(1)  # first real position per row
        start = None if state is None else getattr(state, "start", None)
        if state is None and mask is not None:
            start = (1 - mask.long()).sum(1)
        qkv = self.in_proj(hidden)
        if self.mlp_dim:
            qkv, up_gate = qkv.split([self.qkv_dim, self.mlp_dim], dim=-1)
            up, gate = up_gate.chunk(2, dim=-1)
            mlp_out = up * F.silu(gate)  # the parallel MLP
        if self.d_conv > 0:
            qkv = zero_padding(qkv, mask).transpose(1, 2)  # (batch, qkv_dim, seqlen)
            qkv = conv_with_state(
                qkv,
                self.conv1d,
                state,
                activation=None,  # MHA: no SiLU
                seq_idx=seq_idx,
            ).transpose(1, 2)
        q, k, v = qkv.split(
            [
                self.num_heads * self.head_dim,
                self.num_heads_kv * self.head_dim,
                self.num_heads_kv * self.head_dim,
            ],
            dim=-1,
        )
        q, k, v = (rearrange(t, "b l (h d) -> b h l d", d=self.head_dim) for t in (q, k, v))
        pos = torch.arange(offset, offset + n, device=hidden.device)
        rope_pos = pos[None].expand(b, n) if start is None else pos[None] - start[:, None]
        if seq_idx is not None:  # each sample counts from 0
            rope_pos = positions_in_sample(seq_idx)
        q = rotary(q, rope_pos, self.rotary_dim, self.rotary_base, self.rotary_interleaved)
        k = rotary(k, rope_pos, self.rotary_dim, self.rotary_base, self.rotary_interleaved)
        if state is None or seq_idx is not None:
            out = self._attend(q, k, v, pos, pos, start, seq_idx)
            if state is not None:  # a packed prefill
                state.load_samples(k, v, *packed_samples(seq_idx)[1:])
        else:
            keys, values, key_pos = state.append(k, v)
            out = self._attend(q, keys, values, pos, key_pos, start)
        out = rearrange(out, "b h l d -> b l (h d)")
        if self.mlp_dim:
            out = torch.cat([out, mlp_out], dim=-1)
        return self.out_proj(out)

    def _attend(self, q, k, v, q_pos, key_pos, start, seq_idx=None):
        """q: (b, H, n_q, d); k, v: (b, H_kv, n_k, d) -> (b, H, n_q, d), masked by position (and,
        with seq_idx (b, n) of a cache-free call, to each query's own packed sample).

        Plain causal attention without padding, packing or cache takes SDPA's ``is_causal`` path
        (flash / memory-efficient kernels); a long sliding window is computed in blocks of
        ``window`` queries, each against its own ≤ 2·window keys, so memory is O(L·w), not O(L²)."""
        gqa = dict(enable_gqa=True) if self.num_heads != self.num_heads_kv else {}
        sdpa = lambda q_, k_, v_, m_: F.scaled_dot_product_attention(  # noqa: E731
            q_, k_, v_, attn_mask=m_, scale=self.softmax_scale, **gqa
        )
        n_q, n_k, w = q.shape[2], k.shape[2], self.window
        if seq_idx is not None and q.shape[0] * n_q * n_k > PACKED_MASK_LIMIT:
            return self._attend_per_sample(q, k, v, seq_idx)
        # a plain causal pass: no padding, the queries are exactly the keys (no cache before them)
        plain = start is None and n_q > 1 and n_q == n_k and bool((key_pos == q_pos).all())
        if plain and w is None and seq_idx is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, **gqa
            )
        if plain and w is not None and n_q > 2 * w:
            outs = []
            for lo in range(0, n_q, w):
                hi, k_lo = min(lo + w, n_q), max(0, lo - w + 1)
                m = attention_mask(q_pos[lo:hi], key_pos[k_lo:hi], w, None)
                if seq_idx is not None:
                    m = m & same_sample(seq_idx[:, lo:hi], seq_idx[:, k_lo:hi])
                outs.append(sdpa(q[:, :, lo:hi], k[:, :, k_lo:hi], v[:, :, k_lo:hi], m))
            return torch.cat(outs, dim=2)
        m = attention_mask(q_pos, key_pos, w, start)
        return sdpa(q, k, v, m if seq_idx is None else m & same_sample(seq_idx, seq_idx))

    def _attend_per_sample(self, q, k, v, seq_idx):
        """A packed call, one sample at a time: each sample's queries, keys and values
        are a plain causal (or windowed) pass of their own, so no block-diagonal mask of the whole
        row is ever built. Shapes as :meth:`_attend`."""
        out = q.new_empty(q.shape)
        for r, s, e in zip(*(t.tolist() for t in sample_spans(seq_idx))):
            pos = torch.arange(e - s, device=q.device)
            out[r : r + 1, :, s:e] = self._attend(
                q[r : r + 1, :, s:e], k[r : r + 1, :, s:e], v[r : r + 1, :, s:e], pos, pos, None
            )
        return out
