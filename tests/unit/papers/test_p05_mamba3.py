"""Note 05's helpers: its own loops against ssmkit's Mamba-3 in float64, and the decode step's
FLOP and byte formulas against a count on mamba3_step's tensors."""

from __future__ import annotations

import pytest
import torch

from ssmkit.ops.mamba3_ref import mamba3_reference
from ssmkit.papers import p05_mamba3 as note
from ssmkit.papers.claims import relative_error


def test_trapezoid_loop_is_the_reference():
    inputs = note.random_mamba3(length=12, seed=3)
    assert relative_error(note.trapezoid_loop(**inputs), mamba3_reference(**inputs)) < 1e-12


def test_the_loop_is_not_the_reference_without_its_rotation():
    """The oracle sees the rotation: dropping the angles changes y."""
    inputs = note.random_mamba3(length=12, seed=3)
    flat = dict(inputs, angles=torch.zeros_like(inputs["angles"]))
    assert relative_error(note.trapezoid_loop(**flat), mamba3_reference(**inputs)) > 1e-3


def test_complex_and_rotated_states_are_the_rotary_form():
    inputs = note.random_mamba3(length=12, nangles=4, seed=4)
    y_ref = mamba3_reference(**inputs)
    (y_c, z), (y_r, h) = note.complex_loop(inputs), note.rotated_state_loop(inputs)
    assert relative_error(y_c, y_ref) < 1e-12 and relative_error(y_r, y_ref) < 1e-12
    assert torch.allclose(torch.view_as_real(z).flatten(-2), h, rtol=0, atol=1e-12)


def test_lambda_one_is_mamba2():
    y3, y2 = note.euler_limit(note.random_mamba3(length=12, seed=5))
    assert relative_error(y3, y2) < 1e-12


def test_turn_pairs_leaves_unrotated_dimensions():
    v = torch.arange(6.0)
    out = note.turn_pairs(v, torch.tensor([torch.pi / 2]))
    assert torch.allclose(out, torch.tensor([-1.0, 0.0, 2, 3, 4, 5]), atol=1e-6)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_decode_formulas_match_the_counted_step(rank):
    row = note.counted_step(rank)
    assert row["bytes"] == row["formula bytes"]
    if rank > 1:  # at rank 1 the contraction is a broadcast multiply FlopCounterMode misses
        assert row["flops"] == row["formula flops"]
    assert note.intensity(128, 64, 4, 32) > 3.5 * note.intensity(128, 64, 1, 32)


def test_without_rotation_keeps_the_angles_at_zero():
    model = note.without_rotation(note.build_model(note.parity_models()["mamba3"], seed=0))
    layer = next(m for m in model.modules() if getattr(m, "nangles", 0))
    ids = torch.randint(0, 4, (2, 12))
    model(ids, labels=ids).loss.backward()
    assert layer.in_proj.weight.grad[-layer.nangles :].abs().max() == 0
    assert layer.in_proj.weight[-layer.nangles :].abs().max() == 0
