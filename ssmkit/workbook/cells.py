"""What the cells of every notebook share: the run config by name, the device, sampled text, tables,
durations and ``metrics.json``. A notebook's own helpers are in its chapter
(:mod:`ssmkit.workbook.chapters`); its parameters are checked by :mod:`~ssmkit.workbook.params`.

    cfg = train_config(p["config"], max_tokens=p["max_tokens"], device=p["device"], evals=6,
                       **p["overrides"])
    display(Markdown(markdown_table(rows)))               # a list of dicts as a table
    write_metrics(p["out_dir"], {"val_loss": 3.2})        # the runner copies these into summary.md

Values are checked with :mod:`ssmkit.checks` (``True`` is never an integer); a bad one raises
:class:`WorkbookError` naming it and what is valid. torch, the models and the trainer are imported
inside the functions, so importing the workbook stays light.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import checks
from ..io import write_atomically
from .notebooks import PROJECT_ROOT, WorkbookError

__all__ = [
    "format_duration",
    "markdown_table",
    "pick_device",
    "rounded",
    "run_config_names",
    "sample_text",
    "train_config",
    "write_metrics",
]


def _config_dir() -> Path:
    return Path(os.environ.get("SSMKIT_CONFIGS", PROJECT_ROOT / "configs"))


def unknown_run_config(value, name: str = "config") -> WorkbookError:
    return WorkbookError(
        f"{name}={value!r} is not a run config; valid: {', '.join(run_config_names())}"
    )


def pick_device(device: str = "auto") -> str:
    """:func:`ssmkit.env.pick_device` (``"auto"`` -> cuda, else mps, else cpu), raising
    :class:`WorkbookError`."""
    from ..env import pick_device as _pick

    try:
        return _pick(checks.device_name(device))
    except ValueError as exc:
        raise WorkbookError(str(exc)) from None


def run_config_names() -> list[str]:
    """The run configs a notebook's ``config`` may name: ``configs/*.yaml`` (cpu-tiny, mamba-130m,
    ...), then the model presets (tiny, mamba2-130m, ...), each trained with the default recipe of
    :class:`~ssmkit.train.TrainConfig`."""
    from ..models import presets

    configs = sorted(p.stem for p in _config_dir().glob("*.yaml"))
    return configs + [name for name in presets() if name not in configs]


def train_config(name: str, evals: int | None = None, **overrides):
    """The :class:`ssmkit.train.TrainConfig` of the run config ``name``: ``configs/<name>.yaml``
    with ``overrides``, or, for a model preset (``tiny``, ``mamba-130m``, ...), the default recipe
    around it.

    ``max_tokens`` replaces the config's ``max_steps``/``max_tokens`` (the notebooks budget in
    tokens). ``evals``: validation points over the run (sets ``eval_every`` to total steps // evals,
    at least 1). A bad value raises :class:`WorkbookError` with TrainConfig's message.
    """
    from ..train import TrainConfig

    if "max_tokens" in overrides:
        overrides.setdefault("max_steps", None)
    if evals is not None and "eval_every" in overrides:
        raise WorkbookError("give evals or eval_every, not both")
    path = _config_dir() / f"{name}.yaml"
    if not path.exists() and name not in run_config_names():
        raise unknown_run_config(name)
    try:
        cfg = (
            TrainConfig.from_yaml(path, overrides=overrides)
            if path.exists()
            else TrainConfig.from_dict({"model": name}, overrides=overrides)
        )
        if evals is not None:
            cfg.eval_every = max(1, cfg.total_steps() // checks.integer(evals, "evals", minimum=1))
    except WorkbookError:
        raise
    except ValueError as exc:
        raise WorkbookError(str(exc)) from None
    return cfg


def format_duration(seconds: float) -> str:
    """``42`` -> "42 s", ``300`` -> "5 min", ``25200`` -> "7 h", ``3e5`` -> "3.5 days"
    (for ETAs and estimates)."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size if unit == "days" else seconds >= size:
            return f"{seconds / size:.2g} {unit}"
    return f"{seconds:.2g} s"


def write_metrics(out_dir: str | Path, metrics: dict) -> Path:
    """Write ``out_dir/metrics.json`` atomically (:func:`ssmkit.io.write_atomically`); returns its
    path.

    ``summary.md`` shows each metric with a unit read from its name
    (:func:`ssmkit.workbook.rundir.unit`): ``*_loss`` nats/token, ``*tok_s`` tokens/s, ``*_seconds``
    s, ``*params`` parameters, ``*_gb`` GiB, ``tokens`` / ``*_tokens`` tokens, ``*_flops`` FLOPs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_atomically(
        out_dir / "metrics.json", json.dumps(metrics, indent=2, default=str) + "\n"
    )


def sample_text(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 40,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> list[str]:
    """Continue each prompt with :func:`ssmkit.generate` (seeded sampling) and decode
    prompt + continuation."""
    import torch

    from ..models import generate

    device = next(model.parameters()).device
    out, gen = [], torch.Generator(device=device).manual_seed(seed)
    model.eval()
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)], device=device)
        new = generate(
            model,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            generator=gen,
        )
        out.append(tokenizer.decode(new[0].tolist()))
    model.train()
    return out


def rounded(value, digits: int = 1):
    """``round(value, digits)``, None for None (a measurement that could not be taken)."""
    return None if value is None else round(value, digits)


def markdown_table(rows: list[dict], floats: str = ".4g") -> str:
    """A list of dicts as a Markdown table (display it with ``IPython.display.Markdown``)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))

    def cell(v) -> str:
        if isinstance(v, float):
            return format(v, floats)
        if v is None:  # not measured or not applicable: a dash, not Python's "None"
            return "—"
        return f"{v:,}" if isinstance(v, int) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)
