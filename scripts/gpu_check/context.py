"""What every section of the GPU check shares: the :class:`Context` it runs in (device, mode, clock,
log), the repository root, and small helpers (seeded random tensors, fp32 without TF32, relative
error, freeing memory). Importing it makes the check offline: HF_HUB_OFFLINE=1 before any section
imports transformers (they import it inside their functions).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from pathlib import Path

import torch

# no hub downloads or hub kernels; must precede importing transformers (the sections do, when run)
os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = "skipped: no CUDA device"


class Context:
    """What every section gets: the device, the mode, the clock and the log."""

    def __init__(self, device: torch.device, quick: bool, budget: float, precision: str, log):
        self.device, self.quick, self.budget = device, quick, budget
        self.precision, self.log = precision, log
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self) -> float:
        return self.budget - self.elapsed()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def autocast(self):
        """bf16 autocast with fp32 master weights, as ssmkit's Trainer; fp32: none."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def free():
    """Drop what the last section or model left: Python garbage, then the CUDA allocator's cached
    blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rng(seed):
    """A CPU generator seeded with ``seed``: the same tensors on every machine."""
    return torch.Generator().manual_seed(seed)


def randn(g, *shape):
    return torch.randn(*shape, generator=g)


def rand(g, *shape):
    return torch.rand(*shape, generator=g)


@contextlib.contextmanager
def no_tf32():
    """fp32 parity on a GPU: no TF32 in matmuls or cuDNN (PyTorch's default allows it in
    convolutions)."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
