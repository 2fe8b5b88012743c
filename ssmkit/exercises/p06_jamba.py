"""The exercises of papers/06_jamba.ipynb (Jamba): the expert parameters a token leaves unused, and
the KV cache of a denser attention layout."""

from __future__ import annotations

from . import exercise


@exercise(
    "p06.1",
    "expert parameters a token does not use",
    ("unused", "small_unused"),
    wrong={"unused": 2 * 3 * 4096 * 14336, "small_unused": 0},
)
def _(unused, small_unused, moe=None):
    """``small_unused`` against ``moe.inactive_numel()`` (``moe``: section 2's SparseMoE, default
    note.random_moe()'s), and ``unused`` against a SparseMoE(4096, 14336, 16, 2) built on the meta
    device (no memory), exactly."""
    import torch

    from ssmkit.models import SparseMoE
    from ssmkit.papers import p06_jamba as note

    moe = note.random_moe(seed=0)[0] if moe is None else moe
    if small_unused != moe.inactive_numel():
        return "small_unused is off: the experts a token skips (E - k), times one expert's size"
    with torch.device("meta"):
        want = SparseMoE(4096, 14336, 16, 2).inactive_numel()
    if unused != want:
        side = "too many" if unused > want else "too few"
        return f"unused is {side}: (E - k) experts, each three d_model x d_intermediate matrices"
    return None


@exercise(
    "p06.2",
    "a 1:3 layout's KV cache",
    ("denser", "factor"),
    wrong={"denser": None, "factor": 7 / 3},
)
def _(denser, factor, cfg=None):
    """``factor`` = KV cache at 256K of ``denser`` (attention at i mod 4 = 2) over ``cfg``'s (the
    released config, default note.released_config()), exactly as note.cache_bytes gives it."""
    from ssmkit.papers import p06_jamba as note

    cfg = note.released_config() if cfg is None else cfg
    rule = [i for i in range(cfg.n_layer) if i % 4 == 2]
    want = len(rule) / len(cfg.attn_layer_idx)  # the KV part grows with the attention layers
    if factor != want:
        side = "too large" if factor > want else "too small"
        return f"factor is {side}: only the attention layers' cache grows with L; count them"
    if getattr(denser, "attn_layer_idx", None) != rule:
        return "denser should be the released config with attention at i mod 4 = 2 (8 layers)"
    kv = lambda c: note.cache_bytes(c, 262144) - note.cache_bytes(c, 0)  # noqa: E731
    if kv(denser) / kv(cfg) != want:
        return "denser's KV cache is not the released one's times the attention layers' ratio"
    return None
