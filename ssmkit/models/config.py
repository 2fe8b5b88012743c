"""Model configuration and the presets of the plan.

Field names follow mamba_ssm's ``MambaConfig`` and its ``ssm_cfg`` (d_model, n_layer, vocab_size,
pad_vocab_size_multiple, d_state, d_conv, expand, headdim, ngroups, chunk_size, ...), so an
official ``config.json`` maps onto it one to one.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

from .. import checks
from .zamba2_config import TINY_ZAMBA2, Zamba2ConfigError, check_zamba2

MIXERS = ("mamba1", "mamba2", "mamba3", "attn", "swa")   # "swa": attention over the last attn_cfg.window_size
SSM_MIXERS = ("mamba1", "mamba2", "mamba3")
# mamba_ssm's Mamba / Mamba2 / Mamba3 defaults (d_state; Mamba3's chunk 64, the others' 256)
DEFAULT_D_STATE = {"mamba1": 16, "mamba2": 128, "mamba3": 128, "attn": 16, "swa": 16}
ROPE_FRACTIONS = (0.5, 1.0)           # mamba_ssm's Mamba3 asserts one of these
A_ACTIVATIONS = ("heavy_tail", "softplus")
# mamba_ssm's MHA arguments (modules/mha.py) and their defaults, but causal=True (mamba_ssm's default False
# trains a model that sees the future) and ssmkit's window_size (Samba's sliding window; None = full).
ATTN_DEFAULTS = dict(num_heads=None, num_heads_kv=None, head_dim=None, mlp_dim=0, qkv_proj_bias=True,
                     out_proj_bias=True, softmax_scale=None, causal=True, d_conv=0, rotary_emb_dim=0,
                     rotary_emb_base=10000.0, rotary_emb_interleaved=False, window_size=None)
INT_FIELDS = ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple", "d_state", "d_conv", "expand",
              "headdim", "ngroups", "chunk_size")
BOOL_FIELDS = ("tie_embeddings", "rms_norm", "residual_in_fp32", "rescale_prenorm_residual", "conv_bias",
               "bias", "D_has_hdim", "norm_before_gate", "mixer_rms_weights", "is_outproj_norm", "is_mimo")


def check_attn_cfg(attn_cfg: dict | None, d_model: int, needs_window: bool = False) -> dict:
    """``attn_cfg`` with every key of :data:`ATTN_DEFAULTS` filled in and checked; num_heads defaults to
    d_model / 64 (4 below d_model 256)."""
    cfg = dict(attn_cfg or {})
    unknown = sorted(set(cfg) - set(ATTN_DEFAULTS))
    if unknown:
        raise ConfigError("attn_cfg", f"has unknown keys {unknown}; valid keys: {', '.join(ATTN_DEFAULTS)}")
    cfg = {**ATTN_DEFAULTS, **cfg}
    if cfg["causal"] is not True:
        raise ConfigError("attn_cfg.causal", "must be true: a language model may not attend to later tokens "
                                             f"(mamba_ssm's MHA defaults to causal=False); "
                                             f"got {cfg['causal']!r}")
    if cfg["num_heads"] is None:
        cfg["num_heads"] = d_model // 64 if d_model >= 256 else 4
    field = lambda name, **kw: _field(f"attn_cfg.{name}", checks.integer, cfg[name], **kw)  # noqa: E731
    heads = cfg["num_heads"] = field("num_heads", minimum=1)
    cfg["num_heads_kv"] = kv = field("num_heads_kv", minimum=1) if cfg["num_heads_kv"] is not None else heads
    if heads % kv:
        raise ConfigError("attn_cfg.num_heads_kv", f"must divide num_heads={heads}; got {kv}")
    if cfg["head_dim"] is None and d_model % heads:
        raise ConfigError("attn_cfg.num_heads", f"must divide d_model={d_model} (or give head_dim); "
                                                f"got {heads}")
    head_dim = field("head_dim", minimum=1) if cfg["head_dim"] is not None else d_model // heads
    cfg["head_dim"] = head_dim
    for name in ("mlp_dim", "d_conv", "rotary_emb_dim"):
        cfg[name] = field(name, minimum=0)
    if cfg["rotary_emb_dim"] % 2 or cfg["rotary_emb_dim"] > head_dim:
        raise ConfigError("attn_cfg.rotary_emb_dim", f"must be even and <= head_dim={head_dim}; "
                                                     f"got {cfg['rotary_emb_dim']}")
    if cfg["window_size"] is not None:
        cfg["window_size"] = field("window_size", minimum=1)
    elif needs_window:
        raise ConfigError("attn_cfg.window_size", "is needed by the layout's 'swa' layers (sliding-window "
                                                  "attention over the last window_size positions)")
    for name in ("qkv_proj_bias", "out_proj_bias", "rotary_emb_interleaved"):
        if not isinstance(cfg[name], bool):
            raise ConfigError(f"attn_cfg.{name}", f"must be true or false; got {cfg[name]!r}")
    cfg["rotary_emb_base"] = _field("attn_cfg.rotary_emb_base", checks.number, cfg["rotary_emb_base"],
                                    low=0, low_open=True)
    if cfg["softmax_scale"] is not None:
        cfg["softmax_scale"] = _field("attn_cfg.softmax_scale", checks.number, cfg["softmax_scale"],
                                      low=0, low_open=True)
    return cfg


class ConfigError(ValueError):
    """A field of :class:`ModelConfig` with a value it cannot take; ``field`` names it (the hub maps it
    back to the name in a transformers config.json)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


def _field(name: str, check, value, **kwargs):
    """``check(value, name, **kwargs)`` from :mod:`ssmkit.checks`, its error as a ConfigError naming
    the field."""
    try:
        return check(value, name, **kwargs)
    except ValueError as exc:
        raise ConfigError(name, str(exc).removeprefix(f"{name} ")) from None


def _pair(name: str, value, low_min: float, low_strict: bool,
          high_may_be_inf: bool = False) -> tuple[float, float]:
    """``value`` as a (low, high) pair of numbers with low > low_min (or >= with ``low_strict=False``) and
    low <= high, else ConfigError naming ``name`` and the valid range."""
    pair = tuple(value) if isinstance(value, (list, tuple)) else ()
    finite = lambda v: checks.is_number(v) and math.isfinite(v)  # noqa: E731
    ok = (len(pair) == 2 and finite(pair[0])
          and (finite(pair[1]) or (high_may_be_inf and pair[1] == math.inf))
          and (pair[0] > low_min if low_strict else pair[0] >= low_min) and pair[0] <= pair[1])
    if not ok:
        bound = f"{'>' if low_strict else '>='} {low_min:g}"
        raise ConfigError(name, f"must be a pair (low, high) of numbers with low {bound} and low <= high"
                                f"{' (high may be inf)' if high_may_be_inf else ''}; got {value!r}")
    return float(pair[0]), float(pair[1])


@dataclass
class ModelConfig:
    # --- the language model ---
    d_model: int = 768                    # residual stream width
    n_layer: int = 24                     # number of blocks
    vocab_size: int = 50277               # tokenizer size (GPT-NeoX for the official models)
    pad_vocab_size_multiple: int = 8      # embedding rows rounded up to this (8 Mamba-1, 16 Mamba-2)
    mixer: str = "mamba1"                 # "mamba1" | "mamba2" | "mamba3" | "attn": every layer's mixer ...
    layout: list[str] | None = None       # ... unless given per layer, e.g. ["mamba3", "attn", "swa"]
    d_intermediate: int = 0               # GatedMLP width after each mixer (norm2 + mlp); 0 = no MLP
    attn_layer_idx: list[int] | None = None   # mamba_ssm: the layers that are attention (MHA) ...
    attn_every: int = 0                   # ... or every N-th (Jamba: i % N == attn_offset); 0 = none
    attn_offset: int = 0
    attn_cfg: dict | None = None          # mamba_ssm's MHA arguments, see ATTN_DEFAULTS (filled in)
    zamba2: dict | None = None            # Zamba2's shared attention blocks (zamba2_config.py); None = off
    tie_embeddings: bool = True           # LM head shares the embedding matrix
    rms_norm: bool = True                 # RMSNorm (True) or LayerNorm (False) before each mixer
    norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True         # keep the residual stream in fp32 under bf16/fp16
    initializer_range: float = 0.02       # std of the embedding init
    rescale_prenorm_residual: bool = True  # out_proj init scaled by 1/sqrt(n_layer) (GPT-2 style)

    # --- the SSM mixers (mamba_ssm's ssm_cfg) ---
    d_state: int | None = None            # N; None -> 16 for mamba1, 128 for mamba2 and mamba3
    d_conv: int = 4                       # width of the causal depthwise conv
    expand: int = 2                       # d_inner = expand * d_model
    dt_rank: int | str = "auto"           # mamba1: rank of the Δ projection; "auto" = ceil(d_model / 16)
    dt_min: float = 0.001                 # Δ is initialised log-uniform in [dt_min, dt_max]
    dt_max: float = 0.1
    dt_init: str = "random"               # mamba1: dt_proj.weight init, "random" | "constant"
    dt_scale: float = 1.0
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    bias: bool = False                    # bias of in_proj / out_proj
    mixer_rms_eps: float | None = None    # mamba1: FalconMamba's weightless RMSNorm on Δ, B, C (None: off)
    mixer_rms_weights: bool = False       # ... with learnable weights (Jamba's dt/b/c_layernorm)
    headdim: int = 64                     # mamba2/3: P, channels per head
    ngroups: int = 1                      # mamba2/3: B/C groups (like GQA's key/value groups)
    chunk_size: int | None = None         # mamba2/3: Q, the scan's chunk; None: 64 for mamba3 alone, else 256
    A_init_range: tuple[float, float] = (1.0, 16.0)   # mamba2: A = -U(A_init_range)
    dt_limit: tuple[float, float] = (0.0, math.inf)   # mamba2: Δ clamped to this range
    D_has_hdim: bool = False              # mamba2: D per channel (nheads, headdim) instead of per head
    norm_before_gate: bool = False        # mamba2: gated RMSNorm order (False in the official models)
    rope_fraction: float = 0.5            # mamba3: share of the state's dimensions rotated (0.5 or 1.0)
    A_floor: float = 1e-4                 # mamba3: the data-dependent A_t is at most -A_floor
    a_activation: str = "heavy_tail"      # mamba3: A_t = -f(a_t); "heavy_tail" (mamba_ssm since June 2026,
                                          # commit c69aaab) or "softplus" (before): different models
    is_outproj_norm: bool = False         # mamba3: gated RMSNorm per head before out_proj
    is_mimo: bool = False                 # mamba3: multi-input multi-output state update ...
    mimo_rank: int = 4                    # ... of this rank (mamba_ssm's default; 1 without is_mimo)

    def __post_init__(self):
        if self.mixer not in MIXERS:
            raise ValueError(f"mixer={self.mixer!r} is not supported; valid mixers: {', '.join(MIXERS)}")
        if self.d_state is None:
            self.d_state = DEFAULT_D_STATE[self.mixer]
        if self.chunk_size is None:
            kinds = set(self.layout) if isinstance(self.layout, (list, tuple)) else {self.mixer}
            self.chunk_size = 64 if "mamba3" in kinds and "mamba2" not in kinds else 256
        for name in INT_FIELDS:
            setattr(self, name, _field(name, checks.integer, getattr(self, name), minimum=1))
        for name in ("d_intermediate", "attn_every"):
            setattr(self, name, _field(name, checks.integer, getattr(self, name), minimum=0))
        self._resolve_attention_layers()
        if self.zamba2 is not None:
            try:
                self.zamba2 = check_zamba2(dict(self.zamba2), self.d_model, self.n_layer)
            except Zamba2ConfigError as exc:
                raise ConfigError(exc.field, str(exc).removeprefix(f"{exc.field} ")) from None
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false; got {getattr(self, name)!r}")
        if self.dt_rank != "auto":
            self.dt_rank = _field("dt_rank", checks.integer, self.dt_rank, minimum=1)
        _field("dt_init", checks.choice, self.dt_init, valid=("random", "constant"))
        # Float fields a typo can break silently: a zero epsilon or a non-positive A gives NaN logits,
        # dt_min > dt_max an empty init range. Each is checked against the range it is meaningful in.
        for name, positive in (("norm_epsilon", True), ("dt_init_floor", True), ("dt_scale", False),
                               ("initializer_range", False), ("mixer_rms_eps", True)):
            if name != "mixer_rms_eps" or self.mixer_rms_eps is not None:
                setattr(self, name, _field(name, checks.number, getattr(self, name),
                                           low=0, low_open=positive))
        # Δ init is log-uniform
        self.dt_min = _field("dt_min", checks.number, self.dt_min, low=0, low_open=True)
        self.dt_max = _field("dt_max", checks.number, self.dt_max, low=self.dt_min)
        if self.mixer_rms_weights and self.mixer_rms_eps is None:
            raise ConfigError("mixer_rms_weights", "needs mixer_rms_eps (the epsilon of the weighted norms)")
        self.A_init_range = _pair("A_init_range", self.A_init_range, 0, True)      # A = -U(low, high) < 0
        self.dt_limit = _pair("dt_limit", self.dt_limit, 0, False, high_may_be_inf=True)
        for kind in ("mamba2", "mamba3"):
            if kind in self.mixers or (kind == "mamba2" and self.zamba2 is not None):
                if self.d_inner % self.headdim:
                    raise ValueError(f"{kind} needs headdim to divide d_inner = expand * d_model = "
                                     f"{self.d_inner}; got headdim={self.headdim}")
                if self.nheads % self.ngroups:
                    raise ValueError(f"{kind} needs ngroups to divide nheads = {self.nheads}; "
                                     f"got ngroups={self.ngroups}")
        self._check_mamba3()

    def _check_mamba3(self):
        """Mamba-3's fields, checked always (a wrong value is wrong in any layout); its shape rules only when
        a layer is Mamba-3."""
        if isinstance(self.rope_fraction, bool) or self.rope_fraction not in ROPE_FRACTIONS:
            raise ConfigError("rope_fraction", f"must be one of {', '.join(map(str, ROPE_FRACTIONS))} "
                                               "(mamba_ssm's Mamba3 rotates half or all of the state); "
                                               f"got {self.rope_fraction!r}")
        self.rope_fraction = float(self.rope_fraction)
        self.a_activation = _field("a_activation", checks.choice, self.a_activation, valid=A_ACTIVATIONS)
        self.A_floor = _field("A_floor", checks.number, self.A_floor, low=0, low_open=True)
        self.mimo_rank = _field("mimo_rank", checks.integer, self.mimo_rank, minimum=1)
        if "mamba3" not in self.mixers:
            return
        if self.d_state % 2 or int(self.d_state * self.rope_fraction) < 2:
            raise ConfigError("d_state", f"must be even and at least {int(2 / self.rope_fraction)} for "
                                         "mamba3 (its rotations turn pairs of state dimensions); "
                                         f"got {self.d_state}")
        if self.bias:
            raise ConfigError("bias", "must be false for mamba3: mamba_ssm's Mamba3 has no in_proj / "
                                      "out_proj bias; got True")

    def _resolve_attention_layers(self):
        """One answer to "which layers are attention": ``layout`` names them; else ``attn_every`` (Jamba:
        layer i when i % attn_every == attn_offset) or mamba_ssm's ``attn_layer_idx``; else none (all when
        mixer is "attn"). ``attn_layer_idx`` is filled in, and given twice the answers must agree."""
        n, given = self.n_layer, self.attn_layer_idx
        if given is not None:
            given = list(given)
            if not all(checks.is_integer(i) and 0 <= i < n for i in given) or len(set(given)) != len(given):
                raise ConfigError("attn_layer_idx", f"must be distinct layer indices in 0..{n - 1}; "
                                                    f"got {given!r}")
            given = sorted(given)
        if self.attn_every:
            self.attn_offset = _field("attn_offset", checks.integer, self.attn_offset, minimum=0,
                                      maximum=self.attn_every - 1)
        if self.layout is not None:
            self.layout = list(self.layout)
            if len(self.layout) != n:
                raise ValueError(f"layout has {len(self.layout)} entries but n_layer={n}")
            bad = [m for m in self.layout if m not in MIXERS]
            if bad:
                raise ValueError(f"layout names unknown mixers {bad}; valid mixers: {', '.join(MIXERS)}")
            found = [i for i, m in enumerate(self.layout) if m in ("attn", "swa")]
        elif self.mixer in ("attn", "swa"):
            found = list(range(n))
        elif self.attn_every:
            found = [i for i in range(n) if i % self.attn_every == self.attn_offset]
        else:
            found = given or []
        for name, other in (("attn_layer_idx", given),
                            ("attn_every", [i for i in range(n) if i % self.attn_every == self.attn_offset]
                             if self.attn_every else None)):
            if other is not None and other != found:
                raise ConfigError(name, f"gives attention layers {other}, but the config's other fields give "
                                        f"{found}: set one of layout / attn_every / attn_layer_idx")
        self.attn_layer_idx = found
        if found or self.attn_cfg is not None:
            self.attn_cfg = check_attn_cfg(self.attn_cfg, self.d_model, needs_window="swa" in self.mixers)

    # --- derived sizes ---
    @property
    def mixers(self) -> list[str]:
        """The mixer of each layer: "mamba1", "mamba2", "mamba3", "attn" (full causal attention) or "swa"
        (attention over the last attn_cfg.window_size positions)."""
        if self.layout is not None:
            return list(self.layout)
        attn = "swa" if (self.attn_cfg or {}).get("window_size") else "attn"
        base = "mamba1" if self.mixer in ("attn", "swa") else self.mixer
        return [attn if i in self.attn_layer_idx else base for i in range(self.n_layer)]

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def dt_rank_value(self) -> int:
        return math.ceil(self.d_model / 16) if self.dt_rank == "auto" else self.dt_rank

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m

    # --- (de)serialisation and presets ---
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["A_init_range"], d["dt_limit"] = list(self.A_init_range), list(self.dt_limit)
        return copy.deepcopy(d)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; valid keys: {', '.join(valid)}")
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """A named configuration (see :data:`PRESETS`), with field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


def _mamba1(d_model, n_layer):
    # state-spaces/mamba-*: GPT-NeoX vocabulary 50277 padded to a multiple of 8
    return dict(d_model=d_model, n_layer=n_layer, vocab_size=50277, pad_vocab_size_multiple=8,
                mixer="mamba1", d_state=16, d_conv=4, expand=2)


def _mamba2(d_model, n_layer):
    # state-spaces/mamba2-*: config.json has ssm_cfg {"layer": "Mamba2"} and pad_vocab_size_multiple 16
    return dict(d_model=d_model, n_layer=n_layer, vocab_size=50277, pad_vocab_size_multiple=16,
                mixer="mamba2", d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=256)


def _mamba3(d_model, n_layer):
    # No Mamba-3 checkpoint is published: mamba2-* sizes (GPT-3's widths and depths, GPT-NeoX vocabulary
    # padded to 16) with mamba_ssm's Mamba3 defaults (d_state 128, headdim 64, rope_fraction 0.5, chunk 64)
    return dict(_mamba2(d_model, n_layer), mixer="mamba3", chunk_size=64, rope_fraction=0.5)


PRESETS: dict[str, dict] = {
    # CPU-sized models for tests, demos and workshops (seconds per hundred steps)
    "tiny": dict(d_model=64, n_layer=4, vocab_size=256, mixer="mamba1", d_state=16),
    # Zamba2 (Zyphra 2024): Mamba-2 layers and two shared attention+MLP blocks used in turn, with adapters
    "tiny-zamba2": TINY_ZAMBA2,
    "tiny-mamba2": dict(d_model=64, n_layer=4, vocab_size=256, mixer="mamba2", d_state=32, headdim=16,
                        chunk_size=64),
    "tiny-mamba3": dict(d_model=64, n_layer=4, vocab_size=256, mixer="mamba3", d_state=32, headdim=16,
                        chunk_size=64),
    # Jamba-style hybrid (Lieber et al. 2024): one attention layer every attn_every layers at attn_offset,
    # Mamba-1 around it (Jamba's finding, which the plan follows: Mamba-1 + attention beat Mamba-2 +
    # attention).
    # No positional embedding in the attention layers, as in Jamba: the Mamba layers before them give order.
    "tiny-hybrid": dict(d_model=64, n_layer=4, vocab_size=256, mixer="mamba1", d_state=16, attn_every=4,
                        attn_offset=2, attn_cfg=dict(num_heads=4)),
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
    # Mamba-3 (Lahoti et al. 2026) at mamba2-130m's size: ~130M parameters; see _mamba3 for the sizes' source
    "mamba3-130m": _mamba3(768, 24),
    # the plan's stage-3 default: mamba-130m's 24 layers with attention every 8 (Jamba's period and
    # offset 4: layers 4, 12, 20), 12 heads of 64; Jamba's MLPs left out to stay at the 130M class
    "hybrid-130m": dict(_mamba1(768, 24), attn_every=8, attn_offset=4,
                        attn_cfg=dict(num_heads=12, qkv_proj_bias=False, out_proj_bias=False)),
}


def presets() -> list[str]:
    """Names accepted by :meth:`ModelConfig.preset`."""
    return list(PRESETS)


__all__ = ["ConfigError", "ModelConfig", "PRESETS", "MIXERS", "presets"]
