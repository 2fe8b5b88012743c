"""ssmkit.ops.activations against transformers' ACT2FN (the oracle: the names a checkpoint's
``hidden_act`` uses), and the conv op with an activation other than SiLU on every backend.

Tolerance: fp32 1e-6 absolute (the same formulas, torch's fused kernels on one side or both), and
1e-6 relative too for the conv (reference and torch sum the taps in another order, and relu2
squares the difference)."""

from __future__ import annotations

import pytest
import torch
from fake_kernels import CONV

from ssmkit import ops
from ssmkit.ops import backend
from ssmkit.ops.activations import ACTIVATIONS, LEARNABLE, activation

ACT2FN = pytest.importorskip("transformers.activations").ACT2FN


def test_every_name_transformers_knows_is_ours_or_refused_for_its_parameters():
    """A name transformers adds later fails here, so the table cannot fall behind silently."""
    assert sorted(ACTIVATIONS) == sorted(set(ACT2FN) - set(LEARNABLE))
    assert all(any(p.numel() for p in ACT2FN[k].parameters()) for k in LEARNABLE)
    assert not any(list(ACT2FN[k].parameters()) for k in ACTIVATIONS)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_each_activation_equals_transformers(name):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 4, torch.tensor([0.0, -30.0, 30.0, 6.0, -3])])
    theirs = ACT2FN[name]
    got, want = activation(name)(x), theirs(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got - x).abs().max() > 1e-3 or name == "linear"  # not the identity by accident


def test_unknown_and_learnable_activations_are_refused_with_the_valid_names():
    with pytest.raises(ValueError, match=r"hidden_act must be one of: gelu, .*silu.*; got 'gelu2'"):
        activation("gelu2", "hidden_act")
    with pytest.raises(ValueError, match="'prelu' has learnable parameters"):
        activation("prelu")
    with pytest.raises(ValueError, match="got None"):
        activation(None)


@pytest.mark.parametrize("name", ["gelu", "relu2", "silu"])
def test_the_conv_applies_any_activation_on_every_backend(name, fake_kernels):  # noqa: F811
    """reference == torch == the cuda wiring (the kernel stand-in applies only SiLU, as the real
    one: other activations run after it), for the sequence and the one-step form."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 9, generator=g)
    w, bias = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    plain = ops.causal_conv1d_reference(x, w, bias, None)
    want = ACT2FN[name](plain)
    for impl in (ops.causal_conv1d_reference, ops.causal_conv1d_torch, CONV.causal_conv1d_cuda):
        torch.testing.assert_close(impl(x, w, bias, name), want, rtol=1e-6, atol=1e-6)
    seq_idx = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    CONV.causal_conv1d_cuda(x.transpose(1, 2).contiguous().transpose(1, 2), w, bias, name, seq_idx)
    called, args = fake_kernels[-1]  # (the stand-in ignores seq_idx: only the wiring is checked)
    assert called == "causal_conv1d_fn" and args["seq_idx"] is not None
    assert args["activation"] == (name if name == "silu" else None)
    before = torch.randn(2, 6, 4, generator=g)
    state, ref_state = before.clone(), before.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
        got = ops.causal_conv1d_update(x[:, :, 0], state, w, bias, name)
    want = ops.causal_conv1d_update(x[:, :, 0], ref_state, w, bias, name, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)
    silu = ops.causal_conv1d_update(x[:, :, 0], before.clone(), w, bias, "silu", backend="torch")
    assert name == "silu" or (got - silu).abs().max() > 1e-3  # the activation is applied
    with pytest.raises(ValueError, match="activation must be one of: gelu"):
        ops.causal_conv1d(x, w, bias, activation="gelu2")
