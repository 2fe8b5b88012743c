"""The official kernels' own test tolerances per dtype, each with the suite and file it comes from,
and ssmkit's fp32 bound: what tests/unit/ops and scripts/gpu_check hold the ``torch`` backend to.

The kernels keep weights in fp32 and accumulate in fp32, rounding once to the input dtype at the
end. Their suites compare an op on fp16 / bf16 inputs with the same op on the inputs upcast to fp32
(its output rounded to the input dtype), elementwise; every pair below is ``(rtol, atol)`` of

    |ours - ref| <= atol + rtol |ref|

except gated RMSNorm's suite, which bounds the error by the one of the norm written out in the low
dtype (:data:`NORM_PT`, :data:`NORM_ATOL`). A gradient's tolerance is a multiple of its op's
(:func:`scaled`).
"""

from __future__ import annotations

import torch

# ssmkit's own bound for fp32: max |ours - ref| <= FP32_REL max |ref|. fp32 paths that differ only
# in summation order differ by ~1e-6 on the tests' shapes; a wrong sign, a missing term or a
# misplaced chunk boundary is far above it.
FP32_REL = 1e-4

# causal-conv1d, tests/test_causal_conv1d.py: the output and dx, per input dtype ...
CONV = {torch.float16: (3e-3, 5e-3), torch.bfloat16: (1e-2, 5e-2)}
# ... and dweight, dbias (fp32 parameters) in either dtype
CONV_WEIGHT = (1e-3, 1e-3)

# mamba_ssm, tests/ops/test_selective_scan.py: the output and the final state, per input dtype ...
SCAN = {torch.float16: (3e-3, 5e-3), torch.bfloat16: (3e-2, 5e-2)}
# ... du at (rtol, atol) x SCAN_DU, ddelta at (rtol, atol) x SCAN_DDELTA ...
SCAN_DU = (2, 2)
SCAN_DDELTA = (5, 10)
# ... the fp32 parameters' gradients at SCAN_WEIGHT, raised to the input's tolerance when there is a
# gate z ("errors on the weights seem higher": :func:`scan_weight`), and dA's atol x SCAN_DA_ATOL
SCAN_WEIGHT = (1e-3, 1e-3)
SCAN_DA_ATOL = 5

# mamba_ssm, tests/ops/triton/test_layernorm_gated.py, fp16 and bf16: the output and every gradient
# within |ours - fp32| <= NORM_PT |pt - fp32| + NORM_ATOL, pt: the norm computed in the low dtype
NORM_PT = 2.0
NORM_ATOL = 8e-3

# SSD: mamba_ssm's tests/ops/triton/test_ssd.py checks its states at (1e-2, 3e-3). ssmkit holds the
# SSD's output and gradients to the selective scan's tolerances above, and the fp32 parameters'
# gradients (A, D, dt_bias: sums over every position) to SSD_PARAM with atol relative to the
# gradient's largest magnitude.
SSD_PARAM = (1e-2, 1e-2)


def scaled(tol: tuple[float, float], factors: tuple[float, float]) -> tuple[float, float]:
    """``(rtol, atol)`` times ``(rtol factor, atol factor)``: ``scaled(SCAN[dtype], SCAN_DU)``."""
    return tol[0] * factors[0], tol[1] * factors[1]


def scan_weight(dtype: torch.dtype) -> tuple[float, float]:
    """The selective scan's ``(rtol, atol)`` for the fp32 parameters' gradients with a gate z,
    inputs in ``dtype``: :data:`SCAN_WEIGHT` raised to the input's tolerance (the suite's
    ``rtolw, atolw``)."""
    rtol, atol = SCAN[dtype]
    return max(SCAN_WEIGHT[0], rtol), max(SCAN_WEIGHT[1], atol)
