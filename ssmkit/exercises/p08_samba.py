"""The exercises of papers/08_samba.ipynb (Samba): an SWA layer's cache against full attention's,
and what doubling the window adds."""

from __future__ import annotations

from . import exercise


def _swa_layer(window: int):
    """One SWA layer: 32 KV heads of 96 channels, window ``window`` (a config, nothing built)."""
    from ssmkit.models import ModelConfig

    return ModelConfig(d_model=32 * 96, n_layer=1, vocab_size=32, layout=["swa"],
                       attn_cfg={"num_heads": 32, "window_size": window})  # fmt: skip


@exercise(
    "p08.1",
    "an SWA layer's cache",
    ("swa_layer", "full_layer"),
    wrong={"swa_layer": 2048 * 32 * 96 * 2, "full_layer": 256 * 1024 * 32 * 96 * 2},
)
def _(swa_layer, full_layer):
    """Bytes of one bf16 SWA layer's cache at W = 2048 and a full-attention layer's at L = 256K
    (note.cache_formula: a window as long as the sequence is full attention), exactly."""
    from ssmkit.papers import p08_samba as note

    want = note.cache_formula(_swa_layer(2048), bytes_per=2)
    if swa_layer != want:
        side = "too many" if swa_layer > want else "too few"
        return f"swa_layer is {side} bytes: W tokens of keys and values, 32 heads of 96, 2 bytes"
    full = note.cache_formula(_swa_layer(256 * 1024), bytes_per=2)
    if full_layer != full:
        side = "too many" if full_layer > full else "too few"
        return f"full_layer is {side} bytes: the same per token, for all L = 256K tokens"
    return None


@exercise(
    "p08.2",
    "what doubling the window adds",
    ("three", "wide", "extra"),
    wrong={"three": None, "wide": None, "extra": 3 * 2 * 16 * 2 * 16 * 4},
)
def _(three, wide, extra):
    """``extra`` = note.cache_formula(wide) - note.cache_formula(three) for three Samba units,
    ``wide`` the window doubled, equal to the SWA layers' share: K and V of the added slots."""
    from ssmkit.papers import p08_samba as note

    base = note.samba_config(units=3)
    a = base.attn_cfg
    n_swa = base.mixers.count("swa")
    want = n_swa * 2 * a["window_size"] * a["num_heads_kv"] * a["head_dim"] * 4  # fp32
    if extra != want:
        side = "too large" if extra > want else "too small"
        return f"extra is {side}: only the SWA layers grow, by K and V of the added window slots"
    for name, cfg, window in (("three", three, a["window_size"]),
                              ("wide", wide, 2 * a["window_size"])):  # fmt: skip
        if getattr(cfg, "mixers", None) != base.mixers:
            return f"{name} should be note.samba_config(units=3, ...): three Samba units"
        if cfg.attn_cfg.get("window_size") != window:
            return f"{name}'s window is {cfg.attn_cfg.get('window_size')}, not {window}"
    if note.cache_formula(wide) - note.cache_formula(three) != extra:
        return "extra is not cache_formula(wide) - cache_formula(three)"
    return None
