"""Chapter 00, setup: what notebooks/00_setup.ipynb calls: the machine's facts and what a run config
will train, estimated without allocating it.

    p = PARAMETERS.check(globals())
    info = system_info(p["out_dir"])                 # Python, torch, GPU, kernels, CPUs, free disk
    size = run_config_info(p["config"], p["max_tokens"])  # parameters, vocabulary, FLOPs, GiB
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ... import checks
from ..cells import train_config
from ..params import DEVICE, Param, Parameters, check_data, check_out_dir, check_run_config

__all__ = ["PARAMETERS", "run_config_info", "system_info"]

# fmt: off
PARAMETERS = Parameters(
    Param("config",     "cpu-tiny",    check_run_config,
          'run config the later notebooks train (configs/<config>.yaml); GPU: "mamba-130m"'),
    Param("data",       "stdlib-docs", check_data,
          'training text: the embedded corpus (offline); GPU nodes: "slimpajama-6b"'),
    Param("max_tokens", 1_200_000,     checks.integer,
          "token budget of a training run; here it sizes disk and compute",
          minimum=1, whole_floats=True),
    DEVICE,
    Param("out_dir",    "../runs/lab/00_setup", check_out_dir,
          "metrics.json goes here (a relative path starts at notebooks/, always)"),
    Param("seed",       0,             checks.integer,
          "random seed of the smoke test", minimum=0, whole_floats=True),
)
# fmt: on


def system_info(path: str | Path = ".") -> dict:
    """Facts a run depends on: Python, torch, CUDA / GPU (name, memory, bf16), kernels, CPUs,
    free disk at ``path``."""
    import platform

    import torch

    from ...env import module_status

    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,  # None on a CPU build of torch
        "cuda_available": cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if cuda
        else None,
        "bf16": torch.cuda.is_bf16_supported() if cuda else None,
        "mamba_ssm": module_status("mamba_ssm"),
        "causal_conv1d": module_status("causal_conv1d"),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "disk_free_gb": round(shutil.disk_usage(Path(path)).free / 2**30, 1),
    }


def run_config_info(name: str, max_tokens: int | None = None) -> dict:
    """What the run config ``name`` trains, estimated without allocating it.

    The model config comes from the one path that builds it for training,
    ``train_config(name).model_config()``: its vocabulary is the tokenizer's
    (:func:`ssmkit.data.vocab_size`: gpt2 50257, byte 257, bpe-N N).

    Returns ``config``, ``model`` (the model preset), ``vocab_size``, ``params`` (counted on the
    meta device) and ``train_state_gb``: weights + gradients + AdamW's two moments in fp32, 16 bytes
    per parameter (also under bf16 autocast), activations not included. With ``max_tokens``:
    ``train_flops`` = 6 * params * tokens (Kaplan et al. 2020, eq. 2.1; the scan adds a few percent)
    and ``shard_gb``, the token shards at 2 bytes per token (uint16).
    """
    import torch

    from ...models import MambaLM

    run = train_config(name, max_steps=1)  # what the notebooks would train for it
    cfg = run.model_config()
    with torch.device("meta"):
        n = sum(p.numel() for p in MambaLM(cfg).parameters())
    info = {
        "config": name,
        "model": run.model,
        "vocab_size": cfg.vocab_size,
        "params": n,
        "train_state_gb": round(16 * n / 2**30, 3),
    }
    if max_tokens is not None:
        info["train_flops"] = float(6 * n * max_tokens)
        info["shard_gb"] = round(2 * max_tokens / 2**30, 3)
    return info
