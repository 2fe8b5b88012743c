"""The exercises of papers/03_mamba.ipynb (Mamba): the Δ that keeps half the state, and an LTI
scan's convolution kernel."""

from __future__ import annotations

import torch

from . import exercise

_F64 = dict(dtype=torch.float64)


@exercise("p03.1", "the Δ that keeps half", ("half",), wrong={"half": 0.5})
def _(half):
    """One step of note.gate_states(half, length=1) keeps h0 / 2, to 1e-12."""
    from ssmkit.papers import p03_mamba as note

    one = note.gate_states(delta=float(half), length=1)
    if not torch.allclose(one["h_last"], 0.5 * one["h0"] + one["written"], rtol=0, atol=1e-12):
        kept = torch.exp(torch.tensor(-float(half))).item()
        side = "more" if kept > 0.5 else "less"
        return f"one step keeps {kept:.3f} of h0, {side} than half: solve exp(ΔA) = 1/2 for Δ"
    return None


@exercise(
    "p03.2",
    "an LTI scan is a convolution",
    ("K", "formula"),
    wrong={
        "K": torch.zeros(8, **_F64),
        "formula": torch.zeros(8, **_F64),
        "a_diag": -torch.ones(1, 4, **_F64),
        "b_vec": torch.ones(4, **_F64),
        "c_vec": torch.ones(4, **_F64),
        "dt": 0.1,
    },
)
def _(K, formula, a_diag, b_vec, c_vec, dt):
    """K from the scan's impulse response and from K_k = Cᵀ Ā^k B̄ (ZOH-Euler: Ā = exp(ΔA),
    B̄ = ΔB) agree with ssmkit's reference scan, to 1e-12 relative."""
    from ssmkit.ops import selective_scan

    L = len(K) if hasattr(K, "__len__") else 0
    if L < 2:
        return "K should be a tensor of the first L kernel entries (L >= 2)"
    impulse = torch.zeros(1, 1, L, **_F64)
    impulse[..., 0] = 1
    b = b_vec[None, :, None].expand(1, -1, L)
    c = c_vec[None, :, None].expand(1, -1, L)
    want = selective_scan(impulse, torch.full_like(impulse, dt), a_diag, b, c,
                          backend="reference")[0, 0]  # fmt: skip
    for name, got in (("K (the scan's impulse response)", K), ("formula", formula)):
        got = torch.as_tensor(got, **_F64)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-12, atol=0):
            return (
                f"{name} is off: the input is 1 at step 0 only, Δ = {dt} at every step, "
                "and B, C are the same at every step"
            )
    return None
