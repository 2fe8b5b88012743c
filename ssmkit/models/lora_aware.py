"""Weights read raw, with a LoRA adapter on top: the one place that knows what peft's wrapper adds.

Most of ssmkit's projections are called as modules (``self.in_proj(x)``), so when peft replaces one
by its ``LoraLayer`` wrapper the adapter takes part by itself. A few weights are read raw instead,
because the op wants the tensor, not the module:

    Mamba-1      F.linear(dt, dt_proj.weight)       Δ before its bias (the bias goes into the scan)
                 dt_proj.bias                       the scan's delta_bias
    every conv   conv1d.weight (d, 1, w) -> (d, w)  the causal conv op (on cuda: the kernel)

A raw ``.weight`` of a peft wrapper is its BASE weight (peft's ``BaseTunerLayer.weight``): read that
way, the adapter would be silently bypassed and its parameters would get no gradient (the trap of
peft issue 2274 and state-spaces/mamba issue 279, where fused kernels read the projections'
weights). So those reads go through :func:`weight`, :func:`bias` and :func:`linear_no_bias` here,
which give what peft's own forward computes (LoRA, Hu et al. 2021, eq. 3):

    W_eff = W + Σ_a (α_a / r_a) · B_a A_a          over the active, unmerged adapters a
    b_eff = b + Σ_a (α_a / r_a) · bias(B_a)        only with peft's ``lora_bias=True``

DoRA (Liu et al. 2024, eq. 5 and section 4.3; peft's ``use_dora``) splits the adapted weight into a
magnitude m (out,), peft's ``lora_magnitude_vector``, and a direction, normalised per output row:

    W_eff = m / ‖W_0 + ΔW‖_row · (W + ΔW)            ΔW = (α/r) · B A

‖·‖_row is the L2 norm over the input dim of each output row, of the base weight W_0 plus the
update, and it is DETACHED (a constant to autograd, as the paper's section 4.3 and peft do): m gets
its gradient through the scale, A and B through W + ΔW only. Applied adapter by adapter, each to
the running weight W (so several adapters compose as peft's forward composes them); the bias is not
scaled. With live dropout peft scales the dropped input's base projection instead, which
:func:`linear_no_bias` computes as peft does.

Duck-typed on peft's ``LoraLayer`` (``base_layer``, ``get_delta_weight``, ``active_adapters``,
``merged``, ``disable_adapters``, ``lora_dropout``, ``scaling``): peft is never imported here. A
merged adapter is already inside W; disabled adapters add nothing (a merged one is first unmerged,
as peft's forward does).

What cannot be a weight is computed otherwise or refused, never dropped silently:

* LoRA dropout (p > 0, training mode) drops the adapter's INPUT, which no fixed weight expresses.
  For a linear layer :func:`linear_no_bias` then computes the adapter on the input, as peft does:
  x W^T + Σ_a (α_a / r_a) · B_a A_a dropout(x). For a conv the op (kernel) takes a weight:
  ValueError.
* peft's conv LoRA on a depthwise conv (``groups > 1``, every conv here) is a full channel-mixing
  conv, not a depthwise one: no (d, w) weight holds it, so ValueError (peft cannot merge it either).
* other LoRA variants (peft's ``lora_variant`` but DoRA) are not W + ΔW: ValueError naming the
  layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def is_lora_layer(module: nn.Module) -> bool:
    """True for a peft LoRA wrapper (duck-typed: a ``base_layer`` and ``get_delta_weight``)."""
    return hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")


def _active(module: nn.Module) -> list[str]:
    """The adapters of a LoRA wrapper that add to its output now: active, present on this layer, not
    merged into the base weight, adapters not disabled."""
    if module.disable_adapters:
        if module.merged:  # peft's forward unmerges in this case too
            module.unmerge()
        return []
    if module.merged:
        return []
    present = set(getattr(module, "lora_A", {}).keys()) | set(
        getattr(module, "lora_embedding_A", {}).keys()
    )
    names = [a for a in module.active_adapters if a in present]
    variants = [
        a for a in names if a in getattr(module, "lora_variant", {}) and not is_dora(module, a)
    ]
    if variants:
        kinds = sorted({type(module.lora_variant[a]).__name__ for a in variants})
        raise ValueError(
            f"{type(module).__name__} has the LoRA variant adapter(s) {variants} ({kinds}), "
            "which is neither W + (alpha/r) B A nor DoRA; ssmkit reads this layer's weight raw "
            "(for a kernel), so only plain LoRA and DoRA work here"
        )
    return names


def is_dora(module: nn.Module, adapter: str) -> bool:
    """True when ``adapter`` on the LoRA wrapper ``module`` is a DoRA adapter (it has a magnitude
    vector)."""
    mags = getattr(module, "lora_magnitude_vector", None)
    return mags is not None and adapter in mags


def dora_scale(module: nn.Module, adapter: str, delta: torch.Tensor) -> torch.Tensor:
    """DoRA's m / ‖W_0 + ΔW‖_row for ``adapter`` (out,), the norm detached (module docstring).
    delta: ΔW = (α/r) B A, in the base weight's shape (out, in)."""
    w0 = module.get_base_layer().weight
    norm = torch.linalg.norm((w0 + delta.to(w0.dtype)).detach(), dim=1)
    magnitude = module.lora_magnitude_vector[adapter].weight
    return magnitude / norm.to(magnitude.dtype)


def _dropping(module: nn.Module, adapter: str) -> bool:
    """True when the adapter's dropout is live: an nn.Dropout with p > 0, in training mode."""
    drop = module.lora_dropout[adapter]
    return drop.training and getattr(drop, "p", 0.0) > 0


def weight(module: nn.Module, what: str = "layer") -> torch.Tensor:
    """The effective weight of ``module`` (a Linear or Conv1d, or peft's wrapper of one), in the
    base weight's shape and dtype: W + Σ_a scaling_a · ΔW_a, or DoRA's form (see the module
    docstring). ``what`` names the layer in errors. Live dropout or a depthwise conv adapter is a
    ValueError."""
    if not is_lora_layer(module):
        return module.weight
    w = weight(module.base_layer, what)  # a wrapper of a wrapper: the inner one's effective W
    adapters = _active(module)
    groups = getattr(module.get_base_layer(), "groups", 1)
    if adapters and groups > 1:
        raise ValueError(
            f"LoRA on {what} ({type(module.get_base_layer()).__name__} with groups={groups}, "
            "depthwise) cannot work: peft's conv adapter mixes channels, so no depthwise weight "
            "holds W + (alpha/r) B A and the conv op cannot receive it. Remove 'conv1d' from "
            "target_modules, or train the conv itself with modules_to_save=['conv1d']"
        )
    for a in adapters:
        if _dropping(module, a):
            raise ValueError(
                f"LoRA dropout p={module.lora_dropout[a].p} on {what}, whose weight goes to an "
                "op as a tensor: dropout of the adapter's input is no weight. Set "
                "lora_dropout=0 for this target, or call model.eval()"
            )
    return _updated(module, w, adapters, what)


def _updated(module: nn.Module, w: torch.Tensor, adapters: list[str], what: str) -> torch.Tensor:
    """``w`` with each adapter's update applied in turn: + ΔW_a, or DoRA's rescaled W + ΔW_a."""
    for a in adapters:
        delta = module.get_delta_weight(a).to(w.dtype)
        if is_dora(module, a):
            if w.dim() != 2:
                raise ValueError(f"DoRA on {what}: ssmkit computes it for Linear layers only")
            w = dora_scale(module, a, delta).to(w.dtype)[:, None] * (w + delta)
        else:
            w = w + delta
    return w


def merged_parameters(
    module: nn.Module, adapters: list[str]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) that merging ``adapters`` of the LoRA wrapper ``module`` writes into its base
    layer (peft's ``merge``; dropout plays no part in a merge): W_0 updated by each adapter in turn
    (LoRA or DoRA), b_0 plus the adapters' ``lora_bias`` terms. The module must hold no merged
    adapter (W_0 is then the pretrained weight)."""
    if module.merged:
        raise ValueError(
            f"{type(module).__name__} already has merged adapters {module.merged_adapters}; "
            "unmerge them first (unmerge_adapter())"
        )
    base = module.get_base_layer()
    b = base.bias
    for a in adapters:
        if getattr(module, "lora_bias", {}).get(a, False):
            extra = module.lora_B[a].bias * module.scaling[a]
            b = extra if b is None else b + extra.to(b.dtype)
    return _updated(module, base.weight, adapters, "layer"), b


def bias(module: nn.Module) -> torch.Tensor | None:
    """The effective bias of ``module`` (None when it has none): b + Σ_a scaling_a · bias(B_a) for
    adapters made with peft's ``lora_bias=True``, else b."""
    if not is_lora_layer(module):
        return module.bias
    b = bias(module.base_layer)
    for a in _active(module):
        if getattr(module, "lora_bias", {}).get(a, False):
            extra = module.lora_B[a].bias * module.scaling[a]
            b = extra if b is None else b + extra.to(b.dtype)
    return b


def linear_no_bias(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """x W_eff^T for a Linear (or peft's wrapper of one) whose bias is applied elsewhere (Mamba-1's
    Δ: the scan adds dt_proj's bias). x: (..., in_features) -> (..., out_features).

    With live LoRA dropout the adapter is computed on the input, as peft's forward does:
    x W^T + Σ_a scaling_a · B_a(A_a(dropout(x))) (B_a's own bias, with lora_bias, left to
    :func:`bias`); a DoRA adapter adds (s_a - 1) · x_d W_0^T + s_a · scaling_a · B_a(A_a(x_d)),
    x_d = dropout(x), s_a its :func:`dora_scale`."""
    if not is_lora_layer(module):
        return F.linear(x, module.weight)
    adapters = _active(module)
    if not any(_dropping(module, a) for a in adapters):
        return F.linear(x, weight(module, "linear layer"))
    out = linear_no_bias(x, module.base_layer)
    for a in adapters:
        A, B = module.lora_A[a], module.lora_B[a]
        h = module.lora_dropout[a](x.to(A.weight.dtype))
        lora = F.linear(A(h), B.weight) * module.scaling[a]
        if is_dora(module, a):
            scale = dora_scale(module, a, module.get_delta_weight(a)).to(h.dtype)
            base = F.linear(h, module.get_base_layer().weight.to(h.dtype))
            lora = (scale - 1) * base + scale * lora
        out = out + lora.to(out.dtype)
    return out
