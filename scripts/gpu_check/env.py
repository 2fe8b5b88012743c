"""Section ``env``: torch / CUDA / GPU / bf16 support, the backend each op takes
(ssmkit.ops.backend.describe), whether mamba_ssm and causal_conv1d import."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
from pathlib import Path

import torch

import ssmkit

from .context import Context


def _version(dist: str) -> str | None:
    """The installed version of a distribution, without importing it (None: not installed)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_status(module: str) -> str:
    """ "ok <version>" or why ``module`` does not import (never raises)."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, OSError on a bad .so, RuntimeError (ABI)
        return f"import failed: {type(exc).__name__}: {exc}"[:300]
    return f"ok {getattr(mod, '__version__', '')}".strip()


def run(ctx: Context) -> dict:
    from ssmkit.ops import backend

    out = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(ctx.device),
        "threads": torch.get_num_threads(),
        "ssmkit": f"{ssmkit.__version__} ({Path(ssmkit.__file__).parent})",
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "peft": _version("peft"),
        "papermill": _version("papermill"),
        "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE"),
        "ssmkit_backend_env": os.environ.get("SSMKIT_BACKEND"),
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        out.update(
            gpu=torch.cuda.get_device_name(ctx.device),
            capability=f"{props.major}.{props.minor}",
            memory_gb=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count,
            bf16_supported=torch.cuda.is_bf16_supported(),
            tf32={
                "matmul": torch.backends.cuda.matmul.allow_tf32,
                "cudnn": torch.backends.cudnn.allow_tf32,
            },
            float32_matmul_precision=torch.get_float32_matmul_precision(),
        )
        from ssmkit.eval import peak_flops

        out["peak_bf16_tflops"] = (peak_flops(ctx.device, "bf16") or 0) / 1e12 or None
    else:
        out.update(gpu=None, bf16_supported=True)  # CPUs compute bf16 (slowly)
    # the kernels: probed only with CUDA (mamba_ssm cannot even be imported on a CPU-only torch)
    out["mamba_ssm"] = _import_status("mamba_ssm") if ctx.cuda else "not checked (no CUDA)"
    out["causal_conv1d"] = _import_status("causal_conv1d") if ctx.cuda else "not checked (no CUDA)"
    out["kernel_modules"] = {
        op: backend.kernel_import_error(module) or "ok"
        for op, module in backend.KERNEL_MODULES.items()
    }
    out["backends"] = backend.describe(ctx.device)
    ctx.log(
        f"  torch {out['torch']} (CUDA {out['torch_cuda']}), device {out['device']}, "
        f"gpu {out['gpu']}, bf16 {out['bf16_supported']}"
    )
    ctx.log(f"  mamba_ssm: {out['mamba_ssm']}; causal_conv1d: {out['causal_conv1d']}")
    ctx.log(
        "  backends: " + ", ".join(f"{op} {b.split(' ')[0]}" for op, b in out["backends"].items())
    )
    return out
