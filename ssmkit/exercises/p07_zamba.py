"""The exercises of papers/07_zamba.ipynb (Zamba): what sharing the block saves, and the adapter
rank at which a use costs a whole block."""

from __future__ import annotations

from . import exercise


@exercise(
    "p07.1",
    "what sharing saves",
    ("block", "saved_big"),
    wrong={"block": 3 * 2560 * 4 * 2560, "saved_big": 9 * 3 * 2560 * 4 * 2560},
)
def _(block, saved_big):
    """One shared block's parameters (note.block_numel of a Zamba2 config with d = 2560, 32 heads,
    I = 4d) and what 2 blocks used at 9 places save against a block per use, exactly."""
    from ssmkit.models import ModelConfig
    from ssmkit.papers import p07_zamba as note

    d, inter = 2560, 4 * 2560
    z = dict(hybrid_layer_ids=[1], num_attention_heads=32, intermediate_size=inter)
    big = ModelConfig(d_model=d, n_layer=2, vocab_size=32, mixer="mamba2", d_intermediate=0,
                      residual_in_fp32=False, zamba2=z)  # fmt: skip
    want = note.block_numel(big)
    if block != want:
        side = "too many" if block > want else "too few"
        return (
            f"block counts {side} parameters: the attention runs on the concatenation (width 2d), "
            "then a gated MLP of width I, and the norms"
        )
    if saved_big != (9 - 2) * want:
        return "saved_big is off: blocks a use-per-block model holds, minus the shared ones"
    return None


@exercise("p07.2", "the rank where a use costs a block", ("r",), wrong={"r": 1})
def _(r):
    """The smallest adapter rank r with note.per_use_numel >= note.block_numel (recipe config)."""
    from ssmkit.papers import p07_zamba as note

    full = note.block_numel(note.zamba_config())
    if not isinstance(r, int) or r < 1:
        return "r should be a whole rank, 1 or more"
    if note.per_use_numel(note.zamba_config(adapter_rank=r)) < full:
        return f"at rank {r} a use still costs less than a block: a larger rank"
    if r > 1 and note.per_use_numel(note.zamba_config(adapter_rank=r - 1)) >= full:
        return f"rank {r - 1} already reaches a block: the smallest such rank is below {r}"
    return None
