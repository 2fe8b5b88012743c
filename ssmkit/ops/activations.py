r"""Pointwise activations by the names transformers' configs use (``hidden_act``, its ``ACT2FN``
keys), so a checkpoint's activation is looked up, never guessed.

Each is written from its definition (Hendrycks & Gimpel 2016 for GELU and its tanh form, the
papers named below for the others); x is any tensor, the result has its shape and dtype:

    gelu, gelu_python             x Φ(x) = x/2 (1 + erf(x / √2))                  exact GELU
    gelu_10                       gelu clipped to [-10, 10]
    gelu_new, gelu_accurate,      x/2 (1 + tanh(√(2/π) (x + 0.044715 x³)))        the tanh form
    gelu_pytorch_tanh, gelu_python_tanh
    gelu_fast                     x/2 (1 + tanh(0.7978845608 x (1 + 0.044715 x²)))
    quick_gelu                    x σ(1.702 x)
    silu, swish                   x σ(x)                              (Ramachandran et al. 2017)
    mish                          x tanh(softplus(x))                 (Misra 2019)
    relu, relu2, relu6            max(0, x), max(0, x)², min(max(0, x), 6)   (relu²: So et al. 2021)
    leaky_relu                    max(0, x) + 0.01 min(0, x)
    hardswish                     x relu6(x + 3) / 6                  (Howard et al. 2019)
    sigmoid, tanh, linear         σ(x), tanh(x), x
    laplace                       (1 + erf((x - 0.707107) / (0.282095 √2))) / 2
    sqrtsoftplus                  √softplus(x)

The forms that are one formula under several names give the same values; torch's fused kernels
(``F.gelu``, ``F.silu``, ...) are used where they compute the formula, as transformers does.
``prelu`` and ``xielu`` are refused: they carry learnable parameters, which would be weights of
every MLP (transformers stores them as ``act_fn.*``) that ssmkit's MLPs do not hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, written out (gelu_new's formula)."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def _laplace(x: torch.Tensor, mu: float = 0.707107, sigma: float = 0.282095) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf((x - mu).div(sigma * math.sqrt(2.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10.0, 10.0),
    "gelu_fast": lambda x: (
        0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))
    ),
    "gelu_new": _gelu_tanh,
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_python_tanh": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "hardswish": F.hardswish,
    "laplace": _laplace,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.01),
    "linear": lambda x: x,
    "mish": F.mish,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "relu6": F.relu6,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "swish": F.silu,
    "tanh": torch.tanh,
}
LEARNABLE = ("prelu", "xielu")  # transformers' names of activations with parameters: refused


def activation(name: str, what: str = "activation") -> Callable[[torch.Tensor], torch.Tensor]:
    """The function called ``name`` in :data:`ACTIVATIONS`; else a ValueError naming ``what`` (the
    config field) and the valid names."""
    if isinstance(name, str) and name in ACTIVATIONS:
        return ACTIVATIONS[name]
    why = (
        f" ({name!r} has learnable parameters, weights of every MLP that ssmkit's MLPs do not hold)"
        if name in LEARNABLE
        else ""
    )
    raise ValueError(f"{what} must be one of: {', '.join(ACTIVATIONS)}; got {name!r}{why}")


__all__ = ["ACTIVATIONS", "LEARNABLE", "activation"]
