"""transformers' Zamba2 checkpoints (``model_type`` "zamba2", ``Zamba2ForCausalLM``) <-> ssmkit.

Pure functions: the config both ways (:func:`config_from_zamba2`, :func:`config_to_zamba2`) and the
tensor names both ways (:func:`state_from_zamba2`, :func:`state_to_zamba2`). What transformers 5
does that a conversion has to mirror:

* Every hybrid layer L of ``Zamba2ForCausalLM`` holds a full ``shared_transformer`` module; the
  copies that use one block are tied (one set of parameters) ONLY when ``tie_word_embeddings`` is
  true (transformers ties its ``_tied_weights_keys`` only then), and ``save_pretrained`` then writes
  the block once, at the first hybrid layer using it. With ``tie_word_embeddings`` false every
  hybrid layer's block is its own: ssmkit reads that as ``num_mem_blocks`` = the number of hybrid
  layers.
* The adapters live inside the shared module, in lists indexed by hybrid invocation k
  (``linear_q_adapter_list.{k}``, ``gate_up_proj_adapter_list.{k}``; an Identity for the k of other
  blocks); ssmkit keeps invocation k's adapters on its layer (``backbone.layers.{i}.adapters``).
* The MLP adapters always exist (the config has no switch for them), the Mamba conv always has a
  bias, ``add_bias_linear`` gives biases to Mamba's in/out_proj and the MLP alike, Δ is clamped at
  ``time_step_min``. Where ssmkit's model lacks such a weight, a zero one is written (same
  function).
"""

from __future__ import annotations

import math
import re

import torch

from ..models import MambaLM, ModelConfig
from ..models.config import ConfigError
from ..models.zamba2_config import ACTIVATIONS, Zamba2ConfigError
from .layouts import CheckpointError, _nested

# transformers' default layers_block_type (Zamba2-2.7B's 54 layers)
DEFAULT_BLOCK_TYPES = (
    ["mamba"]
    + (["mamba"] * 5 + ["hybrid"]) * 7
    + ["mamba"] * 4
    + ["hybrid"]
    + ["mamba"] * 3
    + ["hybrid"]
    + ["mamba"] * 2
)
# config.json field -> ModelConfig field, or the path of a field of its Mamba-2 group
_FIELDS = {
    "hidden_size": "d_model",
    "vocab_size": "vocab_size",
    "mamba_d_state": "mamba2.d_state",
    "mamba_d_conv": "mamba2.d_conv",
    "mamba_expand": "mamba2.expand",
    "mamba_ngroups": "mamba2.ngroups",
    "chunk_size": "mamba2.chunk_size",
    "time_step_min": "mamba2.dt_min",
    "time_step_max": "mamba2.dt_max",
    "time_step_floor": "mamba2.dt_init_floor",
    "rms_norm_eps": "norm_epsilon",
    "initializer_range": "initializer_range",
    "tie_word_embeddings": "tie_embeddings",
    "add_bias_linear": "mamba2.bias",
}
# config.json fields that are zamba2 fields of the same name; _Z_NAMES: the others, zamba2 ->
# config.json
_Z_FIELDS = (
    "num_mem_blocks",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "hidden_act",
    "add_bias_linear",
    "adapter_rank",
    "use_shared_attention_adapter",
    "use_mem_rope",
)
_Z_NAMES = {"hybrid_layer_ids": "layers_block_type", "rope_theta": "rope_parameters.rope_theta"}
_UNKNOWN = ""  # _to_ours of a name transformers' Zamba2 does not have


def _build(kwargs: dict) -> ModelConfig:
    names = {ours: theirs for theirs, ours in _FIELDS.items()}
    names.update(
        {
            "mamba2.headdim": "n_mamba_heads",
            "n_layer": "num_hidden_layers",
            "mamba2.dt_limit": "time_step_min",
        }
    )
    try:
        return ModelConfig(**_nested(kwargs))
    except (ConfigError, Zamba2ConfigError) as exc:
        if exc.field.startswith("zamba2."):
            field = exc.field.removeprefix("zamba2.")
            theirs = _Z_NAMES.get(field, field)
        else:
            theirs = names.get(exc.field, exc.field)
        raise CheckpointError(f"field {theirs!r}: {exc}") from None
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def config_from_zamba2(hf: dict) -> ModelConfig:
    """A transformers Zamba2 ``config.json`` dict as a ModelConfig (``zamba2`` set); a field ssmkit
    cannot represent is a CheckpointError naming it."""
    if hf.get("model_type") != "zamba2":
        raise CheckpointError(f"model_type {hf.get('model_type')!r} is not 'zamba2'")
    missing = [k for k in ("hidden_size", "vocab_size") if hf.get(k) is None]
    if missing:
        raise CheckpointError(
            f"fields {missing} are missing; a Zamba2 config states the model's size"
        )
    types = hf.get("layers_block_type")
    types = list(DEFAULT_BLOCK_TYPES if types is None else types)
    bad = sorted({t for t in types if t not in ("mamba", "linear_attention", "hybrid")}, key=str)
    if bad:
        raise CheckpointError(
            f"field 'layers_block_type' has layer types {bad}; valid: 'mamba' (or "
            "'linear_attention') and 'hybrid'"
        )
    n_layer = hf.get("num_hidden_layers", len(types))
    if n_layer != len(types):
        raise CheckpointError(
            f"field 'layers_block_type' has {len(types)} entries but num_hidden_layers is "
            f"{n_layer!r}"
        )
    hidden, expand, heads = hf["hidden_size"], hf.get("mamba_expand", 2), hf.get("n_mamba_heads", 8)
    if (
        not all(isinstance(v, int) and v > 0 for v in (hidden, expand, heads))
        or (expand * hidden) % heads
    ):
        raise CheckpointError(
            f"field 'n_mamba_heads' ({heads!r}) must divide mamba_expand * hidden_size "
            f"({expand!r} * {hidden!r})"
        )
    rope = hf.get("rope_parameters") or {}
    if hf.get("use_mem_rope") and (
        rope.get("rope_type", "default") != "default" or hf.get("rope_scaling")
    ):
        raise CheckpointError(
            f"field 'rope_parameters': rope_type {rope.get('rope_type')!r} is not "
            "supported; ssmkit's Zamba2 has the 'default' RoPE only"
        )
    if hf.get("attention_dropout", 0.0):
        raise CheckpointError(
            f"field 'attention_dropout' is {hf['attention_dropout']!r}; ssmkit's shared "
            "attention has no dropout (0.0)"
        )
    if hf.get("hidden_act", "gelu") not in ACTIVATIONS:
        raise CheckpointError(
            f"field 'hidden_act' {hf['hidden_act']!r} is not supported; "
            f"valid: {', '.join(ACTIVATIONS)}"
        )
    nulls = [
        k
        for k in list(_FIELDS) + ["num_mem_blocks", "adapter_rank", "num_attention_heads"]
        if k in hf and hf[k] is None
    ]
    if nulls:
        raise CheckpointError(
            f"fields {nulls} are null; give them values or leave them out for the defaults"
        )
    kwargs = {ours: hf[theirs] for theirs, ours in _FIELDS.items() if theirs in hf}
    kwargs.setdefault("tie_embeddings", True)  # transformers' default
    z = {k: hf[k] for k in _Z_FIELDS if hf.get(k) is not None}
    hybrid = [i for i, t in enumerate(types) if t == "hybrid"]
    z.update(
        hybrid_layer_ids=hybrid,
        use_shared_mlp_adapter=True,
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
    )
    if not kwargs["tie_embeddings"]:  # transformers then leaves every hybrid layer's block untied
        z["num_mem_blocks"] = max(1, len(hybrid))
    dt_min = kwargs.get("mamba2.dt_min", 0.001)
    kwargs.update(
        {
            "mamba2.headdim": expand * hidden // heads,
            "mamba2.conv_bias": True,
            "mamba2.dt_limit": (dt_min, math.inf),
        }
    )
    kwargs.update(
        n_layer=n_layer, mixer="mamba2", pad_vocab_size_multiple=1, residual_in_fp32=False, zamba2=z
    )
    cfg = _build(kwargs)
    zz = cfg.zamba2
    if (
        zz["use_shared_attention_adapter"]
        and zz["num_key_value_heads"] != zz["num_attention_heads"]
    ):
        raise CheckpointError(
            "field 'num_key_value_heads': transformers' Zamba2 cannot combine GQA with "
            "use_shared_attention_adapter (its k/v adapters are 2 * hidden_size wide)"
        )
    return cfg


def config_to_zamba2(cfg: ModelConfig) -> dict:
    """A ModelConfig with ``zamba2`` as a config.json transformers' ``Zamba2Config`` loads."""
    z = cfg.zamba2
    if not z:
        raise CheckpointError("not a Zamba2 model (config.zamba2 is None)")
    m = cfg.mamba2
    if m.D_has_hdim or m.norm_before_gate:
        raise CheckpointError(
            "transformers' Zamba2 has neither D per channel (mamba2.D_has_hdim) "
            "nor mamba2.norm_before_gate=True"
        )
    if m.dt_limit != (m.dt_min, math.inf):
        raise CheckpointError(
            f"mamba2.dt_limit {m.dt_limit} cannot be saved: transformers' Zamba2 "
            "clamps Δ to (time_step_min, inf) and initialises it from "
            f"time_step_min = dt_min; use dt_limit=(dt_min, inf) = "
            f"({m.dt_min}, inf)"
        )
    if z["use_shared_attention_adapter"] and z["num_key_value_heads"] != z["num_attention_heads"]:
        raise CheckpointError(
            "transformers' Zamba2 cannot combine GQA (num_key_value_heads < "
            "num_attention_heads) with use_shared_attention_adapter"
        )
    hybrid = set(z["hybrid_layer_ids"])
    return dict(
        model_type="zamba2",
        architectures=["Zamba2ForCausalLM"],
        vocab_size=cfg.padded_vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layer,
        layers_block_type=["hybrid" if i in hybrid else "mamba" for i in range(cfg.n_layer)],
        mamba_d_state=m.d_state,
        mamba_d_conv=m.d_conv,
        mamba_expand=m.expand,
        mamba_ngroups=m.ngroups,
        n_mamba_heads=m.nheads(cfg.d_model),
        chunk_size=m.chunk_size,
        use_conv_bias=True,
        time_step_min=m.dt_min,
        time_step_max=m.dt_max,
        time_step_floor=m.dt_init_floor,
        add_bias_linear=m.bias or z["add_bias_linear"],
        intermediate_size=z["intermediate_size"],
        hidden_act=z["hidden_act"],
        num_attention_heads=z["num_attention_heads"],
        num_key_value_heads=z["num_key_value_heads"],
        attention_dropout=0.0,
        num_mem_blocks=z["num_mem_blocks"],
        use_shared_attention_adapter=z["use_shared_attention_adapter"],
        adapter_rank=z["adapter_rank"],
        use_mem_rope=z["use_mem_rope"],
        rope_parameters={"rope_type": "default", "rope_theta": z["rope_theta"]},
        initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.norm_epsilon,
        tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


# --------------------------------------------------------------------------------------------
# tensor names
# --------------------------------------------------------------------------------------------

_SHARED = {
    "norm.": "input_layernorm.",
    "attn.": "self_attn.",
    "norm2.": "pre_ff_layernorm.",
    "mlp.": "feed_forward.",
}
_ADAPTER_LISTS = {
    "q": "self_attn.linear_q_adapter_list",
    "k": "self_attn.linear_k_adapter_list",
    "v": "self_attn.linear_v_adapter_list",
    "gate_up": "feed_forward.gate_up_proj_adapter_list",
}
_LOW_RANK = {"down": "0", "up": "1"}


def _layer_prefix(cfg: ModelConfig, i: int) -> str:
    hybrid = i in cfg.zamba2["hybrid_layer_ids"]
    return f"model.layers.{i}.mamba_decoder." if hybrid else f"model.layers.{i}."


def _to_theirs(name: str, cfg: ModelConfig) -> str | None:
    """Our tensor name -> transformers' (the copy save_pretrained writes); None for lm_head when
    tied."""
    z, ids = cfg.zamba2, cfg.zamba2["hybrid_layer_ids"]
    fixed = {
        "backbone.embedding.weight": "model.embed_tokens.weight",
        "backbone.norm_f.weight": "model.final_layernorm.weight",
        "lm_head.weight": None if cfg.tie_embeddings else "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    if m := re.fullmatch(r"backbone\.shared\.(\d+)\.(\w+\.)(.+)", name):
        return f"model.layers.{ids[int(m[1])]}.shared_transformer.{_SHARED[m[2]]}{m[3]}"
    m = re.fullmatch(r"backbone\.layers\.(\d+)\.(.+)", name)
    if m is None:
        raise CheckpointError(f"tensor {name!r} has no place in a transformers Zamba2 checkpoint")
    i, rest = int(m[1]), m[2]
    if rest.startswith("norm."):
        return _layer_prefix(cfg, i) + "input_layernorm." + rest.removeprefix("norm.")
    if rest.startswith("mixer."):
        return _layer_prefix(cfg, i) + "mamba." + rest.removeprefix("mixer.")
    if rest == "linear.weight":
        return f"model.layers.{i}.linear.weight"
    a = re.fullmatch(r"adapters\.(\w+)\.(down|up)\.weight", rest)
    if a is None:
        raise CheckpointError(f"tensor {name!r} has no place in a transformers Zamba2 checkpoint")
    k = ids.index(i)
    return (
        f"model.layers.{ids[k % z['num_mem_blocks']]}.shared_transformer."
        f"{_ADAPTER_LISTS[a[1]]}.{k}.{_LOW_RANK[a[2]]}.weight"
    )


def _to_ours(name: str, cfg: ModelConfig) -> str | None:
    """transformers' tensor name -> ours; None for a copy of a tied shared block (or an adapter no
    layer uses), which ssmkit holds once."""
    z, ids = cfg.zamba2, cfg.zamba2["hybrid_layer_ids"]
    fixed = {
        "model.embed_tokens.weight": "backbone.embedding.weight",
        "model.final_layernorm.weight": "backbone.norm_f.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None:
        return _UNKNOWN
    i, rest = int(m[1]), m[2]
    if i in ids and rest.startswith("shared_transformer."):
        rest = rest.removeprefix("shared_transformer.")
        block = ids.index(i) % z["num_mem_blocks"]
        if ids[block] != i:
            return None  # a tied copy: ssmkit keeps the first
        for kind, prefix in _ADAPTER_LISTS.items():
            if a := re.fullmatch(re.escape(prefix) + r"\.(\d+)\.([01])\.weight", rest):
                k = int(a[1])
                if k >= len(ids) or k % z["num_mem_blocks"] != block:
                    return None  # an adapter slot transformers never calls
                low_rank = "down" if a[2] == "0" else "up"
                return f"backbone.layers.{ids[k]}.adapters.{kind}.{low_rank}.weight"
        for ours, theirs in _SHARED.items():
            if rest.startswith(theirs):
                return f"backbone.shared.{block}.{ours}{rest.removeprefix(theirs)}"
        return _UNKNOWN
    prefix = "mamba_decoder." if i in ids else ""
    if rest.startswith(prefix + "input_layernorm."):
        return f"backbone.layers.{i}.norm.{rest.removeprefix(prefix + 'input_layernorm.')}"
    if rest.startswith(prefix + "mamba."):
        return f"backbone.layers.{i}.mixer.{rest.removeprefix(prefix + 'mamba.')}"
    if i in ids and rest == "linear.weight":
        return f"backbone.layers.{i}.linear.weight"
    return _UNKNOWN


def _expected(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our tensor names and shapes for ``cfg`` (a model built on the meta device: no memory)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in MambaLM(cfg).state_dict().items()}


def state_from_zamba2(state: dict, cfg: ModelConfig) -> dict:
    """A transformers Zamba2 state dict (as ``state_dict()`` gives it, or as ``save_pretrained``
    writes it: tied blocks once) renamed to ours, for ``cfg = config_from_zamba2(config)``."""
    out, unexpected = {}, []
    for name, tensor in state.items():
        ours = _to_ours(name, cfg)
        if ours is None or (ours == "lm_head.weight" and cfg.tie_embeddings):
            continue
        if ours == _UNKNOWN:
            unexpected.append(name)
        else:
            out[ours] = tensor
    expected = _expected(cfg)
    if cfg.tie_embeddings and "backbone.embedding.weight" in out:
        out["lm_head.weight"] = out["backbone.embedding.weight"]
    unexpected += [n for n in out if n not in expected]
    missing = [_to_theirs(n, cfg) for n in expected if n not in out]
    if missing or unexpected:
        raise CheckpointError(
            f"Zamba2 weights do not match the config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    return out


def state_to_zamba2(state: dict, cfg: ModelConfig) -> dict:
    """Our state dict as transformers' Zamba2 names. Tied embeddings: each shared block once, at the
    first hybrid layer using it (what ``save_pretrained`` writes; transformers ties the rest), no
    lm_head.
    Untied: transformers then ties no shared block either, so every hybrid layer gets its own copy
    (cloned, so no two tensors share memory). Weights transformers has and ssmkit's model lacks
    (conv bias, Mamba / MLP biases under add_bias_linear, MLP adapters) are written as zeros."""
    z, ids = cfg.zamba2, cfg.zamba2["hybrid_layer_ids"]
    nmb = z["num_mem_blocks"]
    out = {}
    for name, tensor in state.items():
        theirs = _to_theirs(name, cfg)
        if theirs is None:
            continue
        out[theirs] = tensor
        if cfg.tie_embeddings or ".shared_transformer." not in theirs:
            continue
        source = int(theirs.split(".")[2])  # the block's (or adapter's block's) first layer
        block = ids.index(source) % nmb
        for layer in ids:
            if layer != source and ids.index(layer) % nmb == block:
                out[theirs.replace(f"model.layers.{source}.", f"model.layers.{layer}.", 1)] = (
                    tensor.clone()
                )
    _zero_fill(out, state, cfg)
    return out


def _zero_fill(out: dict, state: dict, cfg: ModelConfig):
    """Zeros for the weights transformers' Zamba2 always (or with add_bias_linear) has and ours
    lacks."""
    z, ids = cfg.zamba2, cfg.zamba2["hybrid_layer_ids"]
    like = next(iter(state.values()))
    zeros = lambda *shape: torch.zeros(shape, dtype=like.dtype, device=like.device)  # noqa: E731
    m = cfg.mamba2
    inner = m.d_inner(cfg.d_model)
    conv_dim = inner + 2 * m.ngroups * m.d_state
    add_bias = m.bias or z["add_bias_linear"]
    for i in range(cfg.n_layer):
        mamba = _layer_prefix(cfg, i) + "mamba."
        wanted = {"conv1d.bias": conv_dim}
        if add_bias:
            wanted.update(
                {
                    "in_proj.bias": inner + conv_dim + m.nheads(cfg.d_model),
                    "out_proj.bias": cfg.d_model,
                }
            )
        for key, size in wanted.items():
            out.setdefault(mamba + key, zeros(size))
    layers = ids if not cfg.tie_embeddings else ids[: min(len(ids), z["num_mem_blocks"])]
    for layer in layers:
        ff = f"model.layers.{layer}.shared_transformer.feed_forward."
        if add_bias:
            out.setdefault(ff + "gate_up_proj.bias", zeros(2 * z["intermediate_size"]))
            out.setdefault(ff + "down_proj.bias", zeros(cfg.d_model))
        block = ids.index(layer) % z["num_mem_blocks"]
        for k in range(block, len(ids), z["num_mem_blocks"]):
            out.setdefault(
                f"{ff}gate_up_proj_adapter_list.{k}.0.weight", zeros(z["adapter_rank"], cfg.d_model)
            )
            out.setdefault(
                f"{ff}gate_up_proj_adapter_list.{k}.1.weight",
                zeros(2 * z["intermediate_size"], z["adapter_rank"]),
            )


__all__ = ["config_from_zamba2", "config_to_zamba2", "state_from_zamba2", "state_to_zamba2"]
