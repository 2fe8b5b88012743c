"""transformers' Jamba checkpoints (``model_type`` "jamba", ``JambaForCausalLM``) <-> ssmkit, dense
FFNs and mixtures of experts.

Jamba (Lieber et al. 2024) is ssmkit's hybrid block stack exactly: layer i is attention when
``i % attn_layer_period == attn_layer_offset``, else Mamba-1 with learnable RMSNorms on Δ, B, C
(``mamba1.mixer_rms_weights``), and every layer has a gated MLP after its mixer. Pure functions, as
:mod:`ssmkit.hub.zamba2`: the config both ways (:func:`config_from_jamba`, :func:`config_to_jamba`)
and the tensors both ways (:func:`state_from_jamba`, :func:`state_to_jamba`). Weights, layer i
(``L`` = ``model.layers.i``, ``B`` = ``backbone.layers.i``):

    model.embed_tokens / model.final_layernorm   backbone.embedding / backbone.norm_f
    L.input_layernorm / L.pre_ff_layernorm       B.norm / B.norm2
    L.mamba.*                                    B.mixer.* (same names, dt/b/c_layernorm included)
    L.self_attn.{q,k,v}_proj / o_proj            B.mixer.in_proj = cat(q, k, v) / B.mixer.out_proj
    L.feed_forward.{up,gate}_proj / down_proj    B.mlp.fc1 = cat(up, gate) (value first) / B.mlp.fc2
    L.feed_forward.router.weight                 B.mlp.router.weight           (expert layers)
    L.feed_forward.experts.j.{up,gate}_proj      B.mlp.experts.j.fc1 = cat(up, gate)
    L.feed_forward.experts.j.down_proj           B.mlp.experts.j.fc2

What transformers 5 does that the mapping mirrors (modeling_jamba.py): attention has no bias and no
position embedding, scale head_dim^-1/2 (head_dim = config.head_dim if given, else hidden_size //
num_attention_heads); ``JambaMLP`` is down(act(gate(x)) * up(x)) and its experts the same, act =
``ACT2FN[hidden_act]``; ``hidden_act`` is also the conv's activation (the scan's gate stays SiLU),
so it maps to ``mlp_activation`` and ``mamba1.activation`` both (any name of
:data:`ssmkit.ops.ACTIVATIONS`; the two must agree to save); one ``rms_norm_eps`` serves every norm;
the residual stays in the input dtype (``residual_in_fp32=False``). Layer i's feed-forward is a
mixture of experts (``JambaSparseMoeBlock``: ssmkit's :class:`~ssmkit.models.moe.SparseMoE`, the
same routing) when ``num_experts > 1`` and ``i % expert_layer_period == expert_layer_offset``; the
config fields keep their names in ModelConfig. Expert weights are read in both of transformers'
layouts: one tensor per expert, as published checkpoints and transformers 5's ``save_pretrained``
write them, and the fused 3-D tensors transformers 5 holds in memory (``experts.gate_up_proj`` (E,
2h, d), gate first, and ``experts.down_proj`` (E, d, h)); a save writes one tensor per expert. An
``intermediate_size`` that is not a multiple of 128 (ssmkit's MLP width, as mamba_ssm's) loads
exactly: the extra units get zero weights, so they output 0 and, with zero gradients, stay 0; a save
writes the MLP's full width.
"""

from __future__ import annotations

import math
import re

import torch

from .. import checks
from ..models import ModelConfig
from ..models.mlp import mlp_width
from .layouts import CheckpointError, _build_config

# JambaConfig's defaults (configuration_jamba.py), used where config.json leaves a field out
DEFAULTS = dict(
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    hidden_act="silu",
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    num_experts=16,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.001,
    expert_layer_period=2,
    expert_layer_offset=1,
    attn_layer_period=8,
    attn_layer_offset=4,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank="auto",
    mamba_conv_bias=True,
    mamba_proj_bias=False,
    tie_word_embeddings=False,
)
# config.json field -> ModelConfig field, or the path of a field of its Mamba-1 group
_FIELDS = {
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layer",
    "vocab_size": "vocab_size",
    "intermediate_size": "d_intermediate",
    "attn_layer_period": "attn_every",
    "attn_layer_offset": "attn_offset",
    "rms_norm_eps": "norm_epsilon",
    "initializer_range": "initializer_range",
    "tie_word_embeddings": "tie_embeddings",
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "expert_layer_period": "expert_layer_period",
    "expert_layer_offset": "expert_layer_offset",
    "router_aux_loss_coef": "router_aux_loss_coef",
    "mamba_d_state": "mamba1.d_state",
    "mamba_d_conv": "mamba1.d_conv",
    "mamba_expand": "mamba1.expand",
    "mamba_dt_rank": "mamba1.dt_rank",
    "mamba_conv_bias": "mamba1.conv_bias",
    "mamba_proj_bias": "mamba1.bias",
}
_ATTN_NAMES = {
    "attn_cfg.num_heads": "num_attention_heads",
    "attn_cfg.num_heads_kv": "num_key_value_heads",
    "attn_cfg.head_dim": "head_dim",
    "mamba1.mixer_rms_eps": "rms_norm_eps",
    "mamba1.activation": "hidden_act",
    "mlp_activation": "hidden_act",
}


def config_from_jamba(hf: dict) -> ModelConfig:
    """A transformers ``JambaConfig`` dict as a ModelConfig; a field ssmkit cannot represent is a
    CheckpointError naming it."""
    if hf.get("model_type") != "jamba":
        raise CheckpointError(f"model_type {hf.get('model_type')!r} is not 'jamba'")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in hf]
    if (
        missing
    ):  # JambaConfig's defaults are a 52B model: never guess the size of someone's checkpoint
        raise CheckpointError(
            f"fields {missing} are missing; a Jamba config states the model's size"
        )
    nulls = [
        k
        for k in (*DEFAULTS, *_FIELDS, "head_dim")
        if k in hf and hf[k] is None and k != "num_key_value_heads"
    ]  # JambaConfig: None = num_attention_heads
    if nulls:  # null would silently fall back to a default that may not match the weights
        raise CheckpointError(
            f"fields {nulls} are null; give them values or leave them out for the defaults"
        )
    c = {**DEFAULTS, **hf}
    if c["attention_dropout"] != 0:
        raise CheckpointError(
            f"field 'attention_dropout' is {c['attention_dropout']!r}; ssmkit's attention "
            "has no dropout (0.0 loads)"
        )
    bad = [
        k
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "attn_layer_period",
        )
        if not (checks.is_integer(c[k]) and c[k] >= 1)
    ]
    if bad:  # (every Jamba layer has an MLP: intermediate_size 0 is no Jamba either)
        raise CheckpointError(f"fields {bad} must be integers >= 1; got {[c[k] for k in bad]}")
    heads = c["num_attention_heads"]
    kv = heads if c["num_key_value_heads"] is None else c["num_key_value_heads"]
    head_dim = c.get(
        "head_dim", c["hidden_size"] // heads
    )  # JambaAttention's getattr(config, "head_dim")
    dt_rank = (
        math.ceil(c["hidden_size"] / 16) if c["mamba_dt_rank"] == "auto" else c["mamba_dt_rank"]
    )
    kwargs = {ours: c[theirs] for theirs, ours in _FIELDS.items()}
    kwargs.update(
        {
            "mamba1.dt_rank": dt_rank,
            "mamba1.mixer_rms_eps": c["rms_norm_eps"],
            "mamba1.mixer_rms_weights": True,
            "mamba1.activation": c["hidden_act"],
            "mlp_activation": c["hidden_act"],
        }
    )
    kwargs.update(
        mixer="mamba1",
        pad_vocab_size_multiple=1,
        rms_norm=True,
        residual_in_fp32=False,
        attn_cfg=dict(
            num_heads=heads,
            num_heads_kv=kv,
            head_dim=head_dim,
            qkv_proj_bias=False,
            out_proj_bias=False,
        ),
    )
    return _build_config(
        kwargs, {**{ours: theirs for theirs, ours in _FIELDS.items()}, **_ATTN_NAMES}
    )


def _attention_period(cfg: ModelConfig) -> tuple[int, int]:
    """Jamba's (attn_layer_period, attn_layer_offset) giving exactly cfg's attention layers."""
    n, idx = cfg.n_layer, cfg.attn_layer_idx
    if cfg.attn_every:
        return cfg.attn_every, cfg.attn_offset
    if not idx:
        return n + 1, n  # no i < n_layer has i % (n + 1) == n
    period = idx[1] - idx[0] if len(idx) > 1 else n
    if [i for i in range(n) if i % period == idx[0] % period] != idx:
        raise CheckpointError(
            f"attn_layer_idx {idx} is not periodic: Jamba places attention at layer i when "
            "i % attn_layer_period == attn_layer_offset; save format='mamba_ssm'"
        )
    return period, idx[0] % period


def config_to_jamba(cfg: ModelConfig) -> dict:
    """A ModelConfig as a transformers ``JambaConfig`` dict (its experts' fields as the config has
    them; a dense model: num_experts=1); a model Jamba cannot express is a CheckpointError naming
    the field."""
    if cfg.zamba2 is not None:
        raise CheckpointError("a Zamba2 model saves as format='zamba2' only")
    kinds = set(cfg.mixers)
    newer = sorted(kinds & {"mamba2", "mamba3", "s4d", "h3"})
    if newer:
        raise CheckpointError(
            f"mixer {newer[0]!r}: Jamba's Mamba layers are Mamba-1; save format='mamba_ssm'"
        )
    if "swa" in kinds:
        raise CheckpointError(
            "attn_cfg.window_size: Jamba's attention is full causal attention, not a sliding window"
        )
    m = cfg.mamba1
    if not m.mixer_rms_weights:
        raise CheckpointError(
            "mamba1.mixer_rms_weights is false: Jamba's Mamba layers norm Δ, B "
            "and C with learnable RMSNorms (dt_layernorm, b_layernorm, "
            "c_layernorm); save format='mamba_ssm' or 'hf'"
        )
    if not cfg.rms_norm or cfg.norm_epsilon != m.mixer_rms_eps:
        raise CheckpointError(
            f"rms_norm_eps: Jamba uses RMSNorm with one epsilon everywhere; this model has "
            f"rms_norm={cfg.rms_norm}, norm_epsilon={cfg.norm_epsilon}, "
            f"mamba1.mixer_rms_eps={m.mixer_rms_eps}"
        )
    if "mamba1" in cfg.ssm_kinds and m.activation != cfg.mlp_activation:
        raise CheckpointError(
            f"hidden_act: Jamba has one activation for its MLPs and its Mamba conv; this model "
            f"has mlp_activation={cfg.mlp_activation!r}, mamba1.activation={m.activation!r}"
        )
    if cfg.d_intermediate == 0:
        raise CheckpointError(
            "intermediate_size: every Jamba layer has an MLP, this model has none "
            "(d_intermediate=0); save format='mamba_ssm'"
        )
    hf = dict(
        model_type="jamba",
        architectures=["JambaForCausalLM"],
        vocab_size=cfg.padded_vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=mlp_width(cfg.d_intermediate),
        num_hidden_layers=cfg.n_layer,
        hidden_act=cfg.mlp_activation,
        initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.norm_epsilon,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=0.0,
        num_experts=1,
        num_experts_per_tok=1,
        expert_layer_period=1,
        expert_layer_offset=0,
        mamba_d_state=m.d_state,
        mamba_d_conv=m.d_conv,
        mamba_expand=m.expand,
        mamba_dt_rank=m.dt_rank_value(cfg.d_model),
        mamba_conv_bias=m.conv_bias,
        mamba_proj_bias=m.bias,
    )
    if cfg.num_experts > 1:
        hf.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            expert_layer_period=cfg.expert_layer_period,
            expert_layer_offset=cfg.expert_layer_offset,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
    hf["attn_layer_period"], hf["attn_layer_offset"] = _attention_period(cfg)
    a = cfg.attn_cfg
    if a is None:  # no attention layers: any heads do
        hf.update(num_attention_heads=1, num_key_value_heads=1)
        return hf
    unsupported = [f"attn_cfg.{k}" for k in ("qkv_proj_bias", "out_proj_bias") if a[k]]
    unsupported += [f"attn_cfg.{k}" for k in ("d_conv", "rotary_emb_dim", "mlp_dim") if a[k]]
    if a["softmax_scale"] is not None and a["softmax_scale"] != a["head_dim"] ** -0.5:
        unsupported.append("attn_cfg.softmax_scale")
    if unsupported:
        raise CheckpointError(
            f"{unsupported} cannot be saved: Jamba's attention has no biases, no conv, no "
            "rotary embedding, no parallel MLP and scale head_dim^-1/2; "
            "save format='mamba_ssm'"
        )
    hf.update(num_attention_heads=a["num_heads"], num_key_value_heads=a["num_heads_kv"])
    if a["head_dim"] != cfg.d_model // a["num_heads"]:
        hf["head_dim"] = a["head_dim"]
    return hf


# --------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------

_SIMPLE = {
    "input_layernorm.weight": "norm.weight",
    "pre_ff_layernorm.weight": "norm2.weight",
    "self_attn.o_proj.weight": "mixer.out_proj.weight",
    "feed_forward.down_proj.weight": "mlp.fc2.weight",
    "feed_forward.router.weight": "mlp.router.weight",
}
_TOP = {
    "model.embed_tokens.weight": "backbone.embedding.weight",
    "model.final_layernorm.weight": "backbone.norm_f.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER = re.compile(r"(model|backbone)\.layers\.(\d+)\.(.+)")


def _attn_sizes(cfg: ModelConfig) -> dict[str, int]:
    a = cfg.attn_cfg
    return {
        "q": a["num_heads"] * a["head_dim"],
        "k": a["num_heads_kv"] * a["head_dim"],
        "v": a["num_heads_kv"] * a["head_dim"],
    }


def state_from_jamba(state: dict, cfg: ModelConfig) -> dict:
    """A transformers Jamba state dict renamed (and q/k/v, up/gate fused) to ours, for ``cfg =
    config_from_jamba(config)``; experts per expert or fused (module docstring). Names it does not
    know are passed through unchanged, so loading reports them as unexpected."""
    out, parts = {}, {}
    h, width = cfg.d_intermediate, mlp_width(cfg.d_intermediate)
    for name, tensor in state.items():
        match = _LAYER.fullmatch(name)
        if name in _TOP:
            out[_TOP[name]] = tensor
        elif match is None or match[1] != "model":
            out[name] = tensor
        else:
            i, rest = int(match[2]), match[3]
            piece = re.fullmatch(
                r"(self_attn|feed_forward(?:\.experts\.\d+)?)\.(q|k|v|up|gate)_proj\.weight", rest
            )
            down = re.fullmatch(r"feed_forward(\.experts\.\d+)?\.down_proj\.weight", rest)
            if piece:
                parts.setdefault((i, piece[1]), {})[piece[2]] = (name, tensor)
            elif down:
                out[f"backbone.layers.{i}.mlp{down[1] or ''}.fc2.weight"] = tensor
            elif rest == "feed_forward.experts.gate_up_proj":  # (E, 2h, d): gate, then up
                fused = _fused(name, tensor, (cfg.num_experts, 2 * h, cfg.d_model))
                for j, (gate, up) in enumerate(zip(fused[:, :h], fused[:, h:])):
                    for key, part in (("gate", gate), ("up", up)):
                        parts.setdefault((i, f"feed_forward.experts.{j}"), {})[key] = (name, part)
            elif rest == "feed_forward.experts.down_proj":  # (E, d, h)
                fused = _fused(name, tensor, (cfg.num_experts, cfg.d_model, h))
                for j, part in enumerate(fused):
                    out[f"backbone.layers.{i}.mlp.experts.{j}.fc2.weight"] = part
            elif rest.startswith("mamba."):
                out[f"backbone.layers.{i}.mixer.{rest.removeprefix('mamba.')}"] = tensor
            else:
                out[f"backbone.layers.{i}.{_SIMPLE.get(rest, rest)}"] = tensor
    for (i, kind), got in sorted(parts.items()):
        if kind == "self_attn":
            sizes = _attn_sizes(cfg)
            out[f"backbone.layers.{i}.mixer.in_proj.weight"] = torch.cat(
                [
                    _piece(got, k, (sizes[k], cfg.d_model), f"model.layers.{i}.self_attn")
                    for k in "qkv"
                ]
            )
        else:  # feed_forward or feed_forward.experts.j
            up, gate = (
                _piece(got, k, (h, cfg.d_model), f"model.layers.{i}.{kind}") for k in ("up", "gate")
            )
            pad = up.new_zeros(width - h, cfg.d_model)
            ours = kind.replace("feed_forward", "mlp")
            out[f"backbone.layers.{i}.{ours}.fc1.weight"] = torch.cat([up, pad, gate, pad])
    for key in out:  # down_proj: zero columns for the padded units
        fc2 = re.fullmatch(r"backbone\.layers\.\d+\.mlp(\.experts\.\d+)?\.fc2\.weight", key)
        if fc2 and width != h and tuple(out[key].shape) == (cfg.d_model, h):
            out[key] = torch.cat([out[key], out[key].new_zeros(cfg.d_model, width - h)], dim=1)
    return out


def _fused(name: str, tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    """One of transformers 5's fused expert tensors, of the shape the config implies."""
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"weight {name} has shape {tuple(tensor.shape)}, the config implies {shape} "
            "(num_experts, ..., ...)"
        )
    return tensor


def _piece(got: dict, key: str, shape: tuple, prefix: str) -> torch.Tensor:
    """One of the fused weights (q/k/v or up/gate), present and of the shape the config implies."""
    name = f"{prefix}.{key}_proj.weight"
    if key not in got:
        raise CheckpointError(
            f"missing weight {name} ({', '.join(n for n, _ in got.values())} are there)"
        )
    name, tensor = got[key]
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"weight {name} has shape {tuple(tensor.shape)}, the config implies {shape}"
        )
    return tensor


def state_to_jamba(state: dict, cfg: ModelConfig) -> dict:
    """Our state dict as transformers' Jamba names, for a ``cfg`` that :func:`config_to_jamba`
    accepts (tied embeddings: no lm_head, as transformers' ``save_pretrained`` writes). Split
    tensors are copies, so no two share memory (safetensors refuses that)."""
    mixers, back = cfg.mixers, {ours: theirs for theirs, ours in _TOP.items()}
    simple = {ours: theirs for theirs, ours in _SIMPLE.items()}
    out = {}
    for name, tensor in state.items():
        match = _LAYER.fullmatch(name)
        if name in back:
            if not (name == "lm_head.weight" and cfg.tie_embeddings):
                out[back[name]] = tensor
            continue
        if match is None or match[1] != "backbone":
            raise CheckpointError(f"weight {name} has no place in a Jamba checkpoint")
        i, rest = int(match[2]), match[3]
        prefix = f"model.layers.{i}."
        if rest == "mixer.in_proj.weight" and mixers[i] == "attn":
            sizes = _attn_sizes(cfg)
            for key, part in zip("qkv", tensor.split([sizes["q"], sizes["k"], sizes["v"]])):
                out[f"{prefix}self_attn.{key}_proj.weight"] = part.clone()
        elif re.fullmatch(r"mlp(\.experts\.\d+)?\.fc1\.weight", rest):
            theirs = prefix + rest.replace("mlp", "feed_forward", 1).removesuffix("fc1.weight")
            up, gate = tensor.chunk(2)
            out[theirs + "up_proj.weight"] = up.clone()
            out[theirs + "gate_proj.weight"] = gate.clone()
        elif re.fullmatch(r"mlp\.experts\.\d+\.fc2\.weight", rest):
            theirs = prefix + rest.replace("mlp", "feed_forward", 1)
            out[theirs.replace("fc2.weight", "down_proj.weight")] = tensor
        elif rest.startswith("mixer.") and mixers[i] == "mamba1":
            out[prefix + "mamba." + rest.removeprefix("mixer.")] = tensor
        elif rest in simple:  # norms, the attention's out_proj, the MLP's fc2, the router
            out[prefix + simple[rest]] = tensor
        else:
            raise CheckpointError(f"weight {name} has no place in a Jamba checkpoint")
    return out


__all__ = ["config_from_jamba", "config_to_jamba", "state_from_jamba", "state_to_jamba"]
