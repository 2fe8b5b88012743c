"""The precision the ops compute in: float32 for half, bfloat16 and float32 inputs (the official
kernels accumulate in fp32, and so does the ``torch`` backend), float64 kept as given.

Keeping float64 is what lets a second path check an op to 1e-8 and better (the paper notes'
identities, :mod:`ssmkit.papers.claims`): in float32 two correct orders of summation already
differ by ~1e-6.

    widen(x)            # x.float(), or x itself if it is float64
    wide_dtype(x, A)    # torch.float64 if any tensor given is float64, else torch.float32
"""

from __future__ import annotations

import torch

__all__ = ["wide_dtype", "widen"]


def widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the ops' accumulation precision: float64 stays float64, every other dtype becomes
    float32 (any shape)."""
    return t if t.dtype == torch.float64 else t.float()


def wide_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any of ``tensors`` (None ignored) is float64, else float32: the dtype of a buffer
    (a state, a zero carry) the op allocates itself."""
    return (
        torch.float64
        if any(t is not None and t.dtype == torch.float64 for t in tensors)
        else (torch.float32)
    )
