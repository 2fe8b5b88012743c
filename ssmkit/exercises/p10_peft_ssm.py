"""The exercises of papers/10_peft_ssm.ipynb (PEFT for SSMs): LoRA parameters on x_proj and dt_proj
by hand, and LoRA on out_proj only."""

from __future__ import annotations

import torch

from . import exercise


@exercise(
    "p10.1",
    "LoRA parameters on x_proj and dt_proj",
    ("x_proj", "dt_proj"),
    wrong={"x_proj": 8 * (1536 + 48), "dt_proj": 8 * 48 * 1536},
)
def _(x_proj, dt_proj):
    """Rank-8 LoRA parameters on one Mamba-1 layer's x_proj and dt_proj (d_model 768, N 16) by
    note.adapter_size on a layer built on the meta device (no memory), exactly."""
    from ssmkit.models import ModelConfig, build_model
    from ssmkit.papers import p10_peft_ssm as note

    cfg = ModelConfig(d_model=768, n_layer=1, vocab_size=32, mixer="mamba1",
                      mamba1={"d_state": 16})  # fmt: skip
    with torch.device("meta"):
        layer = build_model(cfg).backbone.layers[0].mixer
    for name, got, shape in (("x_proj", x_proj, "d_inner -> R + 2N"),
                             ("dt_proj", dt_proj, "R -> d_inner")):  # fmt: skip
        want = note.adapter_size(layer, {name: 8})
        if got != want:
            side = "too many" if got > want else "too few"
            return f"{name} is {side}: LoRA trains r·(in + out) for a matrix {shape}"
    return None


@exercise(
    "p10.2",
    "LoRA on out_proj only",
    ("only_out",),
    wrong={"only_out": torch.nn.Linear(64, 32)},  # a model without LoRA: everything trains
)
def _(only_out):
    """``only_out`` (note.with_lora on the note's base model) trains exactly note.adapter_size of
    rank 4 on out_proj, and nothing outside out_proj's adapters."""
    from ssmkit.models import ModelConfig, build_model
    from ssmkit.papers import p10_peft_ssm as note

    if not isinstance(only_out, torch.nn.Module):
        return "only_out should be the model note.with_lora returns"
    want = note.adapter_size(build_model(ModelConfig(**note.BASE_MODEL)), {"out_proj": 4})
    got = note.trainable(only_out)
    if got != want:
        side = "more" if got > want else "fewer"
        return f"only_out trains {got} parameters, {side} than rank-4 LoRA on out_proj alone"
    stray = [n for n, p in only_out.named_parameters() if p.requires_grad and "out_proj" not in n]
    if stray:
        return f"{stray[0]} trains too: put LoRA on out_proj only"
    return None
