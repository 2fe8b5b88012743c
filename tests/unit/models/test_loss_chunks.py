"""The chunked LM loss (``loss_chunk_size``): the fused linear + cross-entropy of a plain
``nn.Linear`` head (gradients made in the forward) and the checkpointed path of any other head,
against the plain ``F.cross_entropy`` over all logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ssmkit
from ssmkit.models.lm import chunked_cross_entropy

V, D = 503, 32


def plain(h, head, t):
    return F.cross_entropy(
        head(h).float().reshape(-1, head.out_features), t.reshape(-1), ignore_index=-100
    )


def case(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(D, V, bias=bias)
    h = torch.randn(2, 300, D, generator=g, requires_grad=True)
    t = torch.randint(0, V, (2, 300), generator=g)
    t[0, :7] = -100  # unscored positions: no loss, no gradient
    t[1, -1] = -100
    return h, head, t


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 128, 600, 4096])
def test_fused_loss_and_gradients_equal_the_plain_loss(bias, chunk):
    """fp32, chunks of 1 to more than all positions, a bias or none, ignored positions, an
    incoming gradient other than 1: loss and the gradients of h, W and b within 1e-6 (the loss
    relative 1e-6: 600 fp32 terms summed in another order)."""
    h, head, t = case(bias)
    params = [h, head.weight] + ([head.bias] if bias else [])
    ref, got = plain(h, head, t), chunked_cross_entropy(h, head, t, chunk)
    torch.testing.assert_close(got, ref, atol=0, rtol=1e-6)
    for a, b in zip(grads(3.5 * got, params), grads(3.5 * ref, params)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_frozen_head_and_no_grad():
    """A frozen head (LoRA fine-tuning) gets no weight gradient and none is computed; under
    no_grad (evaluation) the loss alone."""
    h, head, t = case(False)
    head.weight.requires_grad_(False)
    got = chunked_cross_entropy(h, head, t, 128)
    (gh,) = grads(got, [h])
    torch.testing.assert_close(gh, grads(plain(h, head, t), [h])[0], atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_cross_entropy(h, head, t, 128), plain(h, head, t), atol=1e-6, rtol=0
        )


def test_bf16_autocast_matches_the_plain_loss_under_autocast():
    """Under CPU bf16 autocast the head's matmuls run in bf16 on both paths and the reductions in
    fp32: the loss within bf16's resolution of the plain loss's (2e-2), gradients likewise."""
    h, head, t = case(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = plain(h, head, t), chunked_cross_entropy(h, head, t, 128)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=0)
    gr, gg = grads(ref, [h, head.weight]), grads(got, [h, head.weight])
    for a, b in zip(gg, gr):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-2)


def test_a_wrapped_head_takes_the_checkpointed_path():
    """A head that is not a plain nn.Linear (a LoRA wrapper) is called as a module, each chunk's
    logits recomputed in the backward: equal to the plain loss too."""

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.out_features = inner, inner.out_features

        def forward(self, x):
            return self.inner(x) * 1.0

    h, head, t = case(False)
    wrapped = Wrapped(head)
    got, ref = chunked_cross_entropy(h, wrapped, t, 128), plain(h, head, t)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    for a, b in zip(grads(got, [h, head.weight]), grads(ref, [h, head.weight])):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_model_with_a_tied_head_trains_the_same_with_chunks():
    """MambaLM with its head tied to the embedding: model(x, labels, loss_chunk_size=64) gives the
    plain loss and the same gradient of every parameter (the tied weight's sums both uses)."""
    torch.manual_seed(0)
    model = ssmkit.build_model(ssmkit.ModelConfig.preset("tiny", d_model=32, n_layer=2))
    assert model.lm_head.weight is model.backbone.embedding.weight
    x = torch.randint(0, model.config.vocab_size, (2, 48))
    y = torch.roll(x, -1, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    ref = model(x, labels=y, shift_labels=False).loss
    got = model(x, labels=y, shift_labels=False, loss_chunk_size=64).loss
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    for a, b in zip(grads(got, params), grads(ref, params)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
