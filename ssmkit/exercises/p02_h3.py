"""The exercises of papers/02_h3.ipynb (H3): what a shift SSM outputs, and the size of an H3
layer's state."""

from __future__ import annotations

import torch

from . import exercise

_F64 = dict(dtype=torch.float64)


@exercise(
    "p02.1",
    "a shift SSM's output",
    ("output",),
    wrong={"output": torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0], **_F64)},
)
def _(output):
    """y of ops.shift_ssm(3), C = (0, 0, 1) on u = (1, ..., 5), exactly (ops.ssm_recurrent)."""
    from ssmkit import ops

    A, B = ops.shift_ssm(3)
    u = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], **_F64)
    want = ops.ssm_recurrent(A, B, torch.tensor([0.0, 0.0, 1.0], **_F64), u)
    output = torch.as_tensor(output, **_F64)
    if output.shape != want.shape:
        return f"the output has shape {tuple(output.shape)}: one number per input step"
    if not torch.equal(output, want):
        return "the output is off: the state holds the last 3 inputs; which one does C read?"
    return None


@exercise("p02.2", "an H3 layer's state", ("per_layer",), wrong={"per_layer": 64 * 16})
def _(per_layer):
    """The complex numbers of tiny-h3's H3 state per sequence (layer.allocate_state(1, ...))."""
    from ssmkit.models import ModelConfig, build_model

    tiny = build_model(ModelConfig.preset("tiny-h3"))
    want = tiny.backbone.layers[0].mixer.allocate_state(1, torch.float32, "cpu").ssm.numel()
    if per_layer != want:
        side = "too many" if per_layer > want else "too few"
        return f"{per_layer} is {side}: count heads (width / p), p·p entries each, N/2 modes each"
    return None
