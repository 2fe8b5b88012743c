"""The language model: embedding -> n_layer pre-norm residual blocks -> final norm -> LM head.

Module names follow mamba_ssm's ``MambaLMHeadModel`` (``backbone.embedding``,
``backbone.layers.N.norm``, ``backbone.layers.N.mixer.*``, ``backbone.layers.N.norm2``,
``backbone.layers.N.mlp.*``, ``backbone.norm_f``, ``lm_head``), so its checkpoints (hybrids with
attention and MLPs included) load by name. Each block computes

    residual = residual + hidden;  hidden = mixer(norm(residual))
    residual = residual + hidden;  hidden = mlp(norm2(residual))   (only with d_intermediate > 0)

with the residual stream optionally kept in fp32 (``residual_in_fp32``). On the layers
``cfg.moe_layers`` the MLP is a mixture of experts (:mod:`ssmkit.models.moe`, Jamba's), whose
router's load-balancing loss joins the loss when labels are given (``out.aux_loss``). The mixer of
a layer is Mamba-1, Mamba-2, Mamba-3 or causal attention (full or sliding-window): a Jamba-style
hybrid is this same stack with ``attn_every`` / ``attn_layer_idx`` / ``layout`` naming the attention
layers. S4D and H3, the linear time-invariant mixers, take the same place. With ``cfg.zamba2`` the
backbone is Zamba2's instead (:mod:`ssmkit.models.zamba2`).

For long sequences two switches trade compute for memory: ``model.gradient_checkpointing = True``
recomputes each block in the backward pass (activations of one block live at a time), and
``loss_chunk_size`` computes the LM head and the loss over chunks of positions, so the (L x V)
logits never exist at once (same loss and gradients as the plain loss).

Packed samples (SFT): ``model(input_ids, seq_idx=...)`` with seq_idx (batch, seqlen) the index of
the sample each position belongs to in its row (:mod:`ssmkit.ops.packing`; from position ids with
:func:`ssmkit.ops.seq_idx_from_position_ids`) restarts every conv, scan and attention at each
sample, so a packed row gives each sample's logits and loss as if it ran alone. seq_idx -1 marks a
position to ignore (causal-conv1d's padding): it changes no state and takes no loss. With a fresh
cache of one row per sample (``allocate_cache(n_samples)``) the same call is a packed prefill:
each sample's final states go to its own row, and one-token steps then continue all samples as a
batch (:func:`ssmkit.models.generate` with a list of prompts).

Holes: the layers see each row's real positions (``attention_mask`` 1, ``seq_idx`` >= 0) moved, in
order, to one end of the row (:func:`real_first`): ignored positions become left padding (or, for
seq_idx, one trailing sample of their own), so a row with holes gives at its real positions what
the row without the holes gives. The outputs are put back in the caller's positions.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..checks import is_integer
from .attention import Attention
from .cache import InferenceCache
from .config import ModelConfig
from .h3 import H3
from .mamba1 import Mamba1
from .mamba2 import Mamba2
from .mamba3 import Mamba3
from .mixer_parts import IGNORED_SAMPLE, packed_samples
from .mlp import GatedMLP
from .moe import SparseMoE, load_balancing_loss
from .norms import RMSNorm
from .s4d import S4D

# The mixers that keep one state per packed sample, so a packed prefill can fill a cache.
PER_SAMPLE_MIXERS = (Mamba1, Mamba2, Mamba3, Attention)


def make_mixer(cfg: ModelConfig, kind: str) -> nn.Module:
    """The mixer of one layer: "mamba1", "mamba2", "mamba3", "s4d", "h3", "attn" (full causal
    attention) or "swa" (a sliding window)."""
    if kind == "mamba1":
        return Mamba1(cfg.d_model, cfg.mamba1)
    if kind == "mamba2":
        return Mamba2(cfg.d_model, cfg.mamba2, cfg.norm_epsilon)
    if kind == "mamba3":
        return Mamba3(cfg.d_model, cfg.mamba3)
    if kind == "s4d":
        return S4D(cfg.d_model, cfg.s4d)
    if kind == "h3":
        return H3(cfg.d_model, cfg.h3)
    return Attention(
        cfg.d_model, cfg.attn_cfg, window=cfg.attn_cfg["window_size"] if kind == "swa" else None
    )


def make_mlp(cfg: ModelConfig, layer_idx: int | None) -> nn.Module | None:
    """The MLP after layer ``layer_idx``'s mixer: a mixture of experts on ``cfg.moe_layers``, else
    the gated MLP of width d_intermediate, or None (d_intermediate 0)."""
    if cfg.d_intermediate == 0:
        return None
    if layer_idx in cfg.moe_layers:
        return SparseMoE(
            cfg.d_model,
            cfg.d_intermediate,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            activation=cfg.mlp_activation,
        )
    return GatedMLP(cfg.d_model, cfg.d_intermediate, activation=cfg.mlp_activation)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.rms_norm:
        return RMSNorm(cfg.d_model, cfg.norm_epsilon)
    return nn.LayerNorm(cfg.d_model, cfg.norm_epsilon)


@dataclass
class LMOutput:
    logits: torch.Tensor | None  # (batch, seqlen, padded_vocab_size), the last k positions, or None
    # (a chunked loss never holds them all)
    loss: torch.Tensor | None = None  # mean cross-entropy over labelled positions
    cache: InferenceCache | None = None  # the states after this call, when a cache was passed
    # mixture of experts: the router's load-balancing loss (moe.py; in ``loss`` times
    # router_aux_loss_coef), with labels or output_router_logits ...
    aux_loss: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None  # ... (batch·seqlen, E) per MoE layer


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: str, layer_idx: int | None = None):
        """Layer ``layer_idx`` of the stack (None: a dense block, wherever it sits)."""
        super().__init__()
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = make_norm(cfg)
        self.mixer = make_mixer(cfg, mixer)
        if cfg.d_intermediate > 0:  # norm2 registered first: the parameters' order stays
            self.norm2 = make_norm(cfg)
        self.mlp = make_mlp(cfg, layer_idx)

    def _add_norm(self, hidden, residual, norm):
        """residual += hidden; the normed residual, and the residual (fp32 with
        residual_in_fp32)."""
        residual = hidden if residual is None else residual + hidden
        normed = norm(residual.to(norm.weight.dtype))
        return normed, residual.float() if self.residual_in_fp32 else residual

    def forward(
        self,
        hidden,
        residual,
        state=None,
        mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ):
        """hidden, residual: (batch, seqlen, d_model) -> the same two, one block further.
        mask: (batch, seqlen), 0 at left padding (MambaLM.forward has moved any holes there,
        :func:`real_first`); seq_idx: (batch, seqlen) packed samples (see :func:`check_seq_idx`)."""
        hidden, residual = self._add_norm(hidden, residual, self.norm)
        hidden = self.mixer(hidden, state, mask, seq_idx=seq_idx)
        if self.mlp is not None:
            hidden, residual = self._add_norm(hidden, residual, self.norm2)
            hidden = self.mlp(hidden)
        return hidden, residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, m, i) for i, m in enumerate(cfg.mixers))
        self.norm_f = make_norm(cfg)
        self.gradient_checkpointing = False

    def allocate_states(self, batch_size: int, dtype, device) -> list:
        """Zero states for generation, one per layer: a LayerState (Mamba-1/2), a Mamba3State, an
        LTIState (S4D, H3) or a KVState (attention)."""
        return [layer.mixer.allocate_state(batch_size, dtype, device) for layer in self.layers]

    def forward(
        self,
        input_ids,
        cache: InferenceCache | None = None,
        mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ):
        hidden, residual = self.embedding(input_ids), None
        recompute = (
            self.gradient_checkpointing
            and self.training
            and cache is None
            and torch.is_grad_enabled()
        )
        for i, layer in enumerate(self.layers):
            if (
                recompute
            ):  # keep only the block's inputs; its activations are recomputed in the backward
                hidden, residual = checkpoint(
                    layer, hidden, residual, None, mask, seq_idx, use_reentrant=False
                )
            else:
                hidden, residual = layer(
                    hidden, residual, None if cache is None else cache.layers[i], mask, seq_idx
                )
        residual = hidden if residual is None else residual + hidden
        return self.norm_f(residual.to(self.norm_f.weight.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``h Wᵀ + b`` against ``targets``, ``chunk`` rows at a time, with the
    gradients computed in the forward pass (the fused linear + cross-entropy of Liger-Kernel and
    Apple's cut-cross-entropy, here in plain torch).

    For one chunk, z = h Wᵀ + b and ℓ = Σ_rows (logsumexp z − z[target]); its gradient w.r.t. the
    logits is G = softmax(z) − onehot(target) (zero on ignored rows), so ∂ℓ/∂h = G W and
    ∂ℓ/∂W = Gᵀ h are two matmuls while the chunk's logits are at hand. Only those
    gradients, (N, d) and (V, d), are kept for the backward, which scales them by the incoming
    gradient: no (N, V) logits ever, and no recomputation (checkpointing the chunks would run the
    head's matmul twice, the dominant cost of a small model with a 50K vocabulary). Logits are
    made in the matmul dtype (autocast's where active) and reduced in fp32, as the plain loss."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, chunk):
        grad_h = torch.empty_like(h) if h.requires_grad else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        grad_b = (
            torch.zeros_like(bias, dtype=torch.float32)
            if bias is not None and bias.requires_grad
            else None
        )
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for lo in range(0, h.shape[0], chunk):
            hc, tc = h[lo : lo + chunk], targets[lo : lo + chunk]
            logits = F.linear(hc, weight, bias)
            mm_dtype = logits.dtype
            logits = logits.float()
            keep = tc != -100
            safe = tc.masked_fill(~keep, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None])[:, 0]
            total += ((lse - picked) * keep).sum()
            if grad_h is None and grad_w is None and grad_b is None:
                continue
            dz = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' buffer
            dz[torch.arange(len(tc), device=dz.device), safe] -= 1.0
            dz.mul_(keep[:, None])
            if grad_b is not None:
                grad_b += dz.sum(0)
            dzm = dz.to(mm_dtype)
            if grad_h is not None:
                grad_h[lo : lo + chunk] = (dzm @ weight.to(mm_dtype)).to(h.dtype)
            if grad_w is not None:
                grad_w += (dzm.t() @ hc.to(mm_dtype)).float()
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = h.dtype, weight.dtype, None if bias is None else bias.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grads = [
            None if g is None else (g * grad_out).to(dtype)
            for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)
        ]
        return *grads, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Mean cross-entropy of ``lm_head(hidden)`` against targets, ``chunk_size`` positions at a
    time.

    hidden: (batch, seqlen, d_model); targets: (batch, seqlen), -100 = no loss. Peak memory holds
    one chunk's logits (chunk_size x V) instead of all L x V. A plain ``nn.Linear`` head takes the
    fused path (:class:`_LinearCrossEntropy`: gradients made in the forward, no recomputation);
    any other head (a LoRA-wrapped one) recomputes each chunk's logits in the backward (activation
    checkpointing)."""
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    count = (t != -100).sum()
    if type(lm_head) is nn.Linear:
        total = _LinearCrossEntropy.apply(h, lm_head.weight, lm_head.bias, t, chunk_size)
        return total / count

    def summed(h_chunk, t_chunk):
        return F.cross_entropy(
            lm_head(h_chunk).float(), t_chunk, ignore_index=-100, reduction="sum"
        )

    total = hidden.new_zeros((), dtype=torch.float32)
    for lo in range(0, t.shape[0], chunk_size):
        total = total + checkpoint(
            summed, h[lo : lo + chunk_size], t[lo : lo + chunk_size], use_reentrant=False
        )
    return total / count


def check_token_ids(input_ids: torch.Tensor, cfg: ModelConfig):
    """One clear error for ids the embedding cannot look up (instead of an IndexError deep
    inside)."""
    if (
        input_ids.dtype.is_floating_point
        or input_ids.dtype.is_complex
        or input_ids.dtype == torch.bool
    ):
        raise ValueError(f"input_ids must hold integer token ids; got dtype {input_ids.dtype}")
    rows = cfg.padded_vocab_size
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= rows):
        bad = input_ids[(input_ids < 0) | (input_ids >= rows)]
        padded = f", padded to {rows} rows" if rows != cfg.vocab_size else ""
        raise ValueError(
            f"input_ids holds token id {int(bad[0])}, outside the model's vocabulary: "
            f"valid ids are 0..{rows - 1} (vocab_size {cfg.vocab_size}{padded})"
        )


def check_attention_mask(mask: torch.Tensor, input_ids: torch.Tensor, values: bool = True):
    """mask: (batch, seqlen) of 0/1 (or bool), 1 at real tokens. Zeros anywhere: left padding, holes
    in the middle, right padding; the model runs each row's real tokens as one sequence
    (:func:`real_first`)."""
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"attention_mask must be a tensor of the shape of input_ids "
            f"{tuple(input_ids.shape)}; got {got}"
        )
    if not values:
        return
    if (
        mask.dtype.is_floating_point
        or mask.dtype.is_complex
        or not ((mask == 0) | (mask == 1)).all()
    ):
        raise ValueError(
            "attention_mask must hold only 0 (padding) and 1 (real token), "
            "as an integer or bool tensor"
        )


def real_first(real: torch.Tensor, last: bool = True) -> torch.Tensor:
    """order (batch, seqlen) int64: each row's positions with the real ones (``real`` True) moved,
    in their order, to the end of the row (``last``) or to its start, the others to the other end,
    also in order. ``x.gather(1, order)`` is the row the layers see: a mask with holes becomes left
    padding, exactly what an SSM's state and attention's positions need. The identity for a
    left-padded mask. A stable sort, no value read on the host."""
    key = real.to(torch.int8) if last else (~real.bool()).to(torch.int8)
    return torch.sort(key, dim=1, stable=True).indices


def check_seq_idx(seq_idx: torch.Tensor, input_ids: torch.Tensor, values: bool = True):
    """seq_idx: an integer tensor of input_ids' shape (batch, seqlen), the sample index of every
    position of a packed row, e.g. [0, 0, 0, 1, 1, 2], non-decreasing along each row (the kernels'
    convention, mamba_ssm, causal-conv1d); -1 marks a position to ignore (causal-conv1d's padding),
    anywhere, and the other values stay non-decreasing around it. ``values``: also read the values
    (a sync on a GPU)."""
    if not isinstance(seq_idx, torch.Tensor) or seq_idx.shape != input_ids.shape:
        got = tuple(seq_idx.shape) if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
        raise ValueError(
            f"seq_idx must be a tensor of the shape of input_ids {tuple(input_ids.shape)}; "
            f"got {got}"
        )
    if seq_idx.dtype.is_floating_point or seq_idx.dtype.is_complex or seq_idx.dtype == torch.bool:
        raise ValueError(
            f"seq_idx must hold integer sample indices (int32 or int64); got dtype {seq_idx.dtype}"
        )
    if not values or not seq_idx.numel():
        return
    s = seq_idx.long()
    if int(s.min()) < -1 or int(s.max()) >= IGNORED_SAMPLE:
        row, pos = (int(v) for v in ((s < -1) | (s >= IGNORED_SAMPLE)).nonzero()[0])
        raise ValueError(
            f"seq_idx row {row} holds {int(s[row, pos])} at position {pos}: sample indices are "
            f"0, 1, 2, ... (below {IGNORED_SAMPLE}), and -1 marks a position to ignore (padding)"
        )
    seen = F.pad(s[:, :-1], (1, 0), value=-1).cummax(dim=1).values  # the largest index before t
    down = ((s >= 0) & (s < seen)).nonzero()
    if len(down):
        row, pos = (int(v) for v in down[0])
        raise ValueError(
            f"seq_idx row {row} decreases at position {pos} ({int(seen[row, pos])} -> "
            f"{int(s[row, pos])}): each row must be non-decreasing, the samples packed one after "
            "another (-1, ignored positions, may sit anywhere)"
        )


def check_logits_to_keep(logits_to_keep, seqlen: int):
    """logits_to_keep: an int >= 0 (the last k positions; 0 = all), or a 1-D integer tensor of
    positions in 0..seqlen-1 (transformers' convention), e.g. the last position of every packed
    sample."""
    if isinstance(logits_to_keep, torch.Tensor):
        bad_dtype = logits_to_keep.dtype.is_floating_point or logits_to_keep.dtype in (
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
        if logits_to_keep.dim() != 1 or bad_dtype:
            raise ValueError(
                "logits_to_keep as a tensor must be 1-D integer positions; got "
                f"{tuple(logits_to_keep.shape)} {logits_to_keep.dtype}"
            )
        if logits_to_keep.numel() and (
            int(logits_to_keep.min()) < 0 or int(logits_to_keep.max()) >= seqlen
        ):
            raise ValueError(
                f"logits_to_keep positions must lie in 0..{seqlen - 1}; got "
                f"{logits_to_keep.min().item()}..{logits_to_keep.max().item()}"
            )
        return
    if not is_integer(logits_to_keep) or logits_to_keep < 0:
        raise ValueError(
            "logits_to_keep must be an int >= 0 (0: every position) or a 1-D tensor of "
            f"positions; got {logits_to_keep!r}"
        )


def packed_prefill_refusal(model) -> str | None:
    """Why ``model`` cannot fill a cache from packed samples (None if it can): every mixer must keep
    one state per sample (Mamba-1, -2, -3, attention); S4D, H3 and Zamba2's backbone do not."""
    if not isinstance(getattr(model, "backbone", None), Backbone):
        return f"its backbone {type(model.backbone).__name__} has no per-sample states"
    others = sorted(
        {
            type(layer.mixer).__name__
            for layer in model.backbone.layers
            if not isinstance(layer.mixer, PER_SAMPLE_MIXERS)
        }
    )
    return f"its {', '.join(others)} layers have no per-sample states" if others else None


# What writes MambaLM.save_pretrained's files: ssmkit.hub.save.save_pretrained, registered by the
# hub at import. A hook, because models sit below the hub and never import it.
_save_pretrained: Callable[..., Path] | None = None


def register_save_pretrained(writer: Callable[..., Path]):
    """Make ``writer(model, directory, format=, tokenizer_from=, state_dict=, overwrite=)`` the
    function :meth:`MambaLM.save_pretrained` delegates to; :mod:`ssmkit.hub.save` registers its
    ``save_pretrained`` when imported."""
    global _save_pretrained
    _save_pretrained = writer


def _to_positions(x: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """x (batch, seqlen, ...) in the layers' order -> the caller's positions; back (batch, m) is,
    for each wanted caller position, where the layers had it (``argsort`` of :func:`real_first`'s
    order, or a selection of its columns)."""
    index = back.reshape(*back.shape, *([1] * (x.dim() - 2))).expand(*back.shape, *x.shape[2:])
    return x.gather(1, index)


def _kept(hidden: torch.Tensor, logits_to_keep, back: torch.Tensor | None) -> torch.Tensor:
    """The positions of ``hidden`` (batch, seqlen, d) whose logits are wanted, in the caller's
    order: all (0), the last k (an int), or the given positions (a 1-D tensor)."""
    seqlen = hidden.shape[1]
    if isinstance(logits_to_keep, torch.Tensor):
        positions = logits_to_keep.to(hidden.device).long()
    elif logits_to_keep:
        positions = torch.arange(max(0, seqlen - logits_to_keep), seqlen, device=hidden.device)
    elif back is None:
        return hidden
    else:
        return _to_positions(hidden, back)
    if back is None:
        return hidden[:, positions]
    return _to_positions(hidden, back[:, positions])


class MambaLM(nn.Module):
    """A Mamba language model. ``model(input_ids, labels=None)`` -> :class:`LMOutput`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        if cfg.zamba2 is not None:
            from .zamba2 import Zamba2Backbone

            self.backbone = Zamba2Backbone(cfg)
        else:
            self.backbone = Backbone(cfg)
        self.loss_chunk_size = 0  # > 0: the loss over chunks of this many positions (long context)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def _init_weights(self, module):
        """mamba_ssm's ``_init_weights``: zero biases (but Δ's), N(0, 0.02) embeddings, and the
        GPT-2 rescaling of every residual branch's last matrix (mixers' out_proj, MLPs' fc2) by
        1/sqrt(n_residuals), n_residuals = n_layer (2 * n_layer with an MLP in each block)."""
        cfg = self.config
        if (
            isinstance(module, nn.Linear)
            and module.bias is not None
            and not getattr(module.bias, "_no_reinit", False)
        ):
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=cfg.initializer_range)
        last = {
            Mamba1: "out_proj",
            Mamba2: "out_proj",
            Mamba3: "out_proj",
            S4D: "out_proj",
            H3: "out_proj",
            Attention: "out_proj",
            GatedMLP: "fc2",
        }.get(type(module))
        if cfg.rescale_prenorm_residual and last is not None:
            weight = getattr(module, last).weight
            with torch.no_grad():
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
                weight /= math.sqrt(cfg.n_layer * (2 if cfg.d_intermediate > 0 else 1))

    def allocate_cache(self, batch_size: int, dtype=None, device=None) -> InferenceCache:
        """Fresh zero states for generation; see :class:`ssmkit.models.cache.InferenceCache`."""
        return InferenceCache.allocate(self, batch_size, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        cache: InferenceCache | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        shift_labels: bool = True,
        attention_mask: torch.Tensor | None = None,
        loss_chunk_size: int | None = None,
        seq_idx: torch.Tensor | None = None,
        output_router_logits: bool = False,
    ) -> LMOutput:
        """input_ids: (batch, seqlen) int64.

        labels: (batch, seqlen) aligned with input_ids as in transformers (shifted here, so
        ``labels=input_ids`` trains next-token prediction); with ``shift_labels=False`` they are
        already the targets of each position. -100 marks positions without a loss. With seq_idx and
        shift_labels the last position of each packed sample gets no target (the next token belongs
        to another sample), as when the sample runs alone.
        cache: continue from and update these states: a prefill, a one-token step, or k tokens
        in one call after a prefill (speculative decoding's verification), equal to k one-token
        calls; up to ``mixer_parts.STEP_TOKENS`` tokens run as recurrent steps, more as the scan.
        logits_to_keep: compute logits for the last k positions only (0 = all), or, a 1-D integer
        tensor, for those positions only (e.g. the last of every packed sample): logits
        (batch, len(positions), vocab).
        attention_mask: (batch, seqlen), 1 for real tokens and 0 for padding, at the left (what
        ``tokenizer.padding_side = "left"`` gives) or anywhere (holes): the logits of the real
        positions then equal those of the row's real tokens run alone, unpadded (the layers see
        them moved to the row's end, :func:`real_first`, labels moved with them), and so does the
        loss: padded positions take none, the token before a hole predicts the one after it. Only
        on a fresh cache (the prefill), whose states are then those after each row's last real
        token.
        loss_chunk_size: with labels, compute logits and loss over chunks of this many positions
        (default ``self.loss_chunk_size``; 0 = at once): the output's logits are then None, since
        the point is never to hold all of them (see :func:`chunked_cross_entropy`).
        seq_idx: (batch, seqlen) integer, the index of the sample each position belongs to in its
        packed row, non-decreasing, -1 at positions to ignore (:func:`check_seq_idx`): every mixer
        restarts at each sample, so each sample's logits are those of the sample run alone; an
        ignored position changes no state and takes no loss (its logits are meaningless). Not with
        an attention_mask. With a fresh ``cache`` of one row per sample (``allocate_cache(n)``, n
        samples counted row-major, ignored positions not counted) this is a packed prefill: each
        sample's final states go to its own cache row, ready for one-token steps of all samples
        at once (Mamba-1/2/3 and attention layers; :func:`packed_prefill_refusal`). Its values are
        checked (one sync on a GPU) except under torch.compile, where -1 is not supported.
        output_router_logits: with mixture-of-experts layers (``cfg.moe_layers``), return their
        router logits and the load-balancing loss (``aux_loss``) without labels too. With labels
        the aux loss is always computed and ``router_aux_loss_coef`` times it is added to ``loss``
        (transformers adds it only with ``output_router_logits=True``; a model that trains its
        router wants it every step, and a coefficient of 0 leaves it out).
        """
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be (batch, seqlen); got shape {tuple(input_ids.shape)}"
            )
        # Checking values reads the tensor: on a GPU that is a sync, under torch.compile a graph
        # break. So only CPU tensors outside compilation are checked here; generate() checks always.
        compiling = torch.compiler.is_compiling()
        check_values = input_ids.device.type == "cpu" and not compiling
        if check_values:
            check_token_ids(input_ids, self.config)
        check_logits_to_keep(logits_to_keep, input_ids.shape[1])
        order = None  # (batch, seqlen): the positions in the order the layers see them
        aux_mask = attention_mask  # the positions the router's loss counts
        if attention_mask is not None:
            if cache is not None and cache.seqlen_offset > 0:
                raise ValueError(
                    "attention_mask applies to the first call on a cache (the prefill) only; "
                    "the steps after it continue real tokens: pass attention_mask=None"
                )
            check_attention_mask(attention_mask, input_ids, values=check_values)
            order = real_first(attention_mask.bool())
            attention_mask = aux_mask = attention_mask.gather(1, order)
        if seq_idx is not None:
            if attention_mask is not None:
                raise ValueError(
                    "seq_idx (packed samples) cannot be combined with attention_mask (left "
                    "padding): pack without padding, or mark padding -1 in seq_idx"
                )
            check_seq_idx(seq_idx, input_ids, values=not compiling)
            if not compiling and bool((seq_idx < 0).any()):
                order = real_first(seq_idx >= 0, last=False)
                seq_idx = seq_idx.long().gather(1, order)  # room for IGNORED_SAMPLE
                ignored = seq_idx < 0
                seq_idx = seq_idx.masked_fill(ignored, IGNORED_SAMPLE)
                aux_mask = ~ignored
                if labels is not None:
                    labels = labels.gather(1, order).masked_fill(ignored, -100)
            if cache is not None:
                longest = self._check_packed_prefill(cache, seq_idx)
        if order is not None:
            input_ids = input_ids.gather(1, order)
            if labels is not None and attention_mask is not None:
                labels = labels.gather(1, order)
        moe = [m for m in self.modules() if isinstance(m, SparseMoE)]
        want_aux = bool(moe) and (labels is not None or output_router_logits)
        for m in moe:
            m.keep_router_logits = want_aux
        try:
            hidden = self.backbone(input_ids, cache, attention_mask, seq_idx=seq_idx)
            router_logits = tuple(m.router_logits for m in moe) if want_aux else None
        finally:  # no tensor left on a module (it would hold the graph, and break deepcopy)
            for m in moe:
                m.keep_router_logits, m.router_logits = False, None
        aux = None
        if want_aux:
            cfg = self.config
            aux = load_balancing_loss(
                router_logits, cfg.num_experts, cfg.num_experts_per_tok, aux_mask
            )
        back = None if order is None else torch.argsort(order, dim=1)  # caller's position -> ours
        if router_logits is not None and back is not None:
            router_logits = tuple(
                _to_positions(r.view(*input_ids.shape, -1), back).flatten(0, 1)
                for r in router_logits
            )
        extra = dict(aux_loss=aux, router_logits=router_logits if output_router_logits else None)
        if cache is not None:
            cache.seqlen_offset = (
                longest if seq_idx is not None else cache.seqlen_offset + input_ids.shape[1]
            )
        chunk = self.loss_chunk_size if loss_chunk_size is None else loss_chunk_size
        if labels is None:
            return LMOutput(
                logits=self.lm_head(_kept(hidden, logits_to_keep, back)), cache=cache, **extra
            )
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have the shape of input_ids "
                f"{tuple(input_ids.shape)}"
            )
        if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep:
            raise ValueError("labels need logits for every position; use logits_to_keep=0")
        if shift_labels:  # position t predicts token t+1; the last position has no target
            labels = F.pad(labels[:, 1:], (0, 1), value=-100)
            if seq_idx is not None:  # nor the last of each packed sample
                labels = labels.masked_fill(F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (0, 1)), -100)
        if attention_mask is not None:  # a padded position's output means nothing: no loss
            labels = labels.masked_fill(attention_mask == 0, -100)
        if chunk:
            logits = None
            loss = chunked_cross_entropy(hidden, self.lm_head, labels, chunk)
        else:
            logits = self.lm_head(hidden)
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
            )
            if back is not None:
                logits = _to_positions(logits, back)
        if aux is not None and self.config.router_aux_loss_coef:  # Jamba's / Switch's α · aux
            loss = loss + self.config.router_aux_loss_coef * aux
        return LMOutput(logits=logits, loss=loss, cache=cache, **extra)

    def _check_packed_prefill(self, cache: InferenceCache, seq_idx: torch.Tensor) -> int:
        """A packed prefill fills a fresh cache of one row per real sample of ``seq_idx``, in a
        model whose mixers keep per-sample states; returns the longest sample's length."""
        why = packed_prefill_refusal(self)
        if why is not None:
            raise ValueError(
                f"seq_idx with a cache (a packed prefill) needs per-sample states, and this model "
                f"cannot: {why}. Prefill a left-padded batch (attention_mask) instead"
            )
        if cache.seqlen_offset > 0:
            raise ValueError(
                "seq_idx with a cache is a packed prefill, which fills a fresh cache "
                f"(allocate_cache(n_samples)); this one already holds {cache.seqlen_offset} "
                "positions"
            )
        _, _, start, end = packed_samples(seq_idx)
        if not len(start):
            raise ValueError("seq_idx marks every position -1: a packed prefill needs a sample")
        rows = cache.batch_size
        if rows is not None and rows != len(start):
            raise ValueError(
                f"the cache has {rows} rows but seq_idx packs {len(start)} samples: a packed "
                "prefill needs allocate_cache(n_samples), one row per sample in row-major order"
            )
        return int((end - start).max())

    def save_pretrained(
        self,
        directory: str | os.PathLike,
        format: str | None = None,
        tokenizer_from: str | os.PathLike | None = None,
        state_dict: dict | None = None,
        overwrite: bool = False,
    ) -> Path:
        """Write this model as a checkpoint directory transformers ("hf": Mamba / Mamba2, "jamba",
        "zamba2") or mamba_ssm ("mamba_ssm") loads unchanged; ``format=None``: the model's natural
        format ("hf" for pure Mamba). Returns ``directory``.

        The files are written by :func:`ssmkit.hub.save_pretrained` (the formats, the tokenizer
        files copied along, the rule that a directory holding other files is refused unless
        ``overwrite=True``, which keeps them): the hub builds on models, so this module never
        imports it; the hub hands its writer to :func:`register_save_pretrained` when it is
        imported, as ``import ssmkit`` does."""
        if _save_pretrained is None:
            raise RuntimeError(
                "MambaLM.save_pretrained is written by ssmkit.hub, which is not "
                "imported: import ssmkit (or ssmkit.hub) first"
            )
        return _save_pretrained(
            self,
            directory,
            format=format,
            tokenizer_from=tokenizer_from,
            state_dict=state_dict,
            overwrite=overwrite,
        )

    def num_parameters(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Parameters, tied weights counted once. ``active``: those one token uses, so a mixture of
        experts counts its router and k of its E experts (Jamba's "active parameters")."""
        params = {id(p): p for p in self.parameters()}  # tied weights counted once
        if exclude_embeddings:
            params.pop(id(self.backbone.embedding.weight), None)
            params.pop(id(self.lm_head.weight), None)
        total = sum(p.numel() for p in params.values())
        if active:
            total -= sum(m.inactive_numel() for m in self.modules() if isinstance(m, SparseMoE))
        return total


def build_model(
    cfg: ModelConfig | str, device=None, dtype=None, seed: int | None = None
) -> MambaLM:
    """A freshly initialised :class:`MambaLM` from a config or a preset name. ``seed``: the weights
    drawn under ``torch.manual_seed(seed)`` (the same model on every call and every rank); None:
    from the global generator as it stands."""
    if isinstance(cfg, str):
        cfg = ModelConfig.preset(cfg)
    if seed is not None:
        torch.manual_seed(seed)
    model = MambaLM(cfg)
    return (
        model.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else model
    )
