"""The Zamba2-only fields of a :class:`~ssmkit.models.config.ModelConfig` (its ``zamba2`` dict).

Zamba2 (Zyphra; Glorioso et al. 2024, arXiv 2411.15242) is a stack of Mamba-2 layers; before the
Mamba layers listed in ``hybrid_layer_ids`` a *shared* transformer block (attention + gated MLP, one
of ``num_mem_blocks`` blocks, used in turn) reads concat(hidden, embeddings), and a per-layer
``linear`` adds its output to that Mamba layer's input. The Mamba-2 layers themselves take
ModelConfig's ``mamba2`` group (d_state, headdim, ngroups, expand, d_conv, chunk_size, dt_limit,
bias, conv_bias) and norm_epsilon.

Names follow transformers' ``Zamba2Config`` where it has them; ``hybrid_layer_ids`` is the list that
config derives from ``layers_block_type``; ``rope_theta`` is ``rope_parameters["rope_theta"]``;
``use_shared_mlp_adapter`` is Zyphra's original flag (transformers always builds the MLP adapters).
This module must not import :mod:`ssmkit.models.config` (that module imports this one).
"""

from __future__ import annotations

import math

from .. import checks
from ..ops.activations import ACTIVATIONS as _ACT_FNS

ACTIVATIONS = tuple(_ACT_FNS)  # hidden_act of the shared MLP: transformers' ACT2FN names

ZAMBA2_DEFAULTS: dict = dict(
    hybrid_layer_ids=None,  # required: the layers whose Mamba input gets the shared block
    num_mem_blocks=1,  # shared blocks used in turn: hybrid layer k uses block k % this
    num_attention_heads=32,  # heads of the shared attention; head_dim = 2 * d_model / heads
    num_key_value_heads=None,  # None = num_attention_heads (GQA when fewer)
    intermediate_size=None,  # shared MLP width; None = 4 * d_model
    hidden_act="gelu",  # y = down(act(gate) * up), see ACTIVATIONS
    add_bias_linear=False,  # biases of the shared MLP (transformers: also Mamba in/out_proj)
    adapter_rank=128,  # rank of the per-invocation (LoRA-like) adapters
    use_shared_attention_adapter=False,  # adapters on q, k, v of the shared attention
    use_shared_mlp_adapter=True,  # an adapter on the MLP's gate_up projection
    use_mem_rope=False,  # RoPE in the shared attention
    rope_theta=10000.0,  # RoPE base
)
_INT_FIELDS = ("num_mem_blocks", "num_attention_heads", "adapter_rank")
_BOOL_FIELDS = (
    "add_bias_linear",
    "use_shared_attention_adapter",
    "use_shared_mlp_adapter",
    "use_mem_rope",
)


class Zamba2ConfigError(ValueError):
    """A bad ``zamba2`` field; ``field`` names it as ``zamba2.<name>``."""

    def __init__(self, name: str, message: str):
        self.field = f"zamba2.{name}" if name else "zamba2"
        super().__init__(f"{self.field} {message}")


def _int(d: dict, name: str, minimum: int = 1) -> int:
    try:
        return checks.integer(d[name], name, minimum=minimum)
    except ValueError as exc:
        raise Zamba2ConfigError(name, str(exc).removeprefix(f"{name} ")) from None


def check_zamba2(d: dict, d_model: int, n_layer: int) -> dict:
    """``d`` with every field of :data:`ZAMBA2_DEFAULTS` (missing ones filled in), checked against
    the model's ``d_model`` and ``n_layer``; a bad field is a :class:`Zamba2ConfigError` (a
    ValueError) naming it and what is valid."""
    if not isinstance(d, dict):
        raise Zamba2ConfigError("", f"must be a dict of Zamba2 fields; got {type(d).__name__}")
    unknown = sorted(set(d) - set(ZAMBA2_DEFAULTS))
    if unknown:
        raise Zamba2ConfigError(
            unknown[0],
            f"is not a Zamba2 field (unknown {unknown}); "
            f"valid fields: {', '.join(ZAMBA2_DEFAULTS)}",
        )
    z = {**ZAMBA2_DEFAULTS, **d}
    ids = z["hybrid_layer_ids"]
    if (
        not isinstance(ids, (list, tuple))
        or not all(checks.is_integer(i) and 0 <= i < n_layer for i in ids)
        or list(ids) != sorted(set(ids))
    ):
        raise Zamba2ConfigError(
            "hybrid_layer_ids",
            f"must be a list of distinct layer indices in "
            f"[0, {n_layer}) in increasing order; got {ids!r}",
        )
    z["hybrid_layer_ids"] = [int(i) for i in ids]
    for name in _INT_FIELDS:
        z[name] = _int(z, name)
    for name in _BOOL_FIELDS:
        if not isinstance(z[name], bool):
            raise Zamba2ConfigError(name, f"must be true or false; got {z[name]!r}")
    heads = z["num_attention_heads"]
    if (2 * d_model) % heads:
        raise Zamba2ConfigError(
            "num_attention_heads",
            f"must divide 2 * d_model = {2 * d_model} (the shared attention reads "
            f"concat(hidden, embeddings)); got {heads}",
        )
    if z["num_key_value_heads"] is None:
        z["num_key_value_heads"] = heads
    z["num_key_value_heads"] = _int(z, "num_key_value_heads")
    if heads % z["num_key_value_heads"]:
        raise Zamba2ConfigError(
            "num_key_value_heads",
            f"must divide num_attention_heads = {heads}; got {z['num_key_value_heads']}",
        )
    if z["intermediate_size"] is None:
        z["intermediate_size"] = 4 * d_model
    z["intermediate_size"] = _int(z, "intermediate_size")
    if z["hidden_act"] not in ACTIVATIONS:
        raise Zamba2ConfigError(
            "hidden_act", f"must be one of {', '.join(ACTIVATIONS)}; got {z['hidden_act']!r}"
        )
    if z["use_mem_rope"] and (2 * d_model // heads) % 2:
        raise Zamba2ConfigError(
            "use_mem_rope",
            "needs an even head_dim = 2 * d_model / num_attention_heads;"
            f" got {2 * d_model // heads}",
        )
    theta = z["rope_theta"]
    if not (checks.is_number(theta) and math.isfinite(theta) and theta > 0):
        raise Zamba2ConfigError("rope_theta", f"must be a number > 0; got {theta!r}")
    z["rope_theta"] = float(theta)
    return z


# The CPU preset ``tiny-zamba2``: ModelConfig keyword arguments. Δ is clamped at dt_min (dt_limit
# low = dt_min), as transformers' Zamba2 clamps at time_step_min, so the model saves to that layout
# exactly.
TINY_ZAMBA2: dict = dict(
    d_model=64,
    n_layer=6,
    vocab_size=256,
    mixer="mamba2",
    residual_in_fp32=False,
    mamba2=dict(d_state=16, headdim=16, chunk_size=64, dt_limit=(0.001, math.inf)),
    zamba2=dict(
        hybrid_layer_ids=[1, 3, 5],
        num_mem_blocks=2,
        num_attention_heads=4,
        intermediate_size=128,
        adapter_rank=8,
        use_shared_attention_adapter=True,
        use_mem_rope=True,
    ),
)

__all__ = ["ACTIVATIONS", "TINY_ZAMBA2", "ZAMBA2_DEFAULTS", "Zamba2ConfigError", "check_zamba2"]
