"""What notebook cells call: describe the machine and the preset, build the run config, sample text,
format tables and durations, write ``metrics.json``. Cells stay short; logic lives here. (The
``parameters`` cell is checked by :func:`ssmkit.workbook.check_params`, in :mod:`~ssmkit.workbook.params`.)

    size = preset_info(p["preset"], p["max_tokens"])      # params (meta device), vocabulary, FLOPs, GiB
    cfg = train_config(p["preset"], max_tokens=p["max_tokens"], device=p["device"], evals=6, **p["overrides"])
    write_metrics(p["out_dir"], {"val_loss": 3.2})        # the runner copies these into summary.md

Values are checked with :mod:`ssmkit.checks` (``True`` is never an integer); a bad one raises
:class:`WorkbookError` naming it and what is valid. torch, the models and the trainer are imported
inside the functions, so importing the workbook stays light.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from .. import checks
from ..eval import summarize_run
from ..io import write_atomically
from .notebooks import PROJECT_ROOT, WorkbookError

__all__ = ["format_duration", "markdown_table", "pick_device", "preset_info", "preset_names",
           "sample_text", "summarize_run", "system_info", "train_config", "write_metrics"]


def _config_dir() -> Path:
    return Path(os.environ.get("SSMKIT_CONFIGS", PROJECT_ROOT / "configs"))


def unknown_preset(preset) -> WorkbookError:
    return WorkbookError(f"unknown preset {preset!r}; valid: {', '.join(preset_names())}")


def pick_device(device: str = "auto") -> str:
    """:func:`ssmkit.env.pick_device` (``"auto"`` -> cuda, else mps, else cpu), raising
    :class:`WorkbookError`."""
    from ..env import pick_device as _pick

    try:
        return _pick(checks.device_name(device))
    except ValueError as exc:
        raise WorkbookError(str(exc)) from None


def preset_names() -> list[str]:
    """Valid ``preset`` values: run configs in ``configs/*.yaml`` (cpu-tiny, mamba-130m, ...)
    and model presets."""
    from ..models import presets

    configs = sorted(p.stem for p in _config_dir().glob("*.yaml"))
    return configs + [name for name in presets() if name not in configs]


def train_config(preset: str, evals: int | None = None, **overrides):
    """The :class:`ssmkit.train.TrainConfig` of ``preset``: ``configs/<preset>.yaml`` with ``overrides``,
    or, for a bare model preset (``tiny``, ``mamba-130m``, ...), the default recipe around that model.

    ``max_tokens`` replaces the config's ``max_steps``/``max_tokens`` (the notebooks budget in tokens).
    ``evals``: validation points over the run (sets ``eval_every`` to total steps // evals, at least 1).
    A bad value raises :class:`WorkbookError` with TrainConfig's message.
    """
    from ..train import TrainConfig

    if "max_tokens" in overrides:
        overrides.setdefault("max_steps", None)
    if evals is not None and "eval_every" in overrides:
        raise WorkbookError("give evals or eval_every, not both")
    path = _config_dir() / f"{preset}.yaml"
    if not path.exists() and preset not in preset_names():
        raise unknown_preset(preset)
    try:
        cfg = (TrainConfig.from_yaml(path, overrides=overrides) if path.exists()
               else TrainConfig.from_dict({"model": preset}, overrides=overrides))
        if evals is not None:
            cfg.eval_every = max(1, cfg.total_steps() // checks.integer(evals, "evals", minimum=1))
    except WorkbookError:
        raise
    except ValueError as exc:
        raise WorkbookError(str(exc)) from None
    return cfg


def preset_info(preset: str, max_tokens: int | None = None) -> dict:
    """What a preset trains, estimated without allocating it.

    The model config comes from the one path that builds it for training: for a run config
    (``configs/<preset>.yaml``), ``train_config(preset).model_config()``, its vocabulary the tokenizer's
    (:func:`ssmkit.data.vocab_size`: gpt2 50257, byte 257, bpe-N N); a bare model preset (``tiny``,
    ``mamba-130m``) gets the default recipe's tokenizer, as :func:`train_config` trains it.

    Returns ``preset``, ``model`` (the model preset), ``vocab_size``, ``params`` (counted on the meta
    device) and ``train_state_gb``: weights + gradients + AdamW's two moments in fp32, 16 bytes per
    parameter (also under bf16 autocast), activations not included. With ``max_tokens``:
    ``train_flops`` = 6 * params * tokens (Kaplan et al. 2020, eq. 2.1; the scan adds a few percent)
    and ``shard_gb``, the token shards at 2 bytes per token (uint16).
    """
    import torch

    from ..models import MambaLM, presets

    if not (_config_dir() / f"{preset}.yaml").exists() and preset not in presets():
        raise unknown_preset(preset)
    run = train_config(preset, max_steps=1)                 # what the notebooks would train for this preset
    model, cfg = run.model, run.model_config()
    with torch.device("meta"):
        n = sum(p.numel() for p in MambaLM(cfg).parameters())
    info = {"preset": preset, "model": model, "vocab_size": cfg.vocab_size, "params": n,
            "train_state_gb": round(16 * n / 2**30, 3)}
    if max_tokens is not None:
        info["train_flops"] = float(6 * n * max_tokens)
        info["shard_gb"] = round(2 * max_tokens / 2**30, 3)
    return info


def _module_status(name: str) -> str:
    """"version" if it imports, "not installed", or "broken (<error>)" (CUDA extensions
    raise more than ImportError)."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        return "not installed"
    try:
        module = __import__(name)
    except Exception as exc:
        return f"broken ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return getattr(module, "__version__", "installed")


def system_info(path: str | Path = ".") -> dict:
    """Facts a run depends on: Python, torch, CUDA / GPU (name, memory, bf16), kernels, CPUs,
    free disk at ``path``."""
    import platform

    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,           # None on a CPU build of torch
        "cuda_available": cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "bf16": torch.cuda.is_bf16_supported() if cuda else None,
        "mamba_ssm": _module_status("mamba_ssm"),
        "causal_conv1d": _module_status("causal_conv1d"),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "disk_free_gb": round(shutil.disk_usage(Path(path)).free / 2**30, 1),
    }


def format_duration(seconds: float) -> str:
    """``42`` -> "42 s", ``300`` -> "5 min", ``25200`` -> "7 h", ``3e5`` -> "3.5 days"
    (for ETAs and estimates)."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size if unit == "days" else seconds >= size:
            return f"{seconds / size:.2g} {unit}"
    return f"{seconds:.2g} s"


def write_metrics(out_dir: str | Path, metrics: dict) -> Path:
    """Write ``out_dir/metrics.json`` atomically (:func:`ssmkit.io.write_atomically`); returns its path.

    ``summary.md`` shows each metric with a unit read from its name (:func:`ssmkit.workbook.rundir.unit`):
    ``*_loss`` nats/token, ``*tok_s`` tokens/s, ``*_seconds`` s, ``*params`` parameters, ``*_gb`` GiB,
    ``tokens`` / ``*_tokens`` tokens, ``*_flops`` FLOPs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_atomically(out_dir / "metrics.json", json.dumps(metrics, indent=2, default=str) + "\n")


def sample_text(model, tokenizer, prompts: list[str], max_new_tokens: int = 40, temperature: float = 0.8,
                top_k: int = 40, seed: int = 0) -> list[str]:
    """Continue each prompt with :func:`ssmkit.generate` (seeded sampling) and decode
    prompt + continuation."""
    import torch

    from ..models import generate

    device = next(model.parameters()).device
    out, gen = [], torch.Generator(device=device).manual_seed(seed)
    model.eval()
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)], device=device)
        new = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                       generator=gen)
        out.append(tokenizer.decode(new[0].tolist()))
    model.train()
    return out


def markdown_table(rows: list[dict], floats: str = ".4g") -> str:
    """A list of dicts as a Markdown table (display it with ``IPython.display.Markdown``)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    cell = lambda v: format(v, floats) if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)
