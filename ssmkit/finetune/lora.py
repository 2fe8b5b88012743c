"""LoRA on ssmkit models with peft: the plan's defaults, targets checked, merged export.

    model = ssmkit.from_pretrained("runs/prototype/checkpoints/step_00000200/model")
    lora = apply_lora(model)      # the plan: r=16, alpha=32, dropout 0.05, targets x_proj,
                                  # in_proj, out_proj (those the model has)
    print(trainable_share(lora))  # {"trainable": ..., "total": ..., "share": 0.0123}
    ...train lora (only its adapter parameters require grad)...
    export_merged(lora, "merged/", format="hf")    # merge_and_unload() + save_pretrained

LoRA (Hu et al. 2021): a frozen weight W (out, in) gets a trainable low-rank update, y = x W^T +
(α/r) · dropout(x) A^T B^T with A (r, in) random and B (out, r) zero at the start, so training
begins at the pretrained model. ``apply_lora`` is ``peft.get_peft_model`` with ssmkit's checks:

* every name in ``target_modules`` must match a module (peft's rule: the full name, or its last
  part(s) after a dot); a name that matches nothing is a ValueError listing the names the model has.
  With the default (None) the plan's three names are kept where the model has them (Mamba-2/3 have
  no x_proj).
* every name in ``modules_to_save`` must match a module the same way (peft accepts one that
  matches nothing and trains nothing extra); a ready ``LoraConfig`` (``config=``, what
  :func:`~ssmkit.finetune.load_adapter` builds from adapter_config.json) gets :func:`lora_config`'s
  checks of r, lora_alpha and lora_dropout (:func:`check_values`).
* only ``nn.Linear`` and ``nn.Embedding`` layers are targets: the depthwise ``conv1d`` cannot hold a
  LoRA update (peft's conv adapter mixes channels; see :mod:`ssmkit.models.lora_aware`), norms are
  no matrices. Either is a ValueError with what to do instead (``modules_to_save``).
* ssmkit reads a few weights raw (Mamba-1's dt_proj, the convs) and routes them through
  :mod:`ssmkit.models.lora_aware`, so every target trains on every backend, the cuda kernels
  included.
* DoRA (Liu et al. 2024; ``use_dora=True``, peft's implementation and format: a magnitude vector
  ``lora_magnitude_vector`` per adapted layer beside A and B): the adapted weight is
  m / ‖W + ΔW‖_row · (W + ΔW), the row norm detached. peft applies it to the Linear and Embedding
  layers ssmkit calls as modules; the raw reads (Mamba-1's dt_proj) compute the same in
  :mod:`ssmkit.models.lora_aware`. A conv target is refused as for LoRA (the depthwise conv holds no
  B A); peft itself refuses DoRA with ``lora_bias``.
* tied embeddings (``lm_head.weight`` is ``backbone.embedding.weight``): an adapter on the embedding
  or the head changes one side only (peft's wrapper sits on one module), but merging it writes into
  the one shared matrix, which would change the other side too: merged != unmerged. So when
  ``embedding`` or ``lm_head`` is a target of a tied model, the head gets its own (frozen) copy of
  the matrix first and the model's config says ``tie_embeddings=False``. This is what peft's
  unmerged forward computes on transformers' tied models as well, so adapters stay interchangeable
  (see :mod:`.adapters`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from ..models import MambaLM, lora_aware

DEFAULT_TARGETS = ("x_proj", "in_proj", "out_proj")  # the plan's LoraConfig target_modules
DEFAULTS = dict(r=16, alpha=32, dropout=0.05)  # the plan's r, lora_alpha, lora_dropout
LORA_TYPES = (nn.Linear, nn.Embedding)


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA needs peft: pip install 'peft>=0.16'") from None
    return peft


def _base(model: nn.Module) -> nn.Module:
    """The ssmkit model inside a peft model (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def matches(name: str, target: str) -> bool:
    """peft's rule for a string in target_modules: the module's full name, or its tail after a
    dot."""
    return name == target or name.endswith("." + target)


def _leaf_names(model: nn.Module) -> list[str]:
    """The short names of the model's Linear and Embedding layers, the valid targets."""
    return sorted(
        {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, LORA_TYPES)}
    )


def resolve_targets(model: nn.Module, target_modules=None) -> list[str]:
    """The target names for ``model``: each must match at least one module and only Linear or
    Embedding layers. None: the plan's :data:`DEFAULT_TARGETS` that the model has; "all-linear":
    every Linear layer's name but lm_head's (peft's shorthand). A string is one name (peft would
    read it as a regular expression). Returns the names in order, each once."""
    if target_modules == "all-linear" or target_modules == ["all-linear"]:  # peft's shorthand
        target_modules = [
            n
            for n in _leaf_names(model)
            if n != "lm_head"
            and not any(
                isinstance(m, nn.Embedding) for k, m in model.named_modules() if matches(k, n)
            )
        ]
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    named = [(n, m) for n, m in model.named_modules() if n]
    valid = ", ".join(_leaf_names(model))
    if target_modules is None:
        chosen = [t for t in DEFAULT_TARGETS if any(matches(n, t) for n, _ in named)]
        if not chosen:
            raise ValueError(
                f"the model has none of the default LoRA targets {list(DEFAULT_TARGETS)}; pass "
                f"target_modules from: {valid}"
            )
        return chosen
    if (
        not isinstance(target_modules, (list, tuple))
        or not target_modules
        or not all(isinstance(t, str) and t for t in target_modules)
    ):
        raise ValueError(
            f"target_modules must be a non-empty list of module names; got {target_modules!r}. "
            f"Valid names for this model: {valid}"
        )
    for t in target_modules:
        hit = [(n, m) for n, m in named if matches(n, t)]
        if not hit:
            raise ValueError(
                f"LoRA target {t!r} matches no module of this model; valid targets: {valid}"
            )
        bad = sorted({type(m).__name__ for _, m in hit if not isinstance(m, LORA_TYPES)})
        if any(isinstance(m, nn.Conv1d) for _, m in hit):
            raise ValueError(
                f"LoRA target {t!r} is the depthwise causal conv (groups = channels): a LoRA "
                "update B A mixes channels, so no depthwise weight holds it and the conv op "
                "cannot receive it (peft cannot merge it either). Leave it out, or train the "
                "conv fully with "
                f"modules_to_save=[{t!r}] (d_inner x d_conv parameters per layer)"
            )
        if bad:
            raise ValueError(
                f"LoRA target {t!r} matches {bad} modules; LoRA adapts Linear and Embedding "
                f"layers (valid targets: {valid}). Train other modules fully with "
                "modules_to_save"
            )
    return list(dict.fromkeys(target_modules))


def _did_you_mean(name: str, valid: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, valid, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def resolve_modules_to_save(model: nn.Module, modules_to_save) -> list[str] | None:
    """``modules_to_save`` checked against ``model``: None, or a list of names each matching a
    module by :func:`matches` (peft would accept a name matching nothing and train nothing extra).
    Returns the names in order, each once."""
    if modules_to_save is None:
        return None
    if isinstance(modules_to_save, str):
        modules_to_save = [modules_to_save]
    named = [n for n, _ in model.named_modules() if n]
    valid = sorted({n.rpartition(".")[2] for n in named} - {""})
    valid = [n for n in valid if not n.isdigit()]
    if not isinstance(modules_to_save, (list, tuple)) or not all(
        isinstance(t, str) and t for t in modules_to_save
    ):
        raise ValueError(
            f"modules_to_save must be a list of module names; got {modules_to_save!r}. "
            f"Valid names for this model: {', '.join(valid)}"
        )
    for t in modules_to_save:
        if not any(matches(n, t) for n in named):
            raise ValueError(
                f"modules_to_save entry {t!r} matches no module of this model, so nothing "
                f"would train; {_did_you_mean(t, valid)}valid names: {', '.join(valid)}"
            )
    return list(dict.fromkeys(modules_to_save))


def check_values(r, alpha, dropout, rank_pattern=None, alpha_pattern=None, where: str = ""):
    """The LoRA numbers a config carries, checked as :func:`lora_config` checks its arguments (also
    for a ready ``LoraConfig`` and an adapter_config.json a user edited): r an integer >= 1,
    lora_alpha a number > 0, lora_dropout in [0, 1), the patterns' values likewise. ``where``: a
    prefix for the message (the file)."""
    from .. import checks

    pre = f"{where}: " if where else ""
    try:
        checks.integer(r, "r (LoRA rank)", minimum=1)
        checks.number(alpha, "lora_alpha", low=0, low_open=True)
        if not (checks.is_number(dropout) and 0 <= dropout < 1):
            raise ValueError(f"lora_dropout must be a number in [0, 1); got {dropout!r}")
        for field, pattern, check in (
            ("rank_pattern", rank_pattern, lambda v, n: checks.integer(v, n, minimum=1)),
            ("alpha_pattern", alpha_pattern, lambda v, n: checks.number(v, n, 0, low_open=True)),
        ):
            if pattern is None:
                continue
            if not isinstance(pattern, dict):
                raise ValueError(
                    f"{field} must be a mapping of module names to values; got {pattern!r}"
                )
            for key, value in pattern.items():
                check(value, f"{field}[{key!r}]")
    except ValueError as exc:
        raise ValueError(f"{pre}{exc}") from None


def check_config_values(config, where: str = "") -> None:
    """:func:`check_values` on a ready ``LoraConfig`` (its rank and alpha patterns too)."""
    check_values(
        config.r,
        config.lora_alpha,
        config.lora_dropout,
        getattr(config, "rank_pattern", None) or None,
        getattr(config, "alpha_pattern", None) or None,
        where=where,
    )


def _untie_if_touched(model: MambaLM, targets: list[str]):
    """Give lm_head its own copy of a tied embedding matrix when either side gets an adapter (see
    the module docstring); the copy keeps the embedding's requires_grad."""
    if not model.config.tie_embeddings:
        return
    names = {
        n for n, m in model.named_modules() if m is model.backbone.embedding or m is model.lm_head
    }
    if any(matches(n, t) for n in names for t in targets):
        shared = model.backbone.embedding.weight
        model.lm_head.weight = nn.Parameter(
            shared.detach().clone(), requires_grad=shared.requires_grad
        )
        model.config = dataclasses.replace(model.config, tie_embeddings=False)


def lora_config(
    r: int = DEFAULTS["r"],
    alpha: float = DEFAULTS["alpha"],
    dropout: float = DEFAULTS["dropout"],
    target_modules=None,
    modules_to_save=None,
    init_lora_weights=True,
    **extra,
):
    """A ``peft.LoraConfig`` with ssmkit's defaults (the plan's); ``target_modules`` is resolved
    against a model by :func:`apply_lora`. ``extra``: more LoraConfig fields (``use_rslora``,
    ``rank_pattern``, ``use_dora``...)."""
    from .. import checks

    r = checks.integer(r, "r (LoRA rank)", minimum=1)
    alpha = checks.number(alpha, "alpha (lora_alpha)", low=0, low_open=True)
    dropout = checks.number(dropout, "dropout (lora_dropout)", low=0, high=1)
    if dropout >= 1:
        raise ValueError(f"dropout (lora_dropout) must be in [0, 1); got {dropout}")
    if not isinstance(extra.get("use_dora", False), bool):
        raise ValueError(f"use_dora must be true or false; got {extra['use_dora']!r}")
    if isinstance(target_modules, str):
        target_modules = [target_modules]  # one name (peft would read a str as a regex)
    return _peft().LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=None if target_modules is None else list(target_modules),
        modules_to_save=modules_to_save,
        init_lora_weights=init_lora_weights,
        **extra,
    )


def apply_lora(
    model: MambaLM,
    r: int = DEFAULTS["r"],
    alpha: float = DEFAULTS["alpha"],
    dropout: float = DEFAULTS["dropout"],
    target_modules=None,
    *,
    modules_to_save=None,
    init_lora_weights=True,
    adapter_name: str = "default",
    config=None,
    **extra,
):
    """``peft.get_peft_model`` on an ssmkit model, checked (see the module docstring). Returns the
    ``PeftModel``: the base weights frozen, only the adapters (and ``modules_to_save``) trainable;
    call it as the model (``out = lora(input_ids, labels=...)``). ``config``: a ready
    ``peft.LoraConfig`` instead of r/alpha/dropout/target_modules (its targets are checked the same
    way). ``init_lora_weights=False``: B random too (tests; an adapter that changes the model from
    the start)."""
    if hasattr(model, "peft_config") or any(lora_aware.is_lora_layer(m) for m in model.modules()):
        raise ValueError(
            "the model already has LoRA adapters (it was given to apply_lora before); "
            "start from the base model, or use its add_adapter"
        )
    if not isinstance(model, MambaLM):
        raise ValueError(
            f"apply_lora takes an ssmkit model (MambaLM); got {type(model).__name__}. For "
            "transformers' models call peft.get_peft_model directly (peft refuses out_proj and "
            "conv1d targets on them)"
        )
    if config is None:
        config = lora_config(
            r, alpha, dropout, target_modules, modules_to_save, init_lora_weights, **extra
        )
    else:  # a ready LoraConfig: the numbers lora_config would have checked
        check_config_values(config)
    targets = config.target_modules
    targets = (
        [targets] if isinstance(targets, str) else None if targets is None else sorted(targets)
    )
    config.target_modules = resolve_targets(model, targets)
    config.modules_to_save = resolve_modules_to_save(model, config.modules_to_save)
    _untie_if_touched(model, config.target_modules)
    if getattr(model, "name_or_path", None) and not config.base_model_name_or_path:
        config.base_model_name_or_path = str(model.name_or_path)
    return _peft().get_peft_model(model, config, adapter_name=adapter_name)


def parameter_counts(model: nn.Module) -> dict:
    """Trainable and total parameters (tied ones once): ``{"trainable", "total", "share"}``."""
    params = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    return {"trainable": trainable, "total": total, "share": trainable / max(total, 1)}


def trainable_share(model: nn.Module) -> dict:
    """What a LoRA model trains: :func:`parameter_counts` plus the adapter's tensors by kind."""
    counts = parameter_counts(model)
    kinds: dict[str, int] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            kind = next(
                (
                    k
                    for k in (
                        "lora_embedding",
                        "lora_A",
                        "lora_B",
                        "lora_magnitude_vector",
                        "modules_to_save",
                    )
                    if k in name
                ),
                "other",
            )
            kinds[kind] = kinds.get(kind, 0) + p.numel()
    return {**counts, "by_kind": kinds}


def merge(model: nn.Module) -> MambaLM:
    """The plain ssmkit model with every active adapter merged into its weights (peft's
    ``merge_and_unload``: W <- W + (α/r) B A, or DoRA's m / ‖W + ΔW‖_row · (W + ΔW); the wrappers
    removed). Works in place: ``model`` is
    the base model afterwards."""
    if not hasattr(model, "merge_and_unload"):
        return model
    merged = model.merge_and_unload()
    if not isinstance(merged, MambaLM):
        raise ValueError(f"merging gave a {type(merged).__name__}, not an ssmkit model")
    return merged


def export_merged(
    model: nn.Module,
    directory: str | os.PathLike,
    format: str | None = None,
    dtype: torch.dtype | None = None,
    **save_kwargs,
) -> Path:
    """Merge the adapters (:func:`merge`, in place) and write the result with
    :func:`ssmkit.hub.save_pretrained` (``format``: "hf" for transformers' Mamba/Mamba2,
    "mamba_ssm", ...; None: the model's natural format). ``dtype``: cast before saving (e.g.
    torch.bfloat16). This is the way to transformers for adapters on out_proj, which peft refuses on
    transformers' Mamba models."""
    from ..hub import save_pretrained

    merged = merge(model)
    if dtype is not None:
        merged = merged.to(dtype)
    return save_pretrained(merged, directory, format=format, **save_kwargs)
