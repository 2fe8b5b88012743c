r"""RMSNorm (Zhang & Sennrich, 2019) and the gated, grouped RMSNorm of Mamba-2.

$$ \mathrm{RMSNorm}(x) = \frac{x}{\sqrt{\tfrac1d \sum_i x_i^2 + \epsilon}} \odot w $$

Mamba-2 normalises the scan output together with its gate z (``RMSNormGated`` in mamba_ssm):

* ``norm_before_gate=True``:  RMSNorm(x) * silu(z)
* ``norm_before_gate=False``: RMSNorm(x * silu(z))        (what Mamba-2 blocks use)

and with ``group_size`` the mean of squares is taken over groups of ``group_size`` channels
(one group per B/C group, so a tensor-parallel split gives the same result).
Computation is in fp32; the result has x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend as _backend


def _rms_reference(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, weight, eps=1e-5, backend=None):
    """x: (..., d), weight: (d,) -> (..., d)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"weight must be (d={x.shape[-1]},) for x {tuple(x.shape)}; got {tuple(weight.shape)}"
        )
    name = _backend.select("rms_norm", x, backend=backend)
    if name == "cuda":
        fn = _backend.kernel_module("rms_norm").rms_norm_fn
        return fn(x, weight, None, eps=eps)
    if name == "reference":
        y = _rms_reference(x.float(), eps)
    else:
        y = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return (y * weight.float()).to(x.dtype)


def rms_norm_gated(
    x, weight, z=None, eps=1e-5, group_size=None, norm_before_gate=True, backend=None
):
    """Gated RMSNorm. x, z: (..., d); weight: (d,); group_size divides d (None: d)."""
    d = x.shape[-1]
    group_size = group_size or d
    if weight.shape != (d,) or d % group_size != 0 or (z is not None and z.shape != x.shape):
        raise ValueError(
            f"expected x and z (..., d), weight (d,), group_size dividing d; "
            f"got x {tuple(x.shape)}, "
            f"z {None if z is None else tuple(z.shape)}, weight {tuple(weight.shape)}, "
            f"group_size {group_size}"
        )
    name = _backend.select("rms_norm_gated", x, backend=backend)
    if name == "cuda":
        fn = _backend.kernel_module("rms_norm_gated").rmsnorm_fn
        return fn(
            x, weight, None, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate
        )
    y = x.float()
    gate = F.silu(z.float()) if z is not None else None
    if gate is not None and not norm_before_gate:
        y = y * gate
    grouped = y.unflatten(-1, (d // group_size, group_size))
    if name == "reference":
        grouped = _rms_reference(grouped, eps)
    else:
        grouped = F.rms_norm(grouped, (group_size,), eps=eps)
    y = grouped.flatten(-2) * weight.float()
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)
