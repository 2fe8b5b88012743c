"""ssmkit.ops.precision: the scans keep float64 inputs in float64 (so a second path can check them
to 1e-12), and compute half / bf16 / fp32 inputs in fp32 as the kernels do."""

import pytest
import torch

from ssmkit.ops import mamba3_scan, selective_scan, ssd_scan
from ssmkit.ops.precision import wide_dtype, widen


def test_widen_and_wide_dtype():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert widen(torch.ones(2, dtype=dtype)).dtype == torch.float32
    assert widen(torch.ones(2, dtype=torch.float64)).dtype == torch.float64
    assert wide_dtype(torch.ones(1), None) == torch.float32
    assert wide_dtype(torch.ones(1), torch.ones(1, dtype=torch.float64)) == torch.float64


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_s6_and_ssd_in_float64_agree_to_1e12(backend):
    b, d, L, n = 2, 4, 20, 8
    u, delta = rand(b, d, L), rand(b, d, L, seed=1).abs()
    A, B, C = -rand(d, n, seed=2).abs(), rand(b, n, L, seed=3), rand(b, n, L, seed=4)
    y = selective_scan(u, delta, A, B, C, backend=backend)
    ref = selective_scan(u, delta, A, B, C, backend="reference")
    assert y.dtype == torch.float64 and (y - ref).abs().max() <= 1e-12 * ref.abs().max()

    x, dt, A2 = rand(b, L, 2, 4), rand(b, L, 2, seed=5).abs(), -rand(2, seed=6).abs()
    B2, C2 = rand(b, L, 1, n, seed=7), rand(b, L, 1, n, seed=8)
    y2, h = ssd_scan(x, dt, A2, B2, C2, 8, return_final_states=True, backend=backend)
    ref2, h_ref = ssd_scan(x, dt, A2, B2, C2, 8, return_final_states=True, backend="reference")
    assert y2.dtype == h.dtype == torch.float64
    assert (y2 - ref2).abs().max() <= 1e-12 * ref2.abs().max()
    assert (h - h_ref).abs().max() <= 1e-12 * h_ref.abs().max()


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_mamba3_in_float64_agrees_to_1e12(backend):
    b, L, h, p, n = 2, 20, 2, 4, 8
    args = dict(
        x=rand(b, L, h, p), dt=rand(b, L, h, seed=1).abs(), A=-rand(b, L, h, seed=2).abs(),
        trap=rand(b, L, h, seed=3), B=rand(b, L, 1, 1, n, seed=4), C=rand(b, L, 1, 1, n, seed=5),
        angles=rand(b, L, h, n // 2, seed=6), B_bias=rand(h, 1, n, seed=7),
        C_bias=rand(h, 1, n, seed=8),
    )  # fmt: skip
    y = mamba3_scan(**args, chunk_size=8, backend=backend)
    ref = mamba3_scan(**args, chunk_size=8, backend="reference")
    assert y.dtype == torch.float64 and (y - ref).abs().max() <= 1e-12 * ref.abs().max()
