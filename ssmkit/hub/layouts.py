"""The checkpoint layouts: the files a checkpoint holds, and its ``config.json`` read and written.

* transformers (``"hf"``): ``model_type`` "mamba", "falcon_mamba" or "mamba2", fields as in
  ``MambaConfig`` / ``FalconMambaConfig`` / ``Mamba2Config`` (:func:`config_from_hf`,
  :func:`config_to_hf`);
* mamba_ssm (``"mamba_ssm"``): ``MambaConfig`` of ``MambaLMHeadModel``, ``d_model``, ``n_layer``,
  ``ssm_cfg`` (``layer`` "Mamba1", "Mamba2" or "Mamba3", the last only in mamba_ssm's source tree
  after its 2.3.2.post1 release), and for hybrids ``attn_layer_idx`` / ``attn_cfg`` (MHA layers) and
  ``d_intermediate`` (a GatedMLP in every block) (:func:`config_from_mamba_ssm`,
  :func:`config_to_mamba_ssm`); ssmkit's own S4D and H3 models are written in this layout too, with
  ``ssm_cfg.layer`` "S4D" / "H3" (their group's fields beside it): no mamba_ssm release builds
  those layers, so such a checkpoint loads in ssmkit only;
* transformers' Jamba (``"jamba"``, :mod:`ssmkit.hub.jamba`) and Zamba2 (``"zamba2"``,
  :mod:`ssmkit.hub.zamba2`), each a module of its own with the config and the tensor names both
  ways.

Every field that cannot be represented is a :class:`CheckpointError` naming it as the file spells
it. Loading (:mod:`ssmkit.hub.load`) and saving (:mod:`ssmkit.hub.save`) build on this module.
"""

from __future__ import annotations

import dataclasses
import math

from ..models import ModelConfig
from ..models.config import SSM_MIXERS, ConfigError
from ..models.ssm_config import GROUPS

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
FORMATS = ("hf", "mamba_ssm", "jamba", "zamba2")
WEIGHT_FILES = {
    "hf": "model.safetensors",
    "mamba_ssm": "pytorch_model.bin",
    "jamba": "model.safetensors",
    "zamba2": "model.safetensors",
}
_WEIGHT_NAMES = tuple(dict.fromkeys(WEIGHT_FILES.values()))  # each file name once
OUR_FILES = ("config.json", *_WEIGHT_NAMES, *TOKENIZER_FILES)  # all save_pretrained ever writes
SHARD_INDEXES = tuple(f"{name}.index.json" for name in _WEIGHT_NAMES)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as an ssmkit model, with the reason."""


# --------------------------------------------------------------------------------------------
# configs: transformers / mamba_ssm <-> ModelConfig
# --------------------------------------------------------------------------------------------

# transformers field -> ModelConfig field, for both Mamba and Mamba2 configs: the model's, and its
# mixer group's (_HF_SSM for both mixers; _HF_MAMBA1 / _HF_MAMBA2 for one). A group's field is
# written as its path, "mamba2.d_state", by _hf_fields.
_HF_FIELDS = {
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layer",
    "vocab_size": "vocab_size",
    "layer_norm_epsilon": "norm_epsilon",
    "residual_in_fp32": "residual_in_fp32",
    "tie_word_embeddings": "tie_embeddings",
}
_HF_SSM = {
    "state_size": "d_state",
    "expand": "expand",
    "conv_kernel": "d_conv",
    "use_bias": "bias",
    "use_conv_bias": "conv_bias",
    "time_step_min": "dt_min",
    "time_step_max": "dt_max",
    "time_step_floor": "dt_init_floor",
}
_HF_MAMBA1 = {
    "time_step_rank": "dt_rank",
    "time_step_scale": "dt_scale",
    "time_step_init_scheme": "dt_init",
    "mixer_rms_eps": "mixer_rms_eps",
    "hidden_act": "activation",  # transformers' Mamba / FalconMamba: the conv's activation only
}
_HF_MAMBA2 = {
    "head_dim": "headdim",
    "n_groups": "ngroups",
    "chunk_size": "chunk_size",
    "time_step_limit": "dt_limit",
    "norm_before_gate": "norm_before_gate",
}


def _hf_fields(mixer: str) -> dict[str, str]:
    """transformers field -> ModelConfig field or group path ("mamba1.d_state"), Mamba / Mamba2."""
    group = {**_HF_SSM, **(_HF_MAMBA1 if mixer == "mamba1" else _HF_MAMBA2)}
    return {**_HF_FIELDS, **{theirs: f"{mixer}.{ours}" for theirs, ours in group.items()}}


def _nested(kwargs: dict) -> dict:
    """ModelConfig kwargs with group paths nested: ``{"mamba2.d_state": 8}`` ->
    ``{"mamba2": {"d_state": 8}}``."""
    out = {}
    for key, value in kwargs.items():
        group, dot, name = key.partition(".")
        if dot:
            out.setdefault(group, {})[name] = value
        else:
            out[key] = value
    return out


def _get(cfg: ModelConfig, path: str):
    """The value of a ModelConfig field or group path ("mamba2.d_state")."""
    for name in path.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _floats(values, field: str) -> tuple[float, ...]:
    """A JSON list of numbers as floats; transformers 5 writes infinity as {"__float__":
    "Infinity"}, mamba_ssm configs as "inf"."""
    try:
        return tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in values)
    except (TypeError, ValueError, KeyError):
        raise CheckpointError(
            f"field {field!r} must be a list of numbers; got {values!r}"
        ) from None


def _build_config(kwargs: dict, names: dict[str, str]) -> ModelConfig:
    """ModelConfig(**kwargs), group fields given as paths ("mamba2.d_state"); a bad value becomes a
    CheckpointError naming the field as the file spells it (``names``: ssmkit field or path ->
    config.json field)."""
    try:
        return ModelConfig(**_nested(kwargs))
    except ConfigError as exc:
        raise CheckpointError(f"field {names.get(exc.field, exc.field)!r}: {exc}") from None
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _json_float(v: float):
    return v if math.isfinite(v) else {"__float__": "Infinity" if v > 0 else "-Infinity"}


def config_from_hf(hf: dict) -> ModelConfig:
    """A transformers ``config.json`` (mamba / falcon_mamba / mamba2) as a ModelConfig; the
    vocabulary is kept exactly (transformers' vocab_size is already the padded embedding size)."""
    kind = hf.get("model_type")
    if kind not in ("mamba", "falcon_mamba", "mamba2"):
        raise CheckpointError(
            f"model_type {kind!r} is not supported; "
            "ssmkit loads 'mamba', 'falcon_mamba' and 'mamba2'"
        )
    if kind == "falcon_mamba":
        hf = {"mixer_rms_eps": 1e-6, **hf}  # transformers' FalconMambaConfig default
        kind = "mamba"
    else:
        hf = {k: v for k, v in hf.items() if k != "mixer_rms_eps"}
    if hf.get("rms_norm", True) is False:
        raise CheckpointError(
            "rms_norm=False (the gate inside the scan, no gated RMSNorm) is not supported"
        )
    if kind == "mamba2" and hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"hidden_act {hf['hidden_act']!r} is not supported for mamba2; ssmkit's Mamba-2 "
            "conv uses 'silu'"
        )
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in hf]
    if (
        missing
    ):  # ModelConfig's defaults are a 130M model: never guess the size of someone's checkpoint
        raise CheckpointError(
            f"fields {missing} are missing; a transformers config states the model's size"
        )
    mixer = "mamba1" if kind == "mamba" else "mamba2"
    fields = _hf_fields(mixer)
    nulls = [
        theirs
        for theirs in fields
        if theirs in hf and hf[theirs] is None and theirs != "mixer_rms_eps"
    ]
    if nulls:  # null would silently fall back to a default that may not match the weights
        raise CheckpointError(
            f"fields {nulls} are null; give them values or leave them out for the defaults"
        )
    kwargs = {ours: hf[theirs] for theirs, ours in fields.items() if theirs in hf}
    kwargs.update(mixer=mixer, pad_vocab_size_multiple=1)
    kwargs.setdefault("tie_embeddings", kind == "mamba")  # transformers' defaults differ per model
    if kwargs.get("mamba2.dt_limit") is not None:
        kwargs["mamba2.dt_limit"] = _floats(kwargs["mamba2.dt_limit"], "time_step_limit")
    cfg = _build_config(kwargs, {ours: theirs for theirs, ours in fields.items()})
    group = cfg.mixer_cfg(mixer)
    inner = group.d_inner(cfg.d_model)
    if kind == "mamba" and "intermediate_size" in hf and hf["intermediate_size"] != inner:
        raise CheckpointError(
            f"field 'intermediate_size' is {hf['intermediate_size']!r}, "
            f"but expand * hidden_size = {inner}; "
            "ssmkit needs d_inner = expand * d_model"
        )
    if kind == "mamba2" and "num_heads" in hf and hf["num_heads"] != group.nheads(cfg.d_model):
        raise CheckpointError(
            f"field 'num_heads' is {hf['num_heads']!r}, "
            f"but expand * hidden_size / head_dim = {group.nheads(cfg.d_model)}"
        )
    return cfg


def config_to_hf(cfg: ModelConfig) -> dict:
    """A ModelConfig as a transformers config dict (MambaConfig / Mamba2Config)."""
    if cfg.zamba2 is not None:
        raise CheckpointError("a Zamba2 model saves as format='zamba2' only")
    lti = [m for m in ("s4d", "h3") if m in cfg.mixers]
    if lti:
        raise CheckpointError(
            f"transformers has no {lti[0].upper()} model (mixer {lti[0]!r}); save "
            "format='mamba_ssm', ssmkit's own layout for it"
        )
    extras = [
        what
        for what, has in (
            ("attention layers (attn_layer_idx)", cfg.attn_layer_idx),
            ("MLPs (d_intermediate)", cfg.d_intermediate),
            ("Jamba's weighted Δ/B/C norms (mamba1.mixer_rms_weights)", _jamba_norms(cfg)),
        )
        if has
    ]
    if extras:
        raise CheckpointError(
            f"transformers' MambaConfig / Mamba2Config cannot hold {' or '.join(extras)}; "
            f"{_formats_for(cfg)}"
        )
    if cfg.layout is not None and len(set(cfg.layout)) > 1:
        raise CheckpointError(
            "transformers has no model with mixed Mamba-1 / Mamba-2 layers; save format='mamba_ssm'"
        )
    if "mamba3" in cfg.mixers:
        raise CheckpointError("transformers has no Mamba-3 model; save format='mamba_ssm'")
    mixer = cfg.mixers[0]
    group = cfg.mixer_cfg(mixer)
    hf = {theirs: _get(cfg, ours) for theirs, ours in _hf_fields(mixer).items()}
    hf["vocab_size"] = cfg.padded_vocab_size
    if mixer == "mamba1":
        falcon = group.mixer_rms_eps is not None
        hf.update(
            model_type="falcon_mamba" if falcon else "mamba",
            time_step_rank=group.dt_rank_value(cfg.d_model),
            architectures=["FalconMambaForCausalLM" if falcon else "MambaForCausalLM"],
            intermediate_size=group.d_inner(cfg.d_model),
        )
        if not falcon:
            del hf["mixer_rms_eps"]
    else:
        if group.D_has_hdim or group.norm_before_gate:  # transformers 5: norm after the gate
            raise CheckpointError(
                "transformers' Mamba2 has neither D per channel nor norm_before_gate=True; "
                "save format='mamba_ssm'"
            )
        hf.update(
            model_type="mamba2",
            architectures=["Mamba2ForCausalLM"],
            num_heads=group.nheads(cfg.d_model),
            hidden_act="silu",
            time_step_limit=[_json_float(v) for v in group.dt_limit],
            rms_norm=True,
        )
    return hf


def _jamba_norms(cfg: ModelConfig) -> bool:
    """Whether the model's Mamba-1 layers have Jamba's weighted norms on Δ, B, C."""
    return "mamba1" in cfg.ssm_kinds and cfg.mamba1.mixer_rms_weights


_LAYERS = {"Mamba1": "mamba1", "Mamba2": "mamba2", "Mamba3": "mamba3", "S4D": "s4d", "H3": "h3"}
# ssmkit's group fields that are no argument of mamba_ssm's class: FalconMamba's / Jamba's norms on
# Δ, B, C (refused on save). Mamba3's a_activation is written: mamba_ssm's Mamba3 absorbs unknown
# keys and applies the heavy-tail activation, the group's default.
# A conv activation other than SiLU (mamba1.activation) and an MLP activation other than SiLU
# (mlp_activation) are written as ssmkit's own keys, and only then: mamba_ssm's Mamba and
# MambaConfig refuse them by name (a TypeError), which is better than a silent SiLU there.
_NOT_SSM_CFG = ("mixer_rms_eps", "mixer_rms_weights", "activation")


def _ssm_fields(mixer: str) -> tuple[str, ...]:
    """The ssm_cfg keys of a mixer: its group's fields (mamba_ssm's arguments of that class)."""
    return tuple(f.name for f in dataclasses.fields(GROUPS[mixer]) if f.name not in _NOT_SSM_CFG)


def _formats_for(cfg: ModelConfig) -> str:
    """Which other format can hold a hybrid ``cfg``, as advice for an error message: Jamba's Δ/B/C
    norms (mixer_rms_weights) only format "jamba" holds (ssmkit.hub.jamba, which says why not if it
    cannot); everything else only mamba_ssm's layout."""
    if _jamba_norms(cfg):
        return "save format='jamba'"
    try:
        config_to_mamba_ssm(cfg)
        return "save format='mamba_ssm'"
    except CheckpointError as exc:
        return f"format='mamba_ssm' cannot hold it either ({exc})"


def _attention_from_mamba_ssm(c: dict) -> dict:
    """The hybrid fields of a mamba_ssm config as ModelConfig kwargs: attn_layer_idx, attn_cfg
    (mamba_ssm's MHA arguments, checked as mamba_ssm would build them), d_intermediate."""
    idx, attn = c.get("attn_layer_idx") or [], c.get("attn_cfg") or {}
    if not isinstance(idx, list):
        raise CheckpointError(
            f"field 'attn_layer_idx' must be a list of layer indices; got {idx!r}"
        )
    if not isinstance(attn, dict):
        raise CheckpointError(f"field 'attn_cfg' must be an object of MHA arguments; got {attn!r}")
    if "window_size" in attn:
        raise CheckpointError(
            "field 'attn_cfg.window_size' is not an argument of mamba_ssm's MHA (it is "
            "ssmkit's sliding window, which the mamba_ssm layout cannot hold)"
        )
    if idx:
        if attn.get("causal") is not True:
            got = "missing" if "causal" not in attn else repr(attn["causal"])
            raise CheckpointError(
                f"field 'attn_cfg.causal' is {got}: mamba_ssm's MHA then builds bidirectional "
                "attention layers (its default is causal=False), "
                "which see later tokens; ssmkit builds causal attention only"
            )
        if "num_heads" not in attn:
            raise CheckpointError(
                "field 'attn_cfg.num_heads' is missing; mamba_ssm's MHA requires it"
            )
    elif attn.get("causal") is not True:
        attn = {}  # no attention layer: mamba_ssm never reads it
    return dict(
        attn_layer_idx=idx, attn_cfg=attn or None, d_intermediate=c.get("d_intermediate", 0)
    )


def config_from_mamba_ssm(c: dict) -> ModelConfig:
    """mamba_ssm's MambaConfig dict as a ModelConfig."""
    missing = [k for k in ("d_model", "n_layer", "vocab_size") if k not in c]
    if missing:
        raise CheckpointError(
            f"fields {missing} are missing; a mamba_ssm config states the model's size"
        )
    if not isinstance(c.get("ssm_cfg") or {}, dict):
        raise CheckpointError(
            f"field 'ssm_cfg' must be an object of mixer fields; got {c['ssm_cfg']!r}"
        )
    ssm = dict(c.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    if layer not in _LAYERS:
        raise CheckpointError(
            f"ssm_cfg.layer {layer!r} is not supported; valid: {', '.join(_LAYERS)}"
        )
    mixer = _LAYERS[layer]
    known = set(_ssm_fields(mixer)) | ({"activation"} if mixer == "mamba1" else set())
    ignored = {"use_fast_path", "layer_idx", "rmsnorm", "sequence_parallel", "use_mem_eff_path"}
    if (
        mixer == "mamba3"
    ):  # a kernel fusion switch (the same sums) and an argument Mamba3 only absorbs
        ignored |= {"fuse_pregate_headwise_norm", "dropout"}
    unknown = sorted(set(ssm) - known - ignored)
    if unknown:
        raise CheckpointError(
            f"ssm_cfg fields {unknown} cannot be represented by ssmkit; known: {sorted(known)}"
        )
    if ssm.get("rmsnorm", True) is False:
        raise CheckpointError("ssm_cfg.rmsnorm=False (gate inside the scan) is not supported")
    group = {k: ssm[k] for k in known if k in ssm}
    for k in ("A_init_range", "dt_limit"):
        if k in group:
            group[k] = _floats(group[k], f"ssm_cfg.{k}")
    kwargs = {f"{mixer}.{k}": v for k, v in group.items()}
    kwargs.update(
        d_model=c["d_model"],
        n_layer=c["n_layer"],
        vocab_size=c["vocab_size"],
        mixer=mixer,
        pad_vocab_size_multiple=c.get("pad_vocab_size_multiple", 8),
        rms_norm=c.get("rms_norm", True),
        residual_in_fp32=c.get("residual_in_fp32", True),
        tie_embeddings=c.get("tie_embeddings", True),
        norm_epsilon=c.get("norm_epsilon", 1e-5),
        mlp_activation=c.get("mlp_activation", "silu"),
        **_attention_from_mamba_ssm(c),
    )
    return _build_config(kwargs, {f"{mixer}.{k}": f"ssm_cfg.{k}" for k in known})


def config_to_mamba_ssm(cfg: ModelConfig) -> dict:
    """A ModelConfig as mamba_ssm's MambaConfig dict; hybrids (attention layers, MLPs) included."""
    if cfg.zamba2 is not None:
        raise CheckpointError("a Zamba2 model saves as format='zamba2' only")
    ssm_kinds = sorted({m for m in cfg.mixers if m in SSM_MIXERS})
    if len(ssm_kinds) > 1:
        raise CheckpointError(
            "mamba_ssm's MambaLMHeadModel has one SSM layer type; mixed layouts cannot be saved"
        )
    if "swa" in cfg.mixers:
        raise CheckpointError(
            "attn_cfg.window_size (sliding-window attention, 'swa' layers) is not an "
            "argument of mamba_ssm's MHA: this model cannot be saved in the mamba_ssm "
            "layout"
        )
    if cfg.moe_layers:
        raise CheckpointError(
            f"num_experts={cfg.num_experts} (a mixture of experts on layers {cfg.moe_layers}): "
            "mamba_ssm's MambaLMHeadModel has none; save format='jamba'"
        )
    if "mamba1" in cfg.ssm_kinds and cfg.mamba1.mixer_rms_eps is not None:
        raise CheckpointError(
            "mamba_ssm has no norms on Δ, B, C (mamba1.mixer_rms_eps); save "
            + ("format='jamba'" if _jamba_norms(cfg) else "format='hf' (FalconMamba)")
        )
    if cfg.norm_epsilon != 1e-5 or not cfg.rms_norm:  # MambaLMHeadModel builds RMSNorm(eps=1e-5)
        raise CheckpointError(
            "mamba_ssm's MambaLMHeadModel always uses RMSNorm with eps 1e-5; save format='hf'"
        )
    mixer = ssm_kinds[0] if ssm_kinds else cfg.mixer if cfg.mixer in SSM_MIXERS else "mamba1"
    group = cfg.mixer_cfg(mixer).to_dict()
    ssm = {k: group[k] for k in _ssm_fields(mixer)}
    if group.get("activation", "silu") != "silu":  # ssmkit's key (see _NOT_SSM_CFG)
        ssm["activation"] = group["activation"]
    ssm["layer"] = {v: k for k, v in _LAYERS.items()}[mixer]
    if (
        "dt_limit" in ssm
    ):  # JSON has no infinity: the default (0, inf) is left to mamba_ssm's own default
        if ssm["dt_limit"] == [0.0, math.inf]:
            del ssm["dt_limit"]
        else:
            ssm["dt_limit"] = [v if math.isfinite(v) else "inf" for v in ssm["dt_limit"]]
    # every MHA argument written out, causal=True above all (mamba_ssm's default is False)
    attn = {k: v for k, v in (cfg.attn_cfg or {}).items() if k != "window_size"}
    ours = (
        {"mlp_activation": cfg.mlp_activation}
        if cfg.d_intermediate and cfg.mlp_activation != "silu"
        else {}
    )
    return dict(
        d_model=cfg.d_model,
        d_intermediate=cfg.d_intermediate,
        n_layer=cfg.n_layer,
        vocab_size=cfg.vocab_size,
        ssm_cfg=ssm,
        attn_layer_idx=list(cfg.attn_layer_idx),
        attn_cfg=attn,
        rms_norm=cfg.rms_norm,
        residual_in_fp32=cfg.residual_in_fp32,
        fused_add_norm=True,
        pad_vocab_size_multiple=cfg.pad_vocab_size_multiple,
        tie_embeddings=cfg.tie_embeddings,
        **ours,
    )  # exactly MambaConfig's fields (but ssmkit's keys above): it is built with **config
