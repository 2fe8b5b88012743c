"""The exercises of papers/05_mamba3.ipynb (Mamba-3): parity by a rotation, the trapezoid rule by
hand, and a decode step's FLOPs per byte."""

from __future__ import annotations

import torch

from . import exercise

_BITS = torch.tensor([[1, 0, 1], [1, 1, 1]])


@exercise(
    "p05.1",
    "parity by a rotation",
    ("z", "parity"),
    wrong={
        "z": torch.ones(2, dtype=torch.complex128),
        "parity": torch.zeros(2, dtype=torch.long),
        "bits": _BITS,
    },  # fmt: skip
)
def _(z, parity, bits):
    """z_T = Π e^{iπ b_t} per string (+1 even, -1 odd, to 1e-9) and parity = Σ b mod 2 exactly."""
    want = bits.sum(dim=1) % 2
    z = torch.as_tensor(z)
    if z.shape != want.shape:
        return f"z has shape {tuple(z.shape)}: one complex number per string, {tuple(want.shape)}"
    sign = 1 - 2 * want.double()  # +1 even, -1 odd
    if not torch.allclose(z.real.double(), sign, atol=1e-9) or z.imag.abs().max() > 1e-9:
        return "z is off: turn by π for every 1 (multiply e^(iπ b_t) along each string)"
    parity = torch.as_tensor(parity)
    if parity.shape != want.shape or not torch.equal(parity.long(), want):
        return "parity is off: z's real part is +1 for even and -1 for odd; map that to 0 / 1"
    return None


@exercise(
    "p05.2",
    "the trapezoid rule by hand",
    ("y_hand",),
    wrong={"y_hand": torch.cumsum(torch.arange(1.0, 6.0, dtype=torch.float64), 0).view(1, 5, 1, 1)},
)
def _(y_hand):
    """y_t of note.trapezoid_loop with λ = 1/2, Δ = 1, A = 0, no rotation, B = C = (1, 0) on
    x = (1, ..., 5) (allclose)."""
    from ssmkit.papers import p05_mamba3 as note

    f64 = dict(dtype=torch.float64)
    x1 = torch.arange(1.0, 6.0, **f64).view(1, 5, 1, 1)
    e0 = torch.tensor([1.0, 0.0], **f64).expand(1, 5, 1, 1, 2)
    zero = torch.zeros(1, 5, 1, **f64)
    no_bias = torch.zeros(1, 1, 2, **f64)
    want = note.trapezoid_loop(x1, zero + 1, zero, zero, e0, e0, zero[..., None], no_bias, no_bias)
    got = torch.as_tensor(y_hand, **f64)
    if got.shape != want.shape:
        return f"y_hand has shape {tuple(got.shape)}; shape it like x1, {tuple(want.shape)}"
    off = ~torch.isclose(got, want)
    if off.any():
        t = int(off.nonzero()[0][1])
        side = "too large" if got.flatten()[t] > want.flatten()[t] else "too small"
        return f"y_t is {side} from t = {t + 1}: how much of its step does the newest input count?"
    return None


@exercise(
    "p05.3",
    "FLOPs per byte of a decode step",
    ("state_bytes", "per_byte"),
    wrong={
        "state_bytes": {1: 4 * 64 * 128, 4: 4 * 64 * 128},
        "per_byte": {1: 1.5, 4: 6.0},
    },  # fmt: skip
)
def _(state_bytes, per_byte):
    """FLOPs per byte of fp32 state at R = 1 and 4 for P = 64, N = 128, S = 32 against
    note.intensity (to 1e-12), and the bytes against note.step_bytes."""
    from ssmkit.papers import p05_mamba3 as note

    for r in (1, 4):
        try:
            got_bytes, got = state_bytes[r], per_byte[r]
        except (KeyError, TypeError, IndexError):
            return "give state_bytes and per_byte as {1: ..., 4: ...}, one entry per R"
        want_bytes = note.step_bytes(128, 64, r, 32)
        if got_bytes != want_bytes:
            side = "too many" if got_bytes > want_bytes else "too few"
            return (
                f"state_bytes at R = {r} is {side}: h, the last k, the last x, the angles, "
                "each read and written, 4 bytes each"
            )
        want = note.intensity(128, 64, r, 32)
        if not (isinstance(got, (int, float)) and abs(got - want) < 1e-12):
            return f"per_byte at R = {r} is off: 6·R·P·N FLOPs over the state's bytes"
    return None
