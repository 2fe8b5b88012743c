"""Model configuration: :class:`ModelConfig`, the rule that swaps its mixer fairly, the presets.

The top level holds what every model shares, named as mamba_ssm's ``MambaConfig`` (d_model, n_layer,
vocab_size, pad_vocab_size_multiple, d_intermediate, attn_layer_idx, attn_cfg, rms_norm, ...); each
SSM mixer's knobs are a group of their own, as mamba_ssm's ``ssm_cfg`` (``mamba1``, ``mamba2``,
``mamba3``, and ``s4d``, ``h3`` for the linear time-invariant mixers:
:mod:`ssmkit.models.ssm_config`), so an official ``config.json`` maps onto it nearly one to one:

    ModelConfig(d_model=768, n_layer=24, vocab_size=50277, mixer="mamba2", mamba2=dict(d_state=64))
    ModelConfig(d_model=768, n_layer=24, vocab_size=50277, mixer="mamba2", d_state=64)  # short

The short form (a group's field given flat, as configs and runs written before the groups have it)
sets that field in the group of every SSM mixer the model uses (:func:`migrate_flat`).

Glossary (code -> paper symbol): D = ``d_model``; E = ``expand``, ``d_inner`` = E·D;
N = ``d_state``; W = ``d_conv``; R = ``dt_rank`` (Mamba-1); Δ = dt, initialised in [``dt_min``,
``dt_max``] and clamped to ``dt_limit`` (Mamba-2); P = ``headdim``; H = ``nheads`` = d_inner / P;
G = ``ngroups``; Q = ``chunk_size`` (the SSD / Mamba-3 chunk); A = -exp(A_log), A_log's init from
``A_init_range`` (Mamba-2); A_t = -max(f(a_t), ``A_floor``), f = ``a_activation`` (Mamba-3);
R = ``mimo_rank`` (Mamba-3 MIMO); S4D / H3: A from ``init`` (S4D-Lin, -Inv, -LegS or random),
Ā, B̄ by ``disc`` (zero-order hold or bilinear), H3's heads of ``head_dim`` channels and its shift
SSM of ``shift_size`` taps.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass, field

from .. import checks
from ..ops.activations import activation
from .ssm_config import (
    GROUP_FIELDS,
    GROUPS,
    ConfigError,
    H3Config,
    Mamba1Config,
    Mamba2Config,
    Mamba3Config,
    S4DConfig,
    _field,
    make_group,
)
from .zamba2_config import TINY_ZAMBA2, Zamba2ConfigError, check_zamba2

MIXERS = (
    "mamba1",
    "mamba2",
    "mamba3",
    "attn",
    "swa",
    "s4d",
    "h3",
)  # "swa": attention over the last attn_cfg.window_size
MAMBA_MIXERS = ("mamba1", "mamba2", "mamba3")  # the selective (input-dependent) SSMs
LTI_MIXERS = ("s4d", "h3")  # the linear time-invariant SSMs: one kernel, an FFT convolution
SSM_MIXERS = MAMBA_MIXERS + LTI_MIXERS  # the state-space mixers; the others attend
# mamba_ssm's MHA arguments (modules/mha.py) and their defaults, but causal=True (mamba_ssm's
# default False trains a model that sees the future) and ssmkit's window_size (Samba's sliding
# window; None = full).
ATTN_DEFAULTS = dict(
    num_heads=None,
    num_heads_kv=None,
    head_dim=None,
    mlp_dim=0,
    qkv_proj_bias=True,
    out_proj_bias=True,
    softmax_scale=None,
    causal=True,
    d_conv=0,
    rotary_emb_dim=0,
    rotary_emb_base=10000.0,
    rotary_emb_interleaved=False,
    window_size=None,
)


def check_attn_cfg(attn_cfg: dict | None, d_model: int, needs_window: bool = False) -> dict:
    """``attn_cfg`` with every key of :data:`ATTN_DEFAULTS` filled in and checked; num_heads
    defaults to d_model / 64 (4 below d_model 256)."""
    cfg = dict(attn_cfg or {})
    unknown = sorted(set(cfg) - set(ATTN_DEFAULTS))
    if unknown:
        raise ConfigError(
            "attn_cfg", f"has unknown keys {unknown}; valid keys: {', '.join(ATTN_DEFAULTS)}"
        )
    cfg = {**ATTN_DEFAULTS, **cfg}
    if cfg["causal"] is not True:
        raise ConfigError(
            "attn_cfg.causal",
            "must be true: a language model may not attend to later tokens "
            f"(mamba_ssm's MHA defaults to causal=False); "
            f"got {cfg['causal']!r}",
        )
    if cfg["num_heads"] is None:
        cfg["num_heads"] = d_model // 64 if d_model >= 256 else 4
    field = lambda name, **kw: _field(f"attn_cfg.{name}", checks.integer, cfg[name], **kw)  # noqa: E731
    heads = cfg["num_heads"] = field("num_heads", minimum=1)
    cfg["num_heads_kv"] = kv = (
        field("num_heads_kv", minimum=1) if cfg["num_heads_kv"] is not None else heads
    )
    if heads % kv:
        raise ConfigError("attn_cfg.num_heads_kv", f"must divide num_heads={heads}; got {kv}")
    if cfg["head_dim"] is None and d_model % heads:
        raise ConfigError(
            "attn_cfg.num_heads", f"must divide d_model={d_model} (or give head_dim); got {heads}"
        )
    head_dim = field("head_dim", minimum=1) if cfg["head_dim"] is not None else d_model // heads
    cfg["head_dim"] = head_dim
    for name in ("mlp_dim", "d_conv", "rotary_emb_dim"):
        cfg[name] = field(name, minimum=0)
    if cfg["rotary_emb_dim"] % 2 or cfg["rotary_emb_dim"] > head_dim:
        raise ConfigError(
            "attn_cfg.rotary_emb_dim",
            f"must be even and <= head_dim={head_dim}; got {cfg['rotary_emb_dim']}",
        )
    if cfg["window_size"] is not None:
        cfg["window_size"] = field("window_size", minimum=1)
    elif needs_window:
        raise ConfigError(
            "attn_cfg.window_size",
            "is needed by the layout's 'swa' layers (sliding-window "
            "attention over the last window_size positions)",
        )
    for name in ("qkv_proj_bias", "out_proj_bias", "rotary_emb_interleaved"):
        if not isinstance(cfg[name], bool):
            raise ConfigError(f"attn_cfg.{name}", f"must be true or false; got {cfg[name]!r}")
    cfg["rotary_emb_base"] = _field(
        "attn_cfg.rotary_emb_base", checks.number, cfg["rotary_emb_base"], low=0, low_open=True
    )
    if cfg["softmax_scale"] is not None:
        cfg["softmax_scale"] = _field(
            "attn_cfg.softmax_scale", checks.number, cfg["softmax_scale"], low=0, low_open=True
        )
    return cfg


def fair_sizes(mixer: str, d_inner: int) -> dict:
    """The state, head and chunk sizes that make a ``mixer`` layer of width ``d_inner``
    comparable to the other mixers' (the rule of :meth:`ModelConfig.with_mixer`): Mamba-1 N = 16
    (its paper's); Mamba-2 and Mamba-3 N = 128, P = 64 from d_inner 1024 (mamba_ssm's defaults),
    else N = 64, P = 32, so a narrow model keeps several heads (P divides d_inner: fewer channels
    for a width that is no multiple of 32); their chunk Q = 64, which short sequences barely pad.
    S4D: N = 64 (its paper's) from d_inner 1024, else 32, as its parameters per channel (2N + 2)
    weigh more in a narrow layer. H3 has none: see :meth:`ModelConfig.with_mixer`."""
    if mixer not in SSM_MIXERS:
        raise ValueError(f"mixer={mixer!r} is not an SSM mixer; valid: {', '.join(SSM_MIXERS)}")
    if mixer == "h3":
        raise ValueError(_H3_NOT_FAIR)
    if mixer == "mamba1":
        return {"d_state": 16}
    big = d_inner >= 1024
    if mixer == "s4d":
        return {"d_state": 64 if big else 32}
    headdim = math.gcd(d_inner, 64 if big else 32)
    return {"d_state": 128 if big else 64, "headdim": headdim, "chunk_size": 64}


_H3_NOT_FAIR = (
    "H3 has no layer of a Mamba layer's size: its q, k, v and output projections are an "
    "attention layer's (4·d_model², no expand), which the H3 paper pairs with an MLP in every "
    "block; build it directly, ModelConfig(..., mixer='h3', d_intermediate=4 * d_model)"
)


def _ssm_kinds(mixer, layout) -> list[str]:
    """The SSM mixers a model's layers use, in SSM_MIXERS' order, from ``mixer`` and ``layout``."""
    kinds = set(layout) if isinstance(layout, (list, tuple)) else {mixer}
    return [kind for kind in SSM_MIXERS if kind in kinds]


def migrate_flat(kwargs: dict) -> dict:
    """ModelConfig keyword arguments with the fields of the mixer groups given flat (the short form
    ``d_state=64``; configs and runs written before the groups) moved into the groups.

    A flat value sets that field in the group of every SSM mixer the model uses (``mixer``, or each
    one in ``layout``): what one flat field meant before. It wins over the group's own value, as
    it comes later (a preset's groups, then a run's flat ``model_overrides``). A flat field that
    none of those mixers takes had no effect and has none: it is checked (as its group checks it),
    then dropped; but ``bias=True`` with Mamba-3 layers is refused, as before (mamba_ssm's Mamba3
    has no bias). ``d_state`` and ``chunk_size`` None mean "the mixer's default": dropped."""
    flat = [key for key in kwargs if key in GROUP_FIELDS]
    if not flat:
        return kwargs
    out = {key: value for key, value in kwargs.items() if key not in GROUP_FIELDS}
    used = _ssm_kinds(out.get("mixer", "mamba1"), out.get("layout"))
    for key in flat:
        value = kwargs[key]
        if value is None and key in ("d_state", "chunk_size"):
            continue
        if key == "bias" and value is True and "mamba3" in used:
            raise ConfigError(
                "bias",
                "must be false for mamba3: mamba_ssm's Mamba3 has no "
                "in_proj / out_proj bias; got True",
            )
        owners = [kind for kind in used if kind in GROUP_FIELDS[key]]
        if not owners:
            try:
                make_group(GROUP_FIELDS[key][0], {key: value})
            except ConfigError as exc:
                raise ConfigError(key, str(exc).removeprefix(f"{exc.field} ")) from None
        for kind in owners:
            group = out.get(kind)
            if isinstance(group, tuple(GROUPS.values())):
                group = group.to_dict()
            out[kind] = {**(group or {}), key: value}
    return out


@dataclass
class ModelConfig:
    """A language model's configuration: the fields every model shares, then one group per SSM
    mixer (read only by that mixer's layers). ``ModelConfig(...)`` also takes a group's field flat,
    the short form (:func:`migrate_flat`); :meth:`to_dict` / :meth:`from_dict` write and read the
    grouped form (YAML, JSON)."""

    # --- the language model ---
    d_model: int = 768  # residual stream width
    n_layer: int = 24  # number of blocks
    vocab_size: int = 50277  # tokenizer size (GPT-NeoX for the official models)
    pad_vocab_size_multiple: int = 8  # embedding rows rounded up to this (8 Mamba-1, 16 Mamba-2)
    mixer: str = "mamba1"  # "mamba1" | "mamba2" | "mamba3" | "s4d" | "h3" | "attn": every layer's
    # mixer ...
    layout: list[str] | None = None  # ... unless given per layer, e.g. ["mamba3", "attn", "swa"]
    d_intermediate: int = 0  # GatedMLP width after each mixer (norm2 + mlp); 0 = no MLP
    mlp_activation: str = "silu"  # the MLPs' (and experts'): fc2(value * act(gate)), a name in
    # ssmkit.ops.ACTIVATIONS (transformers' ACT2FN names; Jamba: hidden_act)
    attn_layer_idx: list[int] | None = None  # mamba_ssm: the layers that are attention (MHA) ...
    attn_every: int = 0  # ... or every N-th (Jamba: i % N == attn_offset); 0 = none
    attn_offset: int = 0
    attn_cfg: dict | None = None  # mamba_ssm's MHA arguments, see ATTN_DEFAULTS (filled in)
    zamba2: dict | None = None  # Zamba2's shared attention blocks (zamba2_config.py); None = off
    tie_embeddings: bool = True  # LM head shares the embedding matrix
    rms_norm: bool = True  # RMSNorm (True) or LayerNorm (False) before each mixer
    norm_epsilon: float = 1e-5  # of every norm (and of Mamba-2's gated RMSNorm)
    residual_in_fp32: bool = True  # keep the residual stream in fp32 under bf16/fp16
    initializer_range: float = 0.02  # std of the embedding init
    rescale_prenorm_residual: bool = True  # out_proj init scaled by 1/sqrt(n_layer) (GPT-2 style)
    # --- a mixture of experts in place of the MLP (Jamba; JambaConfig's names; moe.py): layer i's
    # MLP is num_experts gated MLPs of width d_intermediate behind a top-k router when
    # i % expert_layer_period == expert_layer_offset ---
    num_experts: int = 1  # experts per MoE layer; 1 = dense (one GatedMLP per block, no router)
    num_experts_per_tok: int = 2  # k: the experts each token runs through (Jamba: 2 of 16)
    expert_layer_period: int = 2
    expert_layer_offset: int = 1
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in the training loss

    # --- each SSM mixer's knobs (mamba_ssm's ssm_cfg), read by the layers of that mixer only ---
    mamba1: Mamba1Config = field(default_factory=Mamba1Config)  # d_state 16, d_conv 4, expand 2
    mamba2: Mamba2Config = field(default_factory=Mamba2Config)  # d_state 128, headdim 64, Q 256
    mamba3: Mamba3Config = field(default_factory=Mamba3Config)  # d_state 128, headdim 64, Q 64
    s4d: S4DConfig = field(default_factory=S4DConfig)  # d_state 64, expand 2, S4D-Lin, ZOH
    h3: H3Config = field(default_factory=H3Config)  # d_state 64, head_dim 1, S4D-Lin, bilinear

    def __post_init__(self):
        if self.mixer not in MIXERS:
            raise ValueError(
                f"mixer={self.mixer!r} is not supported; valid mixers: {', '.join(MIXERS)}"
            )
        for name in ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple"):
            setattr(self, name, _field(name, checks.integer, getattr(self, name), minimum=1))
        for name in ("d_intermediate", "attn_every"):
            setattr(self, name, _field(name, checks.integer, getattr(self, name), minimum=0))
        _field("mlp_activation", activation, self.mlp_activation)  # a known name
        for kind in SSM_MIXERS:
            setattr(self, kind, make_group(kind, getattr(self, kind)))
        self._resolve_attention_layers()
        self._check_experts()
        if self.zamba2 is not None:
            try:
                self.zamba2 = check_zamba2(dict(self.zamba2), self.d_model, self.n_layer)
            except Zamba2ConfigError as exc:
                raise ConfigError(exc.field, str(exc).removeprefix(f"{exc.field} ")) from None
        for name in ("tie_embeddings", "rms_norm", "residual_in_fp32", "rescale_prenorm_residual"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false; got {getattr(self, name)!r}")
        # a zero epsilon gives NaN logits
        self.norm_epsilon = _field(
            "norm_epsilon", checks.number, self.norm_epsilon, low=0, low_open=True
        )
        self.initializer_range = _field(
            "initializer_range", checks.number, self.initializer_range, low=0
        )
        used = self.ssm_kinds
        if self.mamba3.chunk_size is None:  # one chunk for a stack with Mamba-2 layers, else 64
            chunk = self.mamba2.chunk_size if "mamba2" in used else 64
            self.mamba3 = dataclasses.replace(self.mamba3, chunk_size=chunk)
        for kind in ("mamba2", "mamba3", "h3"):
            if kind in used:
                getattr(self, kind).check_width(self.d_model)

    def _resolve_attention_layers(self):
        """One answer to "which layers are attention": ``layout`` names them; else ``attn_every``
        (Jamba: layer i when i % attn_every == attn_offset) or mamba_ssm's ``attn_layer_idx``; else
        none (all when mixer is "attn"). ``attn_layer_idx`` is filled in, and given twice the
        answers must agree."""
        n, given = self.n_layer, self.attn_layer_idx
        if given is not None:
            given = list(given)
            if not all(checks.is_integer(i) and 0 <= i < n for i in given) or len(
                set(given)
            ) != len(given):
                raise ConfigError(
                    "attn_layer_idx", f"must be distinct layer indices in 0..{n - 1}; got {given!r}"
                )
            given = sorted(given)
        if self.attn_every:
            self.attn_offset = _field(
                "attn_offset",
                checks.integer,
                self.attn_offset,
                minimum=0,
                maximum=self.attn_every - 1,
            )
        if self.layout is not None:
            self.layout = list(self.layout)
            if len(self.layout) != n:
                raise ValueError(f"layout has {len(self.layout)} entries but n_layer={n}")
            bad = [m for m in self.layout if m not in MIXERS]
            if bad:
                raise ValueError(
                    f"layout names unknown mixers {bad}; valid mixers: {', '.join(MIXERS)}"
                )
            found = [i for i, m in enumerate(self.layout) if m in ("attn", "swa")]
        elif self.mixer in ("attn", "swa"):
            found = list(range(n))
        elif self.attn_every:
            found = [i for i in range(n) if i % self.attn_every == self.attn_offset]
        else:
            found = given or []
        for name, other in (
            ("attn_layer_idx", given),
            (
                "attn_every",
                [i for i in range(n) if i % self.attn_every == self.attn_offset]
                if self.attn_every
                else None,
            ),
        ):
            if other is not None and other != found:
                raise ConfigError(
                    name,
                    f"gives attention layers {other}, but the config's other fields give "
                    f"{found}: set one of layout / attn_every / attn_layer_idx",
                )
        self.attn_layer_idx = found
        if found or self.attn_cfg is not None:
            self.attn_cfg = check_attn_cfg(
                self.attn_cfg, self.d_model, needs_window="swa" in self.mixers
            )

    def _check_experts(self):
        """The mixture-of-experts fields: integers in range, a top-k no larger than the experts,
        and experts only where there is an MLP width for them and a stack that can hold them."""
        for name in ("num_experts", "num_experts_per_tok", "expert_layer_period"):
            setattr(self, name, _field(name, checks.integer, getattr(self, name), minimum=1))
        self.expert_layer_offset = _field(
            "expert_layer_offset",
            checks.integer,
            self.expert_layer_offset,
            minimum=0,
            maximum=self.expert_layer_period - 1,
        )
        self.router_aux_loss_coef = _field(
            "router_aux_loss_coef", checks.number, self.router_aux_loss_coef, low=0
        )
        if self.num_experts == 1:
            return
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                "num_experts_per_tok",
                f"must be at most num_experts={self.num_experts} (each token runs through k "
                f"distinct experts); got {self.num_experts_per_tok}",
            )
        if self.d_intermediate == 0:
            raise ConfigError(
                "d_intermediate",
                f"must be > 0 with num_experts={self.num_experts}: each expert is a gated MLP "
                "of that width (d_intermediate=0 means no MLP, so nothing to split into experts)",
            )
        if self.zamba2 is not None:
            raise ConfigError(
                "num_experts",
                f"must be 1 for a Zamba2 model (its shared blocks have one MLP); got "
                f"{self.num_experts}",
            )

    # --- the layers ---
    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts (JambaConfig.layers_num_experts > 1):
        i % expert_layer_period == expert_layer_offset, none when num_experts is 1."""
        if self.num_experts == 1:
            return []
        period, offset = self.expert_layer_period, self.expert_layer_offset
        return [i for i in range(self.n_layer) if i % period == offset]

    @property
    def mixers(self) -> list[str]:
        """The mixer of each layer: "mamba1", "mamba2", "mamba3", "s4d", "h3", "attn" (full causal
        attention) or "swa" (attention over the last attn_cfg.window_size positions)."""
        if self.layout is not None:
            return list(self.layout)
        attn = "swa" if (self.attn_cfg or {}).get("window_size") else "attn"
        base = "mamba1" if self.mixer in ("attn", "swa") else self.mixer
        return [attn if i in self.attn_layer_idx else base for i in range(self.n_layer)]

    @property
    def ssm_kinds(self) -> list[str]:
        """The SSM mixers the layers use, in :data:`SSM_MIXERS`' order (Zamba2: ["mamba2"])."""
        return [kind for kind in SSM_MIXERS if kind in self.mixers]

    def mixer_cfg(
        self, kind: str | None = None
    ) -> Mamba1Config | Mamba2Config | Mamba3Config | S4DConfig | H3Config:
        """The group of SSM mixer ``kind`` (``self.mamba1`` / ``mamba2`` / ``mamba3`` / ``s4d`` /
        ``h3``); without
        ``kind``, that of the one SSM mixer the layers use (an error for none or several)."""
        if kind is None:
            if len(self.ssm_kinds) != 1:
                raise ValueError(
                    f"the model's SSM layers are {self.ssm_kinds or 'none'}: name the "
                    f"mixer, mixer_cfg(kind) with kind one of {', '.join(SSM_MIXERS)}"
                )
            kind = self.ssm_kinds[0]
        if kind not in SSM_MIXERS:
            raise ValueError(f"mixer_cfg({kind!r}): valid SSM mixers: {', '.join(SSM_MIXERS)}")
        return getattr(self, kind)

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m

    def with_mixer(self, mixer: str) -> ModelConfig:
        """This model with its SSM layers made ``mixer`` layers of comparable size: the one rule for
        "the same model with another mixer" (notebook 01 compares Mamba-1, -2 and -3 with it).

        Everything else stays: width, depth, vocabulary, attention layers, MLPs, norms, and the
        knobs the old and the new mixer share (expand, so d_inner too; Δ's init range; conv width
        and biases; ...). The new mixer's state, head and chunk sizes are :func:`fair_sizes`' for
        that d_inner, its other knobs mamba_ssm's defaults. Each mixer so keeps the state size its
        paper pairs it with, and the blocks hold about the same number of parameters (Mamba-1's
        x_proj and dt_proj against the wider in_proj of Mamba-2 and Mamba-3; within 10%,
        tests/unit/models/test_config.py). A Zamba2 model's layers stay Mamba-2. H3 is refused
        either way: its layers are attention-sized, not Mamba-sized (:func:`fair_sizes`)."""
        if mixer not in SSM_MIXERS:
            raise ValueError(f"with_mixer({mixer!r}): valid SSM mixers: {', '.join(SSM_MIXERS)}")
        if mixer == "h3" or "h3" in self.ssm_kinds:
            raise ValueError(f"with_mixer({mixer!r}): {_H3_NOT_FAIR}")
        if not self.ssm_kinds:
            raise ValueError(
                f"the model has no SSM layer to make a {mixer} layer (its layers: "
                f"{sorted(set(self.mixers))})"
            )
        if self.zamba2 is not None and mixer != "mamba2":
            raise ValueError(
                f"a Zamba2 model's layers are Mamba-2 (its shared blocks are built "
                f"around them); got mixer={mixer!r}"
            )
        old = self.mixer_cfg(self.ssm_kinds[0]).to_dict()
        fair = fair_sizes(mixer, old["expand"] * self.d_model)
        kept = {f.name for f in dataclasses.fields(GROUPS[mixer])} - {
            "d_state",
            "headdim",
            "chunk_size",
        }
        group = GROUPS[mixer](**{k: v for k, v in old.items() if k in kept}, **fair)
        layout = None
        if self.layout is not None:
            layout = [mixer if m in SSM_MIXERS else m for m in self.layout]
        return dataclasses.replace(
            self,
            mixer=mixer if self.mixer in SSM_MIXERS else self.mixer,
            layout=layout,
            **{mixer: group},
        )

    # --- (de)serialisation and presets ---
    def to_dict(self) -> dict:
        """The fields as plain values, each group a nested mapping (YAML, JSON)."""
        d = {
            f.name: copy.deepcopy(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in SSM_MIXERS
        }
        return {**d, **{kind: getattr(self, kind).to_dict() for kind in SSM_MIXERS}}

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """A config from :meth:`to_dict`'s mapping, or in the short form (:func:`migrate_flat`)."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(valid) - set(GROUP_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown ModelConfig keys {unknown}; valid keys: {', '.join(valid)} "
                "(and, in the short form, a field of the mixer groups: "
                f"{', '.join(sorted(GROUP_FIELDS))})"
            )
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """A named configuration (see :data:`PRESETS`), with field overrides; an override of a group
        is merged into the preset's group (``mamba2={"d_state": 64}`` keeps its headdim)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
        base = PRESETS[name]
        merged = {**base, **overrides}
        for kind in SSM_MIXERS:
            if isinstance(base.get(kind), dict) and isinstance(overrides.get(kind), dict):
                merged[kind] = {**base[kind], **overrides[kind]}
        return cls.from_dict(merged)


_dataclass_init = ModelConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs):
    """The dataclass's __init__, which also takes the short form (a group's field given flat)."""
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    given = dict(zip(names, args))
    twice = sorted(set(given) & set(kwargs))
    if len(args) > len(names) or twice:
        raise TypeError(
            f"ModelConfig() got {len(args)} positional arguments"
            f"{f' and {twice} again as keywords' if twice else ''}"
        )
    _dataclass_init(self, **migrate_flat({**given, **kwargs}))


ModelConfig.__init__ = _init


def _mamba1(d_model, n_layer):
    # state-spaces/mamba-*: GPT-NeoX vocabulary 50277 padded to a multiple of 8
    return dict(
        d_model=d_model,
        n_layer=n_layer,
        vocab_size=50277,
        pad_vocab_size_multiple=8,
        mixer="mamba1",
        mamba1=dict(d_state=16, d_conv=4, expand=2),
    )


def _mamba2(d_model, n_layer):
    # state-spaces/mamba2-*: config.json has ssm_cfg {"layer": "Mamba2"} and pad_vocab_size_multiple
    # 16
    return dict(
        d_model=d_model,
        n_layer=n_layer,
        vocab_size=50277,
        pad_vocab_size_multiple=16,
        mixer="mamba2",
        mamba2=dict(d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=256),
    )


def _mamba3(d_model, n_layer):
    # No Mamba-3 checkpoint is published: mamba2-* sizes (GPT-3's widths and depths, GPT-NeoX
    # vocabulary padded to 16) with mamba_ssm's Mamba3 defaults (d_state 128, headdim 64,
    # rope_fraction 0.5, chunk 64)
    return dict(
        d_model=d_model,
        n_layer=n_layer,
        vocab_size=50277,
        pad_vocab_size_multiple=16,
        mixer="mamba3",
        mamba3=dict(d_state=128, expand=2, headdim=64, ngroups=1, chunk_size=64, rope_fraction=0.5),
    )


# fmt: off
PRESETS: dict[str, dict] = {
    # CPU-sized models for tests, demos and workshops (seconds per hundred steps)
    "tiny": dict(d_model=64, n_layer=4, vocab_size=256, mixer="mamba1", mamba1=dict(d_state=16)),
    # Zamba2 (Zyphra 2024): Mamba-2 layers and two shared attention+MLP blocks used in turn,
    # with adapters
    "tiny-zamba2": TINY_ZAMBA2,
    "tiny-mamba2": dict(d_model=64, n_layer=4, vocab_size=256, mixer="mamba2",
                        mamba2=dict(d_state=32, headdim=16, chunk_size=64)),
    "tiny-mamba3": dict(d_model=64, n_layer=4, vocab_size=256, mixer="mamba3",
                        mamba3=dict(d_state=32, headdim=16, chunk_size=64)),
    # the linear time-invariant mixers: S4D (Gu et al. 2022) and an H3 hybrid (Fu et al. 2022):
    # H3 blocks with an MLP each and attention in two layers, as the H3 paper's hybrid
    "tiny-s4d": dict(d_model=64, n_layer=4, vocab_size=256, mixer="s4d", s4d=dict(d_state=32)),
    "tiny-h3": dict(d_model=64, n_layer=4, vocab_size=256, mixer="h3", attn_layer_idx=[1, 3],
                    attn_cfg=dict(num_heads=4), d_intermediate=128,
                    h3=dict(d_state=16, head_dim=4, shift_size=4)),
    # Jamba-style hybrid (Lieber et al. 2024): one attention layer every attn_every layers at
    # attn_offset, Mamba-1 around it (Jamba's finding, which the plan follows: Mamba-1 + attention
    # beat Mamba-2 + attention). No positional embedding in the attention layers, as in Jamba:
    # the Mamba layers before them give order.
    "tiny-hybrid": dict(d_model=64, n_layer=4, vocab_size=256, mixer="mamba1",
                        mamba1=dict(d_state=16), attn_every=4, attn_offset=2,
                        attn_cfg=dict(num_heads=4)),
    # Mamba-1, Gu & Dao 2023, table 12 / the state-spaces/mamba-* checkpoints
    "mamba-130m": _mamba1(768, 24),
    "mamba-370m": _mamba1(1024, 48),
    "mamba-790m": _mamba1(1536, 48),
    "mamba-1.4b": _mamba1(2048, 48),
    "mamba-2.8b": _mamba1(2560, 64),
    # Mamba-2, Dao & Gu 2024 / the state-spaces/mamba2-* checkpoints
    "mamba2-130m": _mamba2(768, 24),
    "mamba2-370m": _mamba2(1024, 48),
    "mamba2-780m": _mamba2(1536, 48),
    "mamba2-1.3b": _mamba2(2048, 48),
    "mamba2-2.7b": _mamba2(2560, 64),
    # Mamba-3 (Lahoti et al. 2026) at mamba2-130m's size, ~130M parameters (sizes: see _mamba3)
    "mamba3-130m": _mamba3(768, 24),
    # the plan's stage-3 default: mamba-130m's 24 layers with attention every 8 (Jamba's period and
    # offset 4: layers 4, 12, 20), 12 heads of 64; Jamba's MLPs left out to stay at the 130M class
    "hybrid-130m": dict(_mamba1(768, 24), attn_every=8, attn_offset=4,
                        attn_cfg=dict(num_heads=12, qkv_proj_bias=False, out_proj_bias=False)),
}
# fmt: on


def presets() -> list[str]:
    """Names accepted by :meth:`ModelConfig.preset`."""
    return list(PRESETS)


__all__ = [
    "ConfigError",
    "H3Config",
    "LTI_MIXERS",
    "MAMBA_MIXERS",
    "MIXERS",
    "Mamba1Config",
    "Mamba2Config",
    "Mamba3Config",
    "ModelConfig",
    "PRESETS",
    "S4DConfig",
    "SSM_MIXERS",
    "fair_sizes",
    "migrate_flat",
    "presets",
]
