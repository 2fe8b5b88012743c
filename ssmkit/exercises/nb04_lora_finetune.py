"""The exercises of notebooks/04_lora_finetune.ipynb: how many numbers LoRA trains, and the merged
weight W + (alpha / r) B A.

Each judge compares with what ssmkit itself has (the trainable parameters of the LoRA model,
:func:`ssmkit.finetune.trainable_share`; the weight of the model :func:`ssmkit.finetune.merge`
merged) and returns a hint that says what is off, never the number.
"""

from __future__ import annotations

from . import exercise


@exercise("04.1", "what LoRA trains", ("lora_params",), wrong={"lora_params": 0})
def _(lora_params, lora_model):
    from ..finetune import trainable_share

    want = trainable_share(lora_model)["trainable"]
    full = sum(
        m.in_features * m.out_features
        for m in lora_model.modules()
        if hasattr(m, "lora_A") and hasattr(m, "in_features")
    )
    if lora_params == full:
        return "that is the adapted matrices' own size; LoRA trains A (r x d_in) and B (d_out x r)"
    if lora_params * 2 == want:
        return "count both factors: A (r x d_in) and B (d_out x r)"
    if lora_params != want:
        return "sum r x (d_in + d_out) over every adapted Linear layer (in every block)"
    return None


@exercise("04.2", "the merged weight", ("merged_weight",), wrong={"merged_weight": 0.0})
def _(merged_weight, merged_model, name):
    import torch

    want = merged_model.get_submodule(name).weight.detach().float().cpu()
    got = merged_weight.detach().float().cpu() if hasattr(merged_weight, "detach") else None
    if got is None or got.shape != want.shape:
        return f"merged_weight: a tensor of W's shape {tuple(want.shape)} (out x in)"
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
        return (
            "merged_weight: W plus the update (alpha / r) B A, with B (out x r) times A (r x in); "
            "read r and lora_alpha from the adapter's config"
        )
    return None
