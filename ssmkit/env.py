"""``ssmkit.env_report()``: what this machine offers and which backend each op will use."""

from __future__ import annotations

import platform
import sys

import torch

from .ops import backend as _backend


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as exc:  # a broken CUDA extension raises more than ImportError
        return f"not importable ({type(exc).__name__})"
    return getattr(mod, "__version__", "installed")


def env_report() -> str:
    """A multi-line report: Python, torch, device, kernels, and the backend of every op."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = [
        f"python       {sys.version.split()[0]} ({platform.platform()})",
        f"torch        {torch.__version__} (threads: {torch.get_num_threads()})",
        f"device       {device}",
    ]
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        lines.append(f"gpu          {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                     f"bf16: {torch.cuda.is_bf16_supported()}")
    else:
        lines.append("gpu          none (CUDA not available)")
    lines.append(f"mamba_ssm    {_version('mamba_ssm') if device == 'cuda' else 'not checked (no CUDA)'}")
    lines.append(f"causal_conv1d {_version('causal_conv1d') if device == 'cuda' else 'not checked (no CUDA)'}")
    forced = _backend.forced_backend()
    lines.append(f"SSMKIT_BACKEND {forced or 'unset (automatic)'}")
    lines.append(f"backends on {device}:")
    lines += [f"  {op:<24} {choice}" for op, choice in _backend.describe(device).items()]
    return "\n".join(lines)
