"""The knobs of each SSM mixer, one dataclass per mixer, as mamba_ssm's ``ssm_cfg`` holds them.

A :class:`~ssmkit.models.config.ModelConfig` has one of each (``cfg.mamba1``, ``cfg.mamba2``,
``cfg.mamba3``, ``cfg.s4d``, ``cfg.h3``); a layer reads only the group of its own mixer
(``Mamba2(d_model, cfg.mamba2)``). The fields of a group are the arguments of mamba_ssm's class for
that mixer (``Mamba`` in modules/mamba_simple.py, ``Mamba2``, ``Mamba3``) with its defaults, plus a
few of ssmkit's (marked); for S4D those of state-spaces' standalone ``s4d.py``, for H3 those of
HazyResearch/H3's ``H3`` and its kernels.

Each group checks its own fields; an error is a :class:`ConfigError` naming the field as
``mamba2.headdim``. What depends on the model's width (headdim dividing d_inner, ...) ModelConfig
checks for the mixers its layers use. Sizes derived from the width take it as an argument, as
mamba_ssm's classes take ``d_model`` beside ``ssm_cfg``: ``cfg.mamba2.d_inner(cfg.d_model)``,
``nheads(d_model)``, ``cfg.mamba1.dt_rank_value(d_model)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from .. import checks
from ..ops.activations import activation
from ..ops.hippo import S4D_INITS
from ..ops.lti import METHODS as DISCRETIZATIONS
from ..ops.mamba3_ref import A_ACTIVATIONS

ROPE_FRACTIONS = (0.5, 1.0)  # mamba_ssm's Mamba3 asserts one of these
DT_INITS = ("random", "constant")


class ConfigError(ValueError):
    """A field of a model config with a value it cannot take; ``field`` names it (``d_model``,
    ``mamba2.headdim``, ``attn_cfg.num_heads``; the hub maps it back to a config.json's name)."""

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


def _pair(
    name: str, value, low_min: float, low_strict: bool, high_may_be_inf: bool = False
) -> tuple[float, float]:
    """``value`` as a (low, high) pair of numbers with low > low_min (>= with ``low_strict=False``)
    and low <= high, else ConfigError naming ``name`` and the valid range."""
    pair = tuple(value) if isinstance(value, (list, tuple)) else ()
    finite = lambda v: checks.is_number(v) and math.isfinite(v)  # noqa: E731
    ok = (
        len(pair) == 2
        and finite(pair[0])
        and (finite(pair[1]) or (high_may_be_inf and pair[1] == math.inf))
        and (pair[0] > low_min if low_strict else pair[0] >= low_min)
        and pair[0] <= pair[1]
    )
    if not ok:
        bound = f"{'>' if low_strict else '>='} {low_min:g}"
        raise ConfigError(
            name,
            f"must be a pair (low, high) of numbers with low {bound} and "
            f"low <= high{' (high may be inf)' if high_may_be_inf else ''}; "
            f"got {value!r}",
        )
    return float(pair[0]), float(pair[1])


class _MixerConfig:
    """What the groups share: the checks of their common fields and the sizes derived from the
    model's width."""

    kind: ClassVar[str]

    def _name(self, field: str) -> str:
        return f"{self.kind}.{field}"

    def _int(self, field: str, minimum: int = 1):
        setattr(
            self,
            field,
            _field(self._name(field), checks.integer, getattr(self, field), minimum=minimum),
        )

    def _bool(self, field: str):
        if not isinstance(getattr(self, field), bool):
            raise ConfigError(
                self._name(field), f"must be true or false; got {getattr(self, field)!r}"
            )

    def _positive(self, field: str, strict: bool = True):
        setattr(
            self,
            field,
            _field(self._name(field), checks.number, getattr(self, field), low=0, low_open=strict),
        )

    def _check_common(self):
        """d_state, expand, and Δ's init range [dt_min, dt_max] with 0 < dt_min (log-uniform)."""
        for field in ("d_state", "expand"):
            self._int(field)
        self._positive("dt_init_floor")
        self._positive("dt_min")
        self.dt_max = _field(self._name("dt_max"), checks.number, self.dt_max, low=self.dt_min)

    def d_inner(self, d_model: int) -> int:
        """The expanded width E·d_model the mixer works in (D in Gu & Dao 2023, section 3)."""
        return self.expand * d_model

    def to_dict(self) -> dict:
        """The fields as plain values (pairs as lists), as YAML and JSON write them."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }


class _HeadsConfig(_MixerConfig):
    """Mamba-2 and Mamba-3: heads of ``headdim`` channels, B and C shared by ``ngroups`` groups."""

    def nheads(self, d_model: int) -> int:
        """H = d_inner / headdim."""
        return self.d_inner(d_model) // self.headdim

    def check_width(self, d_model: int):
        """headdim must divide d_inner, and ngroups the number of heads."""
        if self.d_inner(d_model) % self.headdim:
            raise ConfigError(
                self._name("headdim"),
                f"must divide d_inner = expand * d_model = "
                f"{self.d_inner(d_model)}; got {self.headdim}",
            )
        if self.nheads(d_model) % self.ngroups:
            raise ConfigError(
                self._name("ngroups"),
                f"must divide nheads = d_inner / headdim = "
                f"{self.nheads(d_model)}; got {self.ngroups}",
            )


@dataclass
class Mamba1Config(_MixerConfig):
    """mamba_ssm's ``Mamba`` (Gu & Dao 2023), and the norms on Δ, B, C of FalconMamba and Jamba."""

    kind: ClassVar[str] = "mamba1"
    d_state: int = 16  # N, state size per channel
    d_conv: int = 4  # W, width of the causal depthwise conv
    expand: int = 2  # E: d_inner = expand * d_model
    dt_rank: int | str = "auto"  # R, rank of the Δ projection; "auto" = ceil(d_model / 16)
    dt_min: float = 0.001  # Δ is initialised log-uniform in [dt_min, dt_max] ...
    dt_max: float = 0.1
    dt_init: str = "random"  # dt_proj.weight init, "random" (uniform) | "constant" ...
    dt_scale: float = 1.0  # ... of scale dt_rank^-1/2 * dt_scale
    dt_init_floor: float = 1e-4  # ... and Δ at least this
    conv_bias: bool = True
    bias: bool = False  # bias of in_proj / out_proj
    mixer_rms_eps: float | None = None  # ssmkit: FalconMamba's weightless RMSNorm on Δ, B, C ...
    mixer_rms_weights: bool = False  # ... with learnable weights (Jamba's dt/b/c_layernorm)
    activation: str = "silu"  # after the conv (mamba_ssm's Mamba.activation; Jamba: hidden_act),
    # a name in ssmkit.ops.ACTIVATIONS (transformers' ACT2FN names); the gate z keeps SiLU

    def __post_init__(self):
        self._check_common()
        self._int("d_conv")
        _field(self._name("activation"), activation, self.activation)  # a known name
        for field in ("conv_bias", "bias", "mixer_rms_weights"):
            self._bool(field)
        if self.dt_rank != "auto":
            self._int("dt_rank")
        _field(self._name("dt_init"), checks.choice, self.dt_init, valid=DT_INITS)
        self._positive("dt_scale", strict=False)
        if self.mixer_rms_eps is not None:
            self._positive("mixer_rms_eps")
        elif self.mixer_rms_weights:
            raise ConfigError(
                self._name("mixer_rms_weights"),
                "needs mixer_rms_eps (the epsilon of the weighted norms)",
            )

    def dt_rank_value(self, d_model: int) -> int:
        """R: dt_rank, or ceil(d_model / 16) for "auto"."""
        return math.ceil(d_model / 16) if self.dt_rank == "auto" else self.dt_rank


@dataclass
class Mamba2Config(_HeadsConfig):
    """mamba_ssm's ``Mamba2`` (Dao & Gu 2024): the SSD scan over chunks, a scalar A per head."""

    kind: ClassVar[str] = "mamba2"
    d_state: int = 128  # N, state size per head
    d_conv: int = 4  # W, width of the causal depthwise conv over x, B, C
    expand: int = 2  # E: d_inner = expand * d_model
    headdim: int = 64  # P, channels per head: nheads = d_inner / headdim
    ngroups: int = 1  # G, groups of heads sharing B and C (as GQA's key/values)
    chunk_size: int = 256  # Q, the SSD scan's chunk
    A_init_range: tuple[float, float] = (1.0, 16.0)  # A = -U(A_init_range)
    dt_min: float = 0.001  # Δ is initialised log-uniform in [dt_min, dt_max] ...
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4  # ... and at least this
    dt_limit: tuple[float, float] = (0.0, math.inf)  # Δ clamped to this range
    conv_bias: bool = True
    bias: bool = False  # bias of in_proj / out_proj
    D_has_hdim: bool = False  # D per channel (nheads, headdim) instead of per head
    norm_before_gate: bool = False  # gated RMSNorm order (False in the official models)

    def __post_init__(self):
        self._check_common()
        for field in ("d_conv", "headdim", "ngroups", "chunk_size"):
            self._int(field)
        for field in ("conv_bias", "bias", "D_has_hdim", "norm_before_gate"):
            self._bool(field)
        self.A_init_range = _pair(self._name("A_init_range"), self.A_init_range, 0, True)  # A < 0
        self.dt_limit = _pair(self._name("dt_limit"), self.dt_limit, 0, False, high_may_be_inf=True)


@dataclass
class Mamba3Config(_HeadsConfig):
    """mamba_ssm's ``Mamba3`` (Lahoti et al. 2026): no conv, no A_log, no in_proj / out_proj bias; a
    data-dependent A_t, the exponential-trapezoidal update and rotations of B and C."""

    kind: ClassVar[str] = "mamba3"
    d_state: int = 128  # N, state size per head (even: rotations turn pairs)
    expand: int = 2  # E: d_inner = expand * d_model
    headdim: int = 64  # P, channels per head: nheads = d_inner / headdim
    ngroups: int = 1  # G, groups of heads sharing B and C
    chunk_size: int | None = None  # Q; None: 64 (mamba_ssm's), or mamba2.chunk_size in a
    # model with Mamba-2 layers too (ModelConfig fills it in)
    dt_min: float = 0.001  # Δ is initialised log-uniform in [dt_min, dt_max] ...
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4  # ... and at least this
    rope_fraction: float = 0.5  # share of the state's dimensions rotated (0.5 or 1.0)
    A_floor: float = 1e-4  # the data-dependent A_t is at most -A_floor
    a_activation: str = "heavy_tail"  # ssmkit: A_t = -f(a_t), "heavy_tail" (mamba_ssm's) or
    # "softplus" (its earlier versions): different models
    is_outproj_norm: bool = False  # gated RMSNorm per head before out_proj
    is_mimo: bool = False  # multi-input multi-output state update ...
    mimo_rank: int = 4  # ... of this rank R (mamba_ssm's; 1 without is_mimo)

    def __post_init__(self):
        self._check_common()
        for field in ("headdim", "ngroups", "mimo_rank"):
            self._int(field)
        if self.chunk_size is not None:
            self._int("chunk_size")
        for field in ("is_outproj_norm", "is_mimo"):
            self._bool(field)
        if isinstance(self.rope_fraction, bool) or self.rope_fraction not in ROPE_FRACTIONS:
            raise ConfigError(
                self._name("rope_fraction"),
                f"must be one of {', '.join(map(str, ROPE_FRACTIONS))} (mamba_ssm's "
                "Mamba3 rotates half or all of the state); "
                f"got {self.rope_fraction!r}",
            )
        self.rope_fraction = float(self.rope_fraction)
        self.a_activation = _field(
            self._name("a_activation"), checks.choice, self.a_activation, valid=A_ACTIVATIONS
        )
        self._positive("A_floor")
        if self.d_state % 2 or int(self.d_state * self.rope_fraction) < 2:
            raise ConfigError(
                self._name("d_state"),
                f"must be even and at least {int(2 / self.rope_fraction)} for mamba3 "
                f"(its rotations turn pairs of state dimensions); got {self.d_state}",
            )


class _LTIConfig(_MixerConfig):
    """S4D and H3: a diagonal SSM of N/2 complex modes per channel (or head), initialised by one of
    S4D's rules, discretised by ``disc``, with Δ log-uniform in [dt_min, dt_max]."""

    def _check_lti(self):
        self._int("d_state", minimum=2)
        if self.d_state % 2:
            raise ConfigError(
                self._name("d_state"),
                f"must be even: N/2 complex modes (each with its conjugate) make a real state of "
                f"size N; got {self.d_state}",
            )
        _field(self._name("init"), checks.choice, self.init, valid=S4D_INITS)
        _field(self._name("disc"), checks.choice, self.disc, valid=DISCRETIZATIONS)
        self._positive("dt_min")
        self.dt_max = _field(self._name("dt_max"), checks.number, self.dt_max, low=self.dt_min)


@dataclass
class S4DConfig(_LTIConfig):
    """S4D (Gu, Gupta, Goel & Ré 2022, arXiv 2206.11893): H independent diagonal SSMs run as one
    long convolution, as state-spaces' standalone ``s4d.py``, between ssmkit's projections."""

    kind: ClassVar[str] = "s4d"
    d_state: int = 64  # N, the real state size per channel: N/2 complex modes (even)
    expand: int = 2  # ssmkit: in_proj widens d_model to H = expand * d_model channels
    init: str = "lin"  # A's init: "lin" (S4D-Lin, s4d.py's) | "inv" | "legs" | "random" (ablation)
    disc: str = "zoh"  # Ā, B̄ from A and Δ: "zoh" (s4d.py's) | "bilinear" (S4's)
    dt_min: float = 0.001  # Δ is initialised log-uniform in [dt_min, dt_max]
    dt_max: float = 0.1
    bias: bool = True  # of in_proj / out_proj (s4d.py's output_linear has one)

    def __post_init__(self):
        self._check_lti()
        self._int("expand")
        self._bool("bias")


@dataclass
class H3Config(_LTIConfig):
    """H3 (Fu, Dao, Saab, Thomas, Rudra & Ré 2022, arXiv 2212.14052): a shift SSM on the keys, a
    diagonal SSM per head on their product with the values, read out by the queries; the arguments
    of HazyResearch/H3's ``H3`` with its defaults (its LM's ``ssm_cfg``: S4D-Lin, bilinear)."""

    kind: ClassVar[str] = "h3"
    d_state: int = 64  # N, the diagonal SSM's real state size per head entry (even)
    head_dim: int = 1  # channels per head: nheads = d_model / head_dim, each keeps a
    # head_dim x head_dim outer product k vᵀ, every entry an SSM of N/2 complex modes
    shift_size: int = 64  # the shift SSM's state size = its kernel's taps (the H3 code's: d_state)
    init: str = "lin"  # the diagonal SSM's A: "lin" (H3's "diag-lin") | "inv" | "legs" | "random"
    disc: str = "bilinear"  # H3's diagonal kernel default | "zoh"
    dt_min: float = 0.001  # Δ is initialised log-uniform in [dt_min, dt_max]
    dt_max: float = 0.1

    def __post_init__(self):
        self._check_lti()
        for field in ("head_dim", "shift_size"):
            self._int(field)

    def nheads(self, d_model: int) -> int:
        """H = d_model / head_dim."""
        return d_model // self.head_dim

    def check_width(self, d_model: int):
        """head_dim must divide d_model."""
        if d_model % self.head_dim:
            raise ConfigError(
                self._name("head_dim"), f"must divide d_model = {d_model}; got {self.head_dim}"
            )


GROUPS: dict[str, type] = {
    "mamba1": Mamba1Config,
    "mamba2": Mamba2Config,
    "mamba3": Mamba3Config,
    "s4d": S4DConfig,
    "h3": H3Config,
}
# every field name of any group, and the groups that have it (the flat short form maps through this)
GROUP_FIELDS: dict[str, tuple[str, ...]] = {}
for _kind, _cls in GROUPS.items():
    for _f in dataclasses.fields(_cls):
        GROUP_FIELDS[_f.name] = (*GROUP_FIELDS.get(_f.name, ()), _kind)


def make_group(kind: str, value) -> _MixerConfig:
    """The group of mixer ``kind`` from a group, a mapping of its fields (YAML, JSON) or None (the
    defaults); unknown keys are a ConfigError listing the valid ones."""
    cls = GROUPS[kind]
    if value is None:
        return cls()
    if isinstance(value, cls):
        return dataclasses.replace(value)  # a copy: configs never share a group
    if not isinstance(value, dict):
        raise ConfigError(
            kind, f"must be a {cls.__name__} or a mapping of its fields; got {type(value).__name__}"
        )
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise ConfigError(
            f"{kind}.{unknown[0]}",
            f"is not a {kind} field (unknown {unknown}); valid keys of {kind}: {', '.join(valid)}",
        )
    return cls(**value)


__all__ = [
    "ConfigError",
    "GROUPS",
    "GROUP_FIELDS",
    "H3Config",
    "Mamba1Config",
    "Mamba2Config",
    "Mamba3Config",
    "S4DConfig",
    "ROPE_FRACTIONS",
    "make_group",
]
