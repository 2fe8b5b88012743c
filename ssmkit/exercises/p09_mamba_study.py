"""The exercises of papers/09_mamba_study.ipynb (the Mamba study): how many attention layers make
7%, and a 12-block hybrid's shares."""

from __future__ import annotations

from . import exercise


def _seven_percent(layers: int) -> list[int]:
    """The attention counts whose share of ``layers`` (mixers and MLPs: one MLP per mixer) rounds
    to 7%, read with note.shares."""
    from collections import Counter

    from ssmkit.papers import p09_mamba_study as note

    blocks = layers // 2
    return [
        a
        for a in range(1, blocks)
        if round(100 * note.shares(Counter(attn=a, mamba2=blocks - a, mlp=blocks))["attn"]) == 7
    ]


@exercise(
    "p09.1",
    "attention layers for a 7% share",
    ("attn_56", "attn_42"),
    wrong={"attn_56": [7], "attn_42": [7]},
)
def _(attn_56, attn_42):
    """The attention counts that round to a 7% share of 56 and of 42 layers (lists, exactly)."""
    for name, got, layers in (("attn_56", attn_56, 56), ("attn_42", attn_42, 42)):
        want = _seven_percent(layers)
        if not isinstance(got, (list, tuple)) or list(got) != want:
            return (
                f"{name} is off: the share is attention layers over all {layers} layers "
                "(mixers and MLPs), rounded to a whole percent; list every count that gives 7"
            )
    return None


@exercise(
    "p09.2",
    "a 12-block hybrid's shares",
    ("layout", "small"),
    wrong={"layout": ["mamba2"] * 12, "small": None},
)
def _(layout, small):
    """``layout``: attention at blocks 2 and 8 of 12, Mamba-2 elsewhere; ``small`` built has the
    layer counts note.layer_counts gives for it: 10 Mamba-2, 2 attention, 12 MLPs."""
    from collections import Counter

    from ssmkit.models import build_model
    from ssmkit.papers import p09_mamba_study as note

    attn = [i for i, kind in enumerate(layout) if kind == "attn"] if layout else []
    if len(layout or []) != 12 or attn != [2, 8]:
        return 'layout should list 12 blocks\' mixers, with "attn" at blocks 2 and 8 (from 0)'
    if getattr(small, "layout", None) != list(layout):
        return "small should be a ModelConfig with layout=layout"
    got = note.layer_counts(build_model(small))
    want = Counter(layout) + Counter(mlp=len(layout))
    if got != want:
        return f"small builds {dict(got)}: give every block an MLP (d_intermediate > 0)"
    return None
