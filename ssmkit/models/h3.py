r"""The H3 mixer, "Hungry Hungry Hippos" (Fu, Dao, Saab, Thomas, Rudra & Ré 2022, arXiv 2212.14052,
section 3.1 and figure 1): two SSMs and multiplicative interactions between projections q, k, v,
built to recall a value seen after a key, as attention does.

$$ Q = x W_Q,\ K = x W_K,\ V = x W_V; \qquad
   \bar K = \mathrm{SSM}_{shift}(K); \qquad
   O_h = Q_h^\top\, \mathrm{SSM}_{diag}(\bar K_h V_h^\top) \ \text{per head } h; \qquad
   y = O W_O. $$

* The shift SSM (:func:`ssmkit.ops.shift_ssm`): A shifts the state by one, B = e₁, so the state
  holds the last ``shift_size`` keys and the SSM's kernel is its C: a causal depthwise convolution
  of learned taps (kept as ``shift_conv``, run by :func:`ssmkit.ops.causal_conv1d`), plus a skip
  ``shift_D``. It lets a token compare itself with the few before it.
* The diagonal SSM (S4D, :class:`ssmkit.models.s4d.DiagonalSSM`), one per head, on the outer
  product K̄_h V_hᵀ (head_dim x head_dim entries, each a state of N/2 complex modes) plus a skip D:
  it remembers which values followed which keys, over the whole sequence.
* The query reads that memory out: O_h = Q_hᵀ (...), a head_dim vector per head.

Parameter names and shapes (HazyResearch/H3's ``src/models/ssm/h3.py`` names in brackets; H
heads of head_dim channels, d = d_model = H · head_dim, W = ``shift_size``):

    q_proj, k_proj, v_proj  (d, d), bias                                     [the same]
    shift_conv  weight (d, 1, W): tap l of channel c is the shift SSM's C_l  [ssm_k_kernel.C]
                (stored as a conv: index W - 1 - l), torch's Conv1d init
    shift_D     (d,), N(0, 1)                                                [ssm_k_D]        fp32
    ssm.*       :class:`~ssmkit.models.s4d.DiagonalSSM` over the H heads     [kernel]         fp32
    D           (H,), N(0, 1)                                                [D]              fp32
    out_proj    (d, d), bias                                                 [output_linear]

The diagonal SSM is H3's default (its LM's ``ssm_cfg``: S4D-Lin, the bilinear discretisation; B is
absorbed into C, as in S4D). The output's channels are laid out (head, d2); the H3 code's are (d2,
head), a permutation out_proj absorbs.

Two modes, equal (tests/unit/models/test_h3.py): :meth:`H3.forward` (FFT convolutions: training
and prefill, continuing from a state) and :meth:`H3.step` (one token: the shift register and the
diagonal recurrence, O(1) per token).

Glossary (code -> paper): ``q``, ``k``, ``v`` = Q, K, V; ``kv`` = K̄ Vᵀ per head, the diagonal SSM's
input; H = ``nheads``; ``head_dim`` = d_h; N = ``d_state``; W = ``shift_size`` (the shift SSM's
state size); ``state.conv`` = the shift SSM's state (its last W inputs), ``state.ssm`` = the
diagonal SSM's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from .. import ops
from . import lora_aware
from .cache import LTIState
from .mixer_parts import KeepsFp32, check_packed, conv_with_state, zero_padding
from .s4d import DiagonalSSM
from .ssm_config import H3Config


class H3(KeepsFp32, nn.Module):
    """H3: q, k, v projections; k through the shift SSM; per head the diagonal SSM over k vᵀ, read
    out by q; out_proj. (batch, seqlen, d_model) -> (batch, seqlen, d_model). ``cfg``: the model's
    ``h3`` group."""

    FP32_PARAMS = ("shift_D", "D")

    def __init__(self, d_model: int, cfg: H3Config):
        super().__init__()
        cfg.check_width(d_model)
        self.d_model, self.head_dim, self.nheads = d_model, cfg.head_dim, cfg.nheads(d_model)
        self.d_state, self.shift_size = cfg.d_state, cfg.shift_size
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.shift_conv = nn.Conv1d(
            d_model,
            d_model,
            cfg.shift_size,
            groups=d_model,
            padding=cfg.shift_size - 1,
            bias=False,
        )
        self.shift_D = nn.Parameter(torch.randn(d_model))
        self.ssm = DiagonalSSM(self.nheads, cfg.d_state, cfg.init, cfg.disc, cfg.dt_min, cfg.dt_max)
        self.D = nn.Parameter(torch.randn(self.nheads))
        self.out_proj = nn.Linear(d_model, d_model)

    def allocate_state(self, batch_size, dtype, device) -> LTIState:
        p, half = self.head_dim, self.d_state // 2
        return LTIState(
            ssm=torch.zeros(
                batch_size, p, p, self.nheads, half, dtype=torch.complex64, device=device
            ),
            conv=torch.zeros(batch_size, self.d_model, self.shift_size, dtype=dtype, device=device),
        )

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., nheads, head_dim), in fp32."""
        return x.float().unflatten(-1, (self.nheads, self.head_dim))

    def forward(
        self,
        hidden: torch.Tensor,
        state: LTIState | None = None,
        mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: (batch, seqlen, d_model) -> (batch, seqlen, d_model), by FFT convolutions. With
        ``state`` the layer continues from it and leaves the next one there. mask: (batch, seqlen),
        0 at left padding: k = v = 0 there leaves both SSMs' states at zero. seq_idx: (batch,
        seqlen) packed samples: both SSMs restart at every sample."""
        check_packed(state, mask, seq_idx)
        if state is not None and hidden.shape[1] == 1 and mask is None:
            return self.step(hidden, state)
        q = self.q_proj(hidden)
        k = zero_padding(self.k_proj(hidden), mask)
        v = zero_padding(self.v_proj(hidden), mask)
        shifted = conv_with_state(
            k.transpose(1, 2), self.shift_conv, state, activation=None, seq_idx=seq_idx
        ).transpose(1, 2)
        k = shifted.float() + self.shift_D.float() * k.float()  # (batch, seqlen, d_model)
        kv = torch.einsum("blhi,blhj->bijhl", self._heads(k), self._heads(v))  # K̄_h V_hᵀ
        y, after = self.ssm(kv, None if state is None else state.ssm, seq_idx)
        if state is not None:
            state.ssm = after
        y = y + self.D.float()[:, None] * kv  # (batch, head_dim, head_dim, nheads, seqlen)
        out = torch.einsum("blhi,bijhl->blhj", self._heads(q), y)  # Q_hᵀ (...)
        return self.out_proj(out.flatten(-2).to(hidden.dtype))

    def step(self, hidden: torch.Tensor, state: LTIState) -> torch.Tensor:
        """One token: (batch, 1, d_model) -> (batch, 1, d_model), O(1) in the sequence length."""
        x = hidden[:, 0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (batch, d_model)
        weight = rearrange(lora_aware.weight(self.shift_conv, "shift_conv"), "d 1 w -> d w")
        shifted = ops.causal_conv1d_update(k, state.conv, weight)  # the shift register moves
        k = shifted.float() + self.shift_D.float() * k.float()
        kv = torch.einsum("bhi,bhj->bijh", self._heads(k), self._heads(v))
        y, state.ssm = self.ssm.step(kv, state.ssm)
        y = y + self.D.float() * kv
        out = torch.einsum("bhi,bijh->bhj", self._heads(q), y)
        return self.out_proj(out.flatten(-2).to(hidden.dtype))[:, None]
