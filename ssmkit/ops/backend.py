"""Which implementation of an op runs: ``reference``, ``torch``, ``cpu`` or ``cuda``.

Every op in :mod:`ssmkit.ops` exists three times, some four:

* ``reference`` -- the paper's recurrence written to be read, one time step at a time;
* ``torch``     -- a fast pure-PyTorch path (on CPU where an op has no fused kernel, and on GPU
  without kernels); the readable fallback every faster path is tested against;
* ``cpu``       -- a fused C++ kernel for CPU tensors, built at its first call and cached
  (:data:`CPU_KERNELS`: so far the selective scan, :mod:`ssmkit.ops.s6_cpu`); where it cannot be
  built, one line says why and the ``torch`` path runs;
* ``cuda``      -- the ``mamba_ssm`` / ``causal_conv1d`` kernels, used when they import and the
  tensors live on a CUDA device.

The choice is automatic. ``SSMKIT_BACKEND=reference|torch|cpu|cuda`` in the environment forces one
for every op (``cpu`` for an op without a fused CPU kernel: its ``torch`` path); a forced backend
that cannot run raises :class:`BackendError` with the reason. Nothing here imports the CUDA kernels
or builds the CPU ones at module import time: they are probed lazily.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

BACKENDS = ("reference", "torch", "cpu", "cuda")

# op name -> module that provides its CUDA kernel (imported lazily, only on request)
KERNEL_MODULES = {
    "selective_scan": "mamba_ssm.ops.selective_scan_interface",
    "selective_state_update": "mamba_ssm.ops.triton.selective_state_update",
    "ssd_scan": "mamba_ssm.ops.triton.ssd_combined",
    "causal_conv1d": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d",
    "rms_norm": "mamba_ssm.ops.triton.layer_norm",
    "rms_norm_gated": "mamba_ssm.ops.triton.layernorm_gated",
    # Mamba-3: only in mamba_ssm's source tree (after 2.3.2.post1), with Triton, TileLang and CuTe
    # DSL
    "mamba3_siso": "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined",
    "mamba3_mimo": "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo",
    "mamba3_step": "mamba_ssm.ops.cute.mamba3.mamba3_step_fn",
}


# op name -> module with its fused CPU kernel: ``kernel_error()`` (None when it is ready; builds it
# at the first call) and ``status()`` (what an automatic call runs, building nothing)
CPU_KERNELS = {"selective_scan": "ssmkit.ops.s6_cpu"}


class BackendError(RuntimeError):
    """A requested backend cannot run here (missing kernels, wrong device, bad name)."""


@functools.cache
def kernel_import_error(module: str) -> str | None:
    """Try to import ``module`` once; return None when it imports, else the reason it does not."""
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build or on this machine"
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, OSError on a bad .so, RuntimeError on ABI mismatch
        return f"import {module} failed: {type(exc).__name__}: {exc}"
    return None


def cpu_kernel_error(op: str) -> str | None:
    """None when ``op``'s fused CPU kernel is ready (built at this first call if need be), else why
    not; an op without one says so."""
    if op not in CPU_KERNELS:
        return f"{op} has no fused CPU kernel"
    return importlib.import_module(CPU_KERNELS[op]).kernel_error()


def kernel_module(op: str):
    """The imported kernel module for ``op`` (call only after :func:`select` chose ``cuda``)."""
    return importlib.import_module(KERNEL_MODULES[op])


def forced_backend() -> str | None:
    """The backend named by ``SSMKIT_BACKEND``, or None when unset. Bad names are errors."""
    name = os.environ.get("SSMKIT_BACKEND", "").strip().lower()
    if not name:
        return None
    if name not in BACKENDS:
        raise BackendError(
            f"SSMKIT_BACKEND={name!r} is not a backend; valid values: {', '.join(BACKENDS)}"
        )
    return name


def select(op: str, *tensors: torch.Tensor | None, backend: str | None = None) -> str:
    """Choose the backend for one call of ``op`` on ``tensors``.

    Order: the ``backend`` argument, else ``SSMKIT_BACKEND``, else automatic (``cuda`` when the
    tensors are on CUDA and the kernel imports; on CPU tensors ``cpu`` when the op has a fused CPU
    kernel that builds, otherwise ``torch``).
    """
    if backend is not None and backend not in BACKENDS:
        raise BackendError(
            f"backend={backend!r} is not a backend; valid values: {', '.join(BACKENDS)}"
        )
    wanted = backend or forced_backend()
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    if wanted in ("reference", "torch"):
        return wanted
    if wanted == "cpu" and op not in CPU_KERNELS:
        return "torch"  # the torch path is this op's CPU path
    if wanted == "cpu":
        reason = "the tensors are on a CUDA device" if on_cuda else cpu_kernel_error(op)
        if reason is not None:
            raise BackendError(
                f"backend 'cpu' was forced for {op} but cannot run: {reason}. "
                "The fused CPU kernel needs CPU tensors, a C++ compiler and ninja; "
                "or choose SSMKIT_BACKEND=torch or reference."
            )
        return "cpu"
    if wanted is None and not on_cuda:  # no CUDA kernel runs on CPU tensors: no import check
        return "cpu" if op in CPU_KERNELS and cpu_kernel_error(op) is None else "torch"
    reason = kernel_import_error(KERNEL_MODULES[op])
    if reason is None and not on_cuda:
        reason = "the tensors are not on a CUDA device"
    if wanted == "cuda":
        if reason is not None:
            raise BackendError(
                f"backend 'cuda' was forced for {op} but cannot run: {reason}. "
                "Install the kernels on a CUDA machine "
                "(pip install 'ssmkit[cuda]' --no-build-isolation) "
                "or choose SSMKIT_BACKEND=torch or reference."
            )
        return "cuda"
    return "cuda" if reason is None else "torch"


def describe(device: str | torch.device = "cpu") -> dict[str, str]:
    """For each op, the backend an automatic call on ``device`` would use (and why not cuda). A
    fused CPU kernel not built yet is reported as what it will be, not built here."""
    on_cuda = torch.device(device).type == "cuda"
    forced = forced_backend()
    report = {}
    for op, module in KERNEL_MODULES.items():
        reason = kernel_import_error(module)
        if forced in ("reference", "torch"):
            report[op] = f"{forced} (forced by SSMKIT_BACKEND)"
        elif not on_cuda and op in CPU_KERNELS and forced in (None, "cpu"):
            status = importlib.import_module(CPU_KERNELS[op]).status()
            report[op] = status + (" (forced by SSMKIT_BACKEND)" if forced else "")
        elif forced == "cpu":
            report[op] = "torch (no fused CPU kernel; SSMKIT_BACKEND=cpu runs its torch path)"
        elif reason is None and on_cuda:
            report[op] = "cuda" + (" (forced by SSMKIT_BACKEND)" if forced else "")
        elif forced == "cuda":
            report[op] = f"cuda forced but unavailable: {reason or 'device is not CUDA'}"
        else:
            report[op] = f"torch ({reason or 'device is not CUDA'})"
    return report
