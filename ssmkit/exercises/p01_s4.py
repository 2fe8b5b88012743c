"""The exercises of papers/01_s4.ipynb (S4 / S4D): discretising a scalar SSM by hand, the shift
SSM's kernel, and how long a ZOH mode remembers."""

from __future__ import annotations

import math

import torch

from . import close, exercise

_F64 = dict(dtype=torch.float64)


def _direction(got: float, want: float) -> str:
    return "too large" if got > want else "too small"


@exercise(
    "p01.1",
    "ZOH and bilinear by hand",
    ("zoh", "bilinear"),
    wrong={"zoh": (0.6, 0.4), "bilinear": (math.exp(-0.5), 1 - math.exp(-0.5))},
)
def _(zoh, bilinear):
    """(Ā, B̄) of A = -1, B = 1, Δ = 1/2 against ops.discretize, to 1e-12."""
    from ssmkit import ops

    a, b = torch.tensor([-1.0], **_F64), torch.tensor([1.0], **_F64)
    for method, got in (("zoh", zoh), ("bilinear", bilinear)):
        want = [t.item() for t in ops.discretize(a, b, 0.5, method)]
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return f"{method}: give a pair (Ā, B̄) of two numbers"
        for name, g, w in zip(("Ā", "B̄"), got, want):
            if not close(g, w, rel=1e-12, abs=0):
                off = _direction(float(g), w) if isinstance(g, (int, float)) else "not a number"
                return f"{method}: {name} is {off}; write its formula with ΔA = -1/2 first"
    return None


@exercise(
    "p01.2",
    "the shift SSM's kernel",
    ("kernel",),
    wrong={"kernel": torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0], **_F64)},
)
def _(kernel):
    """K̄ of ops.shift_ssm(4) with C = (1, 2, 3, 4), L = 7, exactly (ops.kernel_by_powers)."""
    from ssmkit import ops

    A, B = ops.shift_ssm(4)
    want = ops.kernel_by_powers(A, B, torch.tensor([1.0, 2.0, 3.0, 4.0], **_F64), 7)
    kernel = torch.as_tensor(kernel, **_F64)
    if kernel.shape != want.shape:
        return f"the kernel has {tuple(kernel.shape)} entries' shape; it has one entry per lag, L"
    wrong = [i for i in range(len(want)) if kernel[i] != want[i]]
    if wrong:
        return f"K̄_l is off at lag(s) l = {wrong}: which state does Ā^l B put the input in?"
    return None


@exercise("p01.3", "memory of a ZOH mode", ("steps_to_1_over_e",), wrong={"steps_to_1_over_e": 100})
def _(steps_to_1_over_e):
    """|Ā|^k = 1/e for the ZOH mode A = -1/2 + 3i, Δ = 0.01 (ops.discretize), to 1e-5."""
    from ssmkit import ops

    one = dict(dtype=torch.complex128)
    mode = ops.discretize(torch.tensor([-0.5 + 3j], **one), torch.tensor([1 + 0j], **one), 0.01)
    left = abs(mode[0].item()) ** float(steps_to_1_over_e)
    if not math.isclose(left, math.exp(-1), rel_tol=1e-5):
        more = "too few steps" if left > math.exp(-1) else "too many steps"
        return f"after that many steps |Ā|^k = {left:.4f}, not 1/e: {more}; solve e^(-Δk/2) = 1/e"
    return None
