"""The workbook: run the notebooks headless with papermill and summarise them; small helpers the notebooks call.

    ssmkit workbook run [NOTEBOOK ...] [-p key value] [-f params.yaml] [--out runs/NAME] [--overwrite]
                        [--cell-timeout SECONDS]
    ssmkit workbook strip [NOTEBOOK ...]          # clear outputs before committing

    summary = run_workbook(["notebooks/00_setup.ipynb"], parameters={"seed": 1}, out="runs/try")

Without NOTEBOOKs, every ``notebooks/NN_*.ipynb`` runs, in order. Each executed copy lands in
``runs/NAME/``; each notebook gets ``out_dir = runs/NAME/<stem>/`` (unless given) for its figures
and ``metrics.json``. ``runs/NAME/summary.md`` (and ``summary.json``) list each notebook's status
(ok, failed, interrupted, not run), wall time and key metrics (read from a ``metrics.json`` the notebook
wrote in this run, never a stale one); a failing notebook is reported with its cell and error, the
others still run, and the command exits 1 if any failed.

Parameters. ``-p`` values are explicit: a key that no notebook of the run declares in its
``parameters`` cell is an error (a typo would otherwise run silently with the default). A
``-f`` file is a shared recipe: each notebook gets the keys it declares and the rest are listed
as unused. ``-p`` wins over ``-f``. Notebooks run with their own folder as working directory, as
in JupyterLab, on a kernel of the Python that runs this module (so ssmkit is importable there).

The run directory. A run writes ``summary.md``, ``summary.json``, the executed copies
``<name>.ipynb`` and the out dirs ``<stem>/``, and records those names in ``.ssmkit-workbook.json``
(``.ssmkit.lock`` keeps a second run out while one is writing). A directory holding a run is refused
unless ``--overwrite`` is given; then the previous summaries and executed copies of the notebooks
being run are replaced and the notebooks write into their out dirs again (their own code replaces
their files, e.g. the Trainer's ``overwrite=True``). A file or folder of one of those names that no
run recorded is never replaced, ``--overwrite`` or not; other files in the directory are left alone.

Stopping. A cell that runs longer than ``--cell-timeout`` seconds (default
:data:`DEFAULT_CELL_TIMEOUT`, or ``$SSMKIT_CELL_TIMEOUT``; 0: no limit) fails its notebook with
"timeout after N s". SIGINT (Ctrl-C) or SIGTERM (Slurm's scancel, preemption, time limit) interrupts
the running kernel, shuts it down, writes the summary (that notebook "interrupted", the later ones
"not run") and exits 130 or 143 (:class:`Interrupted` from :func:`run_workbook`).

Notebook helpers (cells stay short; logic lives here): :func:`check_params` (validate the
``parameters`` cell, resolve ``device="auto"``), :func:`pick_device`, :func:`system_info`,
:func:`preset_info`, :func:`train_config`, :func:`sample_text`, :func:`summarize_run`, :func:`markdown_table`,
:func:`format_duration`, :func:`write_metrics`. papermill, matplotlib and the
Jupyter machinery are imported only when a notebook is run.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

from .io import DirLock, LockError, describe_os_error, read_json, write_atomically, write_json

from .eval import summarize_run  # noqa: E402,F401  (the notebooks call workbook.summarize_run)

PROJECT_ROOT = Path(__file__).resolve().parent.parent   # a source checkout: notebooks/, configs/, params/


class WorkbookError(ValueError):
    """A problem the user can fix: a missing notebook, a bad parameter or params file."""


# --- helpers for the notebooks ------------------------------------------------------------------

def pick_device(device: str = "auto") -> str:
    """:func:`ssmkit.env.pick_device` (``"auto"`` -> cuda, else mps, else cpu), raising :class:`WorkbookError`."""
    from .env import pick_device as _pick

    try:
        return _pick(device)
    except ValueError as exc:
        raise WorkbookError(str(exc)) from None


def _config_dir() -> Path:
    return Path(os.environ.get("SSMKIT_CONFIGS", PROJECT_ROOT / "configs"))


def preset_names() -> list[str]:
    """Valid ``preset`` values: run configs in ``configs/*.yaml`` (cpu-tiny, mamba-130m, ...) and model presets."""
    from .models import presets

    configs = sorted(p.stem for p in _config_dir().glob("*.yaml"))
    return configs + [name for name in presets() if name not in configs]


def _vocab_of(tokenizer: str) -> int | None:
    """The vocabulary size a tokenizer name implies without loading it (None for hub ids / directories)."""
    if tokenizer == "gpt2":
        return 50257
    if tokenizer == "byte":
        return 256
    if tokenizer.startswith("bpe-") and tokenizer[4:].isdigit():
        return int(tokenizer[4:])
    return None


def preset_info(preset: str, max_tokens: int | None = None) -> dict:
    """What a preset trains, estimated without allocating it.

    Returns ``preset``, ``model`` (the model preset: a run config's ``model`` key), ``vocab_size``
    (a run config's tokenizer decides it: gpt2 50257, byte 256, bpe-N N), ``params`` (counted on
    the meta device) and ``train_state_gb``: weights + gradients + AdamW's two moments in fp32, 16
    bytes per parameter (also under bf16 autocast), activations not included. With
    ``max_tokens``: ``train_flops`` = 6 * params * tokens (Kaplan et al. 2020, eq. 2.1; the scan
    adds a few percent) and ``shard_gb``, the token shards at 2 bytes per token (uint16).
    """
    import torch
    import yaml

    from .models import MambaLM, ModelConfig, presets

    path = _config_dir() / f"{preset}.yaml"
    if path.exists():
        raw = yaml.safe_load(path.read_text()) or {}
        model, overrides = raw.get("model", "tiny"), dict(raw.get("model_overrides") or {})
        vocab = _vocab_of(str(raw.get("tokenizer", "gpt2")))
        if vocab is not None:
            overrides.setdefault("vocab_size", vocab)
    elif preset in presets():
        model, overrides = preset, {}
    else:
        raise WorkbookError(f"unknown preset {preset!r}; valid: {', '.join(preset_names())}")
    cfg = ModelConfig.preset(model, **overrides)
    with torch.device("meta"):
        n = sum(p.numel() for p in MambaLM(cfg).parameters())
    info = {"preset": preset, "model": model, "vocab_size": cfg.vocab_size, "params": n,
            "train_state_gb": round(16 * n / 2**30, 3)}
    if max_tokens is not None:
        info["train_flops"] = float(6 * n * max_tokens)
        info["shard_gb"] = round(2 * max_tokens / 2**30, 3)
    return info


def _as_int(name: str, value, minimum: int) -> int:
    if isinstance(value, float) and value.is_integer():   # 2e5 from YAML or -p
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise WorkbookError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return value


def check_params(**params) -> dict:
    """Validate a notebook's ``parameters`` cell; returns the values, resolved.

    Known keys: ``preset`` (see :func:`preset_names`), ``data`` (a source name or an existing
    path), ``max_tokens`` (int >= 1), ``device`` (resolved by :func:`pick_device`), ``out_dir``
    (created; returned as a :class:`~pathlib.Path`), ``seed`` (int >= 0). Other keys pass through.
    The first bad value raises :class:`WorkbookError` naming it and what is valid.
    """
    out = dict(params)
    if "preset" in out and out["preset"] not in preset_names():
        raise WorkbookError(f"unknown preset {out['preset']!r}; valid: {', '.join(preset_names())}")
    if "data" in out:
        from .data import REMOTE

        data = out["data"]
        if not isinstance(data, str) or not (data in ("stdlib-docs", *REMOTE) or Path(data).exists()):
            raise WorkbookError(f"data={data!r} is not valid; valid: 'stdlib-docs', "
                                f"{', '.join(repr(n) for n in REMOTE)}, or an existing path")
    if "max_tokens" in out:
        out["max_tokens"] = _as_int("max_tokens", out["max_tokens"], 1)
    if "seed" in out:
        out["seed"] = _as_int("seed", out["seed"], 0)
    if "device" in out:
        out["device"] = pick_device(out["device"])
    if "out_dir" in out:
        if not isinstance(out["out_dir"], (str, Path)) or not str(out["out_dir"]):
            raise WorkbookError(f"out_dir must be a non-empty path; got {out['out_dir']!r}")
        out["out_dir"] = Path(out["out_dir"])
        out["out_dir"].mkdir(parents=True, exist_ok=True)
    return out


def _module_status(name: str) -> str:
    """"version" if it imports, "not installed", or "broken (<error>)" (CUDA extensions raise more than ImportError)."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        return "not installed"
    try:
        module = __import__(name)
    except Exception as exc:
        return f"broken ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return getattr(module, "__version__", "installed")


def system_info(path: str | Path = ".") -> dict:
    """Facts a run depends on: Python, torch, CUDA / GPU (name, memory, bf16), kernels, CPUs, free disk at ``path``."""
    import platform

    import torch

    cuda = torch.cuda.is_available()
    info = {
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
    return info


def format_duration(seconds: float) -> str:
    """``42`` -> "42 s", ``300`` -> "5 min", ``25200`` -> "7 h", ``3e5`` -> "3.5 days" (for ETAs and estimates)."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size if unit == "days" else seconds >= size:
            return f"{seconds / size:.2g} {unit}"
    return f"{seconds:.2g} s"


def write_metrics(out_dir: str | Path, metrics: dict) -> Path:
    """Write ``out_dir/metrics.json`` atomically (temporary name, then rename); returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_atomically(out_dir / "metrics.json", json.dumps(metrics, indent=2, default=str) + "\n")


def train_config(preset: str, **overrides):
    """The :class:`ssmkit.train.TrainConfig` of ``preset``: ``configs/<preset>.yaml`` with ``overrides``,
    or, for a bare model preset (``tiny``, ``mamba-130m``, ...), the default recipe around that model.

    ``max_tokens`` replaces the config's ``max_steps``/``max_tokens`` (the notebooks budget in tokens).
    """
    from .train import TrainConfig

    if "max_tokens" in overrides:
        overrides.setdefault("max_steps", None)
    path = _config_dir() / f"{preset}.yaml"
    if path.exists():
        return TrainConfig.from_yaml(path, overrides=overrides)
    if preset not in preset_names():
        raise WorkbookError(f"unknown preset {preset!r}; valid: {', '.join(preset_names())}")
    return TrainConfig.from_dict({"model": preset}, overrides=overrides)


def sample_text(model, tokenizer, prompts: list[str], max_new_tokens: int = 40, temperature: float = 0.8,
                top_k: int = 40, seed: int = 0) -> list[str]:
    """Continue each prompt with :func:`ssmkit.generate` (seeded sampling) and decode prompt + continuation."""
    import torch

    from .models import generate

    device = next(model.parameters()).device
    out, gen = [], torch.Generator(device=device).manual_seed(seed)
    model.eval()
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)], device=device)
        new = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
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


# --- notebooks on disk --------------------------------------------------------------------------

def find_notebooks(root: str | Path | None = None) -> list[Path]:
    """``notebooks/NN_*.ipynb`` under ``root`` (default: ./notebooks if it exists, else the checkout's), sorted."""
    if root is None:
        root = Path("notebooks") if Path("notebooks").is_dir() else PROJECT_ROOT / "notebooks"
    found = sorted(p for p in Path(root).glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise WorkbookError(f"no notebooks matching NN_*.ipynb in {root}; pass notebook paths explicitly")
    return found


def _load(path: Path) -> dict:
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:        # UnicodeDecodeError is a ValueError
        raise WorkbookError(f"{path} is not a readable notebook: {exc}") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells", []), list):
        raise WorkbookError(f"{path} is not a notebook: expected a JSON object with a list of cells")
    return nb


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def declared_parameters(path: str | Path) -> dict:
    """Names and default values assigned in the notebook's cell tagged ``parameters`` ({} if none)."""
    path = Path(path)
    for cell in _load(path).get("cells", []):
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            try:
                tree = ast.parse(_source(cell))
            except SyntaxError as exc:
                raise WorkbookError(f"{path}: the parameters cell is not valid Python: {exc}") from None
            out = {}
            for node in tree.body:
                if isinstance(node, ast.AnnAssign):
                    node = ast.Assign(targets=[node.target], value=node.value)
                for t in getattr(node, "targets", []):
                    if isinstance(t, ast.Name):
                        try:
                            out[t.id] = ast.literal_eval(node.value)
                        except (ValueError, TypeError, SyntaxError):
                            out[t.id] = ast.unparse(node.value)       # not a plain value: its source
            return out
    return {}


def strip_notebook(path: str | Path) -> bool:
    """Clear outputs, execution counts and run metadata (papermill, execution timings) in place; True if changed."""
    path = Path(path)
    nb = _load(path)
    before = json.dumps(nb, sort_keys=True)
    for key in ("papermill", "widgets"):
        nb.get("metadata", {}).pop(key, None)
    for cell in nb.get("cells", []):
        for key in ("papermill", "execution", "collapsed", "scrolled"):
            cell.get("metadata", {}).pop(key, None)
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    if json.dumps(nb, sort_keys=True) == before:
        return False
    write_atomically(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return True


def load_params_file(path: str | Path) -> dict:
    """A YAML (or JSON) mapping of parameter names to plain values."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise WorkbookError(f"params file {path} does not exist")
    if not path.is_file():
        raise WorkbookError(f"params file {path} is not a file; expected a YAML file of parameter names and values")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise WorkbookError(f"params file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    except OSError as exc:
        raise WorkbookError(f"params file {path} cannot be read: {describe_os_error(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) and k.isidentifier() for k in data):
        raise WorkbookError(f"params file {path} must be a mapping of parameter names to values; got {data!r:.200}")
    return data


def parse_value(text: str):
    """A ``-p`` value: int, float, true/false, none/null, else the string itself (``3e-3`` is a float)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None, "null": None}.get(text.lower(), text)


# --- running --------------------------------------------------------------------------------------

DEFAULT_CELL_TIMEOUT = 3600      # s: no CPU-default cell comes near it (a whole notebook takes <= 5 min); a hang ends
RECORD = ".ssmkit-workbook.json"  # in a run directory: the names runs wrote there (what --overwrite may replace)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped :func:`run_workbook`; raised after the summary was written (``summary``).
    ``signum`` says which signal: the command exits 128 + signum (130, 143)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.summary = signum, None


class _StopOnSignals:
    """While active (main thread only), the first SIGINT or SIGTERM raises :class:`Interrupted` wherever the run is;
    later ones, and any after :meth:`disarm`, are ignored: the run is already stopping (kernel shutdown, summary).

    The exception leaves nbclient's event-loop tasks for the running cell behind; :meth:`settle` ends them once the
    kernel is gone, so asyncio does not print them at exit ("Task exception was never retrieved")."""

    def __enter__(self):
        self.armed, self.previous, self.cut_off = True, {}, None
        self.outer = _running_loop()                 # e.g. Jupyter's own loop when run from a notebook: not ours
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)
                             if signal.getsignal(s) != signal.SIG_IGN}   # ignored (`cmd &` in a script): stays so
        return self

    def _handle(self, signum, frame):
        if self.armed:
            self.armed = False
            loop = _running_loop()
            if loop is not None and loop is not self.outer:
                self.cut_off = loop, asyncio.all_tasks(loop)
            raise Interrupted(signum)

    def disarm(self):
        self.armed = False

    def settle(self):
        if self.cut_off:
            loop, tasks = self.cut_off
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.wait(tasks, timeout=5))
            for task in tasks:
                if task.done() and not task.cancelled():
                    task.exception()                 # retrieved: not printed at exit

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _seconds(value, what: str) -> int | None:
    """A cell timeout as nbclient takes it: whole seconds (rounded up), None for 0 (no limit)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (0 <= seconds < math.inf):
        raise WorkbookError(f"{what} must be a number of seconds >= 0 (0: no limit); got {value!r}")
    return math.ceil(seconds) or None


def default_cell_timeout() -> int | None:
    """Seconds a cell may run by default: ``$SSMKIT_CELL_TIMEOUT`` (0: no limit), else :data:`DEFAULT_CELL_TIMEOUT`."""
    text = os.environ.get("SSMKIT_CELL_TIMEOUT", "").strip()
    return _seconds(text, "SSMKIT_CELL_TIMEOUT") if text else DEFAULT_CELL_TIMEOUT


def _check_kernel(name: str) -> None:
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().find_kernel_specs()
    if name not in specs:
        raise WorkbookError(f"no Jupyter kernel named {name!r}; installed: {', '.join(sorted(specs)) or 'none'} "
                            "(without --kernel: ipykernel on this Python)")


def _kernel_manager_class(kernel_name: str | None, started: list):
    """The kernel manager of a run; each one is appended to ``started`` (see :func:`_end_kernels`). Without
    ``kernel_name`` its kernel is ipykernel on *this* interpreter (whatever ``python3`` spec a user has). Its shutdown
    interrupts a busy kernel and lets the interrupted cell answer before asking the kernel to exit (after a timeout,
    Ctrl-C, SIGTERM) instead of racing it, which made the kernel print ZMQ errors about a closed socket."""
    from ipykernel.kernelspec import RESOURCES, get_kernel_dict
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec

    class RunKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            started.append(self)
            if not kernel_name and "transport_encryption" in self.trait_names():   # jupyter_client >= 8.7: CurveZMQ
                import zmq

                self.transport_encryption = "auto" if zmq.has("curve") else "disabled"

        @property
        def kernel_spec(self):
            return super().kernel_spec if kernel_name else KernelSpec(resource_dir=RESOURCES, **get_kernel_dict())

        async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:
            if self.has_kernel and not now:
                await self.interrupt_kernel()
                await asyncio.sleep(0.5)
            await super().shutdown_kernel(now=now, restart=restart)

    return RunKernelManager


def _end_kernels(started: list) -> None:
    """Kill the kernels of ``started`` still alive (a signal cut nbclient's own shutdown short); empties the list."""
    from jupyter_core.utils import run_sync

    while started:
        km = started.pop()
        try:
            if km.has_kernel:
                run_sync(km.shutdown_kernel)(now=True)
        except Exception:       # already gone
            pass


def _excerpt(source: str, lines: int = 8) -> str:
    rows = source.strip("\n").splitlines()
    return "\n".join(rows[:lines] + (["..."] if len(rows) > lines else []))


def _original_index(cells: list, index: int) -> int:
    """Cell ``index`` of an executed copy, counted in the original notebook (papermill's injected cell left out)."""
    return index - sum("injected-parameters" in c.get("metadata", {}).get("tags", []) for c in cells[:index])


def _stopped_cell(executed: Path) -> dict:
    """Where a notebook stopped without a cell error (a timeout, a signal): the last cell papermill started in the
    executed copy, as ``cell`` (original notebook, 0-based), ``execution_count`` and ``source``; {} if unknown."""
    try:
        cells = _load(executed)["cells"]
    except (WorkbookError, KeyError):
        return {}
    started = [i for i, c in enumerate(cells) if (c.get("metadata", {}).get("papermill") or {}).get("start_time")]
    if not started:
        return {}
    cell = cells[started[-1]]
    return {"cell": _original_index(cells, started[-1]), "execution_count": cell.get("execution_count"),
            "source": _excerpt(_source(cell))}


def _failure(exc: Exception, executed: Path, timeout: int | None) -> dict:
    """Where and why a notebook failed; the cell index counts cells of the original notebook (0-based)."""
    from nbclient.exceptions import CellTimeoutError
    from papermill.exceptions import PapermillExecutionError

    if isinstance(exc, CellTimeoutError) and "Cell execution timed out" in str(exc):
        return {**_stopped_cell(executed),
                "error": f"timeout after {timeout} s (raise it with --cell-timeout SECONDS; 0: no limit)"}
    if not isinstance(exc, PapermillExecutionError):
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:2000]}"}
    try:
        index = _original_index(_load(executed)["cells"], exc.cell_index)
    except (WorkbookError, KeyError):
        index = exc.cell_index
    return {"cell": index, "execution_count": exc.exec_count, "source": _excerpt(exc.source),
            "error": f"{exc.ename}: {exc.evalue}"}


def _stamp(path: Path):
    """What tells a rewritten file from the old one (an atomic rename makes a new inode)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _key_metrics(path: Path, limit: int = 12) -> dict:
    """Scalar entries of a metrics.json (numbers, bools, short strings), at most ``limit``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    keep = {k: v for k, v in data.items()
            if isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 60) or v is None}
    return dict(list(keep.items())[:limit])


def _recorded(out: Path) -> set[str]:
    """The names earlier runs recorded as written in ``out`` (empty if none)."""
    path = out / RECORD
    if not path.exists():
        return set()
    try:
        names = read_json(path, "run record").get("written")
    except (ValueError, AttributeError):
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise WorkbookError(f"run record {path} is not readable: move {out} aside or choose another --out")
    return set(names)


def _previous_outputs(out: Path, names: list[str], overwrite: bool) -> list[str]:
    """The ``names`` a run would write that ``out`` already holds; raises :class:`WorkbookError` (touching nothing)
    if one of them was not written by a run, or if there are any and not ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise WorkbookError(f"--out {out} is a file; expected a directory for the run")
    if not out.exists():
        return []
    ours = _recorded(out)
    present = [n for n in names if os.path.lexists(out / n)]
    for n in present:
        if n not in ours or (out / n).is_symlink():
            raise WorkbookError(f"{out / n} exists and was not written by `ssmkit workbook run` (not in {RECORD}): "
                                "refusing to replace it; move it or choose another --out")
    if present and not overwrite:
        shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
        raise WorkbookError(f"--out {out} already holds a run ({shown}): pass --overwrite to replace its results, "
                            "or choose another directory")
    return present


def _claim(out: Path, files: list[str], dirs: list[str], overwrite: bool) -> None:
    """Check ``out`` again (now under the run's lock), record the names this run writes, and remove the previous
    run's summaries and executed copies among them (its out dirs stay: the notebooks rewrite their files)."""
    present = _previous_outputs(out, files + dirs, overwrite)
    write_json(out / RECORD, {"written": sorted(_recorded(out) | set(files) | set(dirs))})
    for name in present:
        if name in files:
            (out / name).unlink()


def run_workbook(notebooks=None, parameters: dict | None = None, out=None, *, shared: dict | None = None,
                 kernel_name: str | None = None, cell_timeout: float | None = None, overwrite: bool = False,
                 progress: bool = False, log_output: bool = False) -> dict:
    """Execute notebooks with papermill into ``out`` and write ``summary.md`` / ``summary.json`` there.

    notebooks: paths (default: :func:`find_notebooks`); parameters: explicit values, each must be
    declared by at least one notebook; shared: values (a params file) given to the notebooks that
    declare them; out: the run directory (default ``runs/<timestamp>``); overwrite: replace the results
    of an earlier run in ``out`` (see the module docstring); kernel_name: a Jupyter kernel spec to use
    instead of this interpreter; cell_timeout: seconds one cell may run (None: :func:`default_cell_timeout`,
    0: no limit). Returns the summary dict (also summary.json); ``summary["failed"]`` counts failed
    notebooks. Raises :class:`WorkbookError` before running anything (and without touching ``out``) when a
    notebook is missing, a parameter is declared by none of them, or ``out`` holds a run; raises
    :class:`Interrupted` on SIGINT / SIGTERM, after the summary is written.
    """
    paths = [Path(p) for p in notebooks] if notebooks else find_notebooks()
    for p in paths:
        if p.is_dir():
            raise WorkbookError(f"{p} is a directory; pass notebook files (.ipynb)")
        if not p.is_file():
            raise WorkbookError(f"notebook {p} does not exist")
        if p.suffix != ".ipynb":
            raise WorkbookError(f"{p} is not a notebook (.ipynb)")
    stems = [p.stem for p in paths]
    if len(set(stems)) != len(stems):
        raise WorkbookError(f"two notebooks share a name: {', '.join(stems)}")
    parameters, shared = dict(parameters or {}), dict(shared or {})
    declared = {p: declared_parameters(p) for p in paths}
    known = set().union(*declared.values())
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise WorkbookError(f"parameter(s) {', '.join(unknown)} not declared by any notebook of this run; "
                            f"declared: {', '.join(sorted(known)) or 'none'}")
    timeout = default_cell_timeout() if cell_timeout is None else _seconds(cell_timeout, "cell_timeout")
    try:
        import papermill  # noqa: F401
    except ImportError:
        raise WorkbookError("papermill is not installed: pip install 'ssmkit[workbook]'") from None
    if kernel_name:
        _check_kernel(kernel_name)
    values = {p: {k: v for k, v in {**shared, **parameters}.items() if k in declared[p]} for p in paths}
    out = Path(out) if out else Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    files = ["summary.md", "summary.json", *(p.name for p in paths)]
    dirs = [p.stem for p in paths if "out_dir" in declared[p] and "out_dir" not in values[p]]
    _previous_outputs(out, files + dirs, overwrite)            # a refused run touches nothing
    lock = DirLock(out, "workbook run")
    try:
        lock.acquire()
        try:
            _claim(out, files, dirs, overwrite)
        except BaseException:
            lock.release()
            raise
    except LockError as exc:
        raise WorkbookError(str(exc)) from None
    except OSError as exc:
        raise WorkbookError(describe_os_error(exc)) from None
    entries = [{"notebook": str(p), "status": "not run", "executed": None, "parameters": values[p], "seconds": None,
                "metrics_file": None, "metrics": {}, "unused_shared": sorted(set(shared) - set(declared[p]))}
               for p in paths]
    summary = {"run": str(out), "started": datetime.now().isoformat(timespec="seconds"), "python": sys.executable,
               "parameters": parameters, "shared": shared, "cell_timeout": timeout, "notebooks": entries,
               "failed": 0, "interrupted": None}
    options = {"kernel_name": kernel_name or "python3", "language": "python", "progress_bar": progress,
               "log_output": log_output, "execution_timeout": timeout}
    kernels = []
    options["kernel_manager_class"] = _kernel_manager_class(kernel_name, kernels)
    stopped = None
    try:
        with _StopOnSignals() as signals:
            try:
                for i, (path, entry) in enumerate(zip(paths, entries), 1):
                    print(f"[{i}/{len(paths)}] {path.name} ...", flush=True)
                    try:
                        _run_one(path, entry, out, declared[path], options)
                    finally:
                        _end_kernels(kernels)
                    error = f": {entry['error']}" if "error" in entry else ""
                    print(f"      {entry['status']} in {entry['seconds']} s{error}", flush=True)
            except Interrupted as exc:
                stopped, summary["interrupted"] = exc, str(exc)
                signals.settle()
                for e in entries:
                    if e["status"] == "running":               # stopped before papermill ran it
                        e.update(status="interrupted", error=f"interrupted by {exc}")
            finally:           # also after an error: what ran is summarised, and no signal stops that
                signals.disarm()
                summary["failed"] = sum(e["status"] == "failed" for e in entries)
                summary["finished"] = datetime.now().isoformat(timespec="seconds")
                write_summary(summary, out)
    finally:
        lock.release()
    if stopped is not None:
        stopped.summary = summary
        raise stopped
    return summary


def _run_one(path: Path, entry: dict, out: Path, declared: dict, options: dict) -> None:
    """Execute one notebook into ``out/<name>``, filling in its summary ``entry``. A notebook's error is reported
    there, never raised; :class:`Interrupted` passes through once the entry says "interrupted"."""
    import papermill

    executed, values = out / path.name, entry["parameters"]
    entry.update(status="running", executed=str(executed))
    start, metrics, old_metrics = time.perf_counter(), None, None
    try:
        if "out_dir" in declared and "out_dir" not in values:
            (out / path.stem).mkdir(exist_ok=True)
            values["out_dir"] = str((out / path.stem).resolve())
        # a relative out_dir given as a parameter starts at the notebook's folder (its working directory)
        metrics = (path.resolve().parent / values["out_dir"] if "out_dir" in values else out / path.stem) / \
            "metrics.json"
        old_metrics = _stamp(metrics)
        papermill.execute_notebook(str(path), str(executed), parameters=values, cwd=str(path.resolve().parent),
                                   **options)
        entry["status"] = "ok"
    except Interrupted as exc:
        entry.update(status="interrupted", **_stopped_cell(executed), error=f"interrupted by {exc}")
        raise
    except Exception as exc:   # a cell error, a dead kernel, a timeout, a full disk: report it and go on
        entry["status"] = "failed"
        entry.update(_failure(exc, executed, options["execution_timeout"]))
    finally:
        entry["seconds"] = round(time.perf_counter() - start, 1)
        if metrics is not None and _stamp(metrics) not in (None, old_metrics):   # this run's, not a stale one
            entry["metrics_file"], entry["metrics"] = str(metrics), _key_metrics(metrics)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value).replace("|", "\\|")


def write_summary(summary: dict, out: str | Path) -> Path:
    """``out/summary.md`` (a table, then one section per failed or interrupted notebook) and ``out/summary.json``;
    returns the .md path."""
    out = Path(out)
    counts = Counter(e["status"] for e in summary["notebooks"])
    tally = f"{counts['ok']} ok, {counts['failed']} failed" + "".join(
        f", {counts[s]} {s}" for s in ("interrupted", "not run") if counts[s])
    stopped = f" Interrupted by {summary['interrupted']}." if summary.get("interrupted") else ""
    rows = [f"# Workbook run `{summary['run']}`", "",
            f"Started {summary['started']}, finished {summary.get('finished', '?')}; {tally}.{stopped}", "",
            "| notebook | status | time (s) | key metrics |", "|---|---|---|---|"]
    for e in summary["notebooks"]:
        metrics = ", ".join(f"{k}={_fmt(v)}" for k, v in e["metrics"].items()) or "–"
        seconds = "–" if e["seconds"] is None else e["seconds"]
        rows.append(f"| {Path(e['notebook']).name} | {e['status']} | {seconds} | {metrics} |")
    for e in summary["notebooks"]:
        if e["status"] in ("failed", "interrupted"):
            rows += ["", f"## {Path(e['notebook']).name} {e['status']}", ""]
            if "cell" in e:
                rows += [f"Cell {e['cell']} (execution count {e['execution_count']}):", "", "```python",
                         e["source"], "```", ""]
            rows += [f"Error: `{e['error']}`", "", f"Executed copy with the traceback: `{e['executed']}`"]
    if summary.get("parameters") or summary.get("shared"):
        rows += ["", "## Parameters", "", f"- explicit (-p): `{summary['parameters']}`",
                 f"- shared (-f): `{summary['shared']}`"]
        rows += [f"- {Path(e['notebook']).name} ignores: {', '.join(e['unused_shared'])}"
                 for e in summary["notebooks"] if e["unused_shared"]]
    try:
        write_atomically(out / "summary.md", "\n".join(rows) + "\n")
        write_atomically(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    except OSError as exc:
        exc.filename = exc.filename or str(out / "summary.md")   # a failed fsync names no file
        raise
    return out / "summary.md"


# --- command line ---------------------------------------------------------------------------------

def main(argv=None) -> None:
    """``ssmkit workbook run|strip ...``; exits 1 if a notebook failed (or a file could not be written), 2 on bad
    arguments or inputs (a refused run touches nothing), 128 + signal number when interrupted (130, 143)."""
    parser = argparse.ArgumentParser(prog="ssmkit workbook", description="run the notebooks headless with papermill")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks into runs/NAME/ and write summary.md")
    run.add_argument("notebooks", nargs="*", help="notebook paths (default: notebooks/NN_*.ipynb in order)")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                     help="a parameter for the notebooks that declare it (repeatable); an undeclared key is an error")
    run.add_argument("-f", "--params-file", help="YAML file of parameters; each notebook gets the keys it declares")
    run.add_argument("--out", help="run directory (default: runs/<timestamp>); one that holds a run is refused")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the results of an earlier run in --out (never a file that no run wrote)")
    run.add_argument("--kernel", help="a Jupyter kernel spec name (default: ipykernel on this Python)")
    run.add_argument("--cell-timeout", metavar="SECONDS",
                     help="seconds one cell may run, 0: no limit "
                          f"(default: $SSMKIT_CELL_TIMEOUT or {DEFAULT_CELL_TIMEOUT})")
    run.add_argument("--progress", action="store_true", help="papermill's per-cell progress bar")
    run.add_argument("--log-output", action="store_true", help="stream the notebooks' output to the terminal")
    strip = sub.add_parser("strip", help="clear outputs and execution counts in place")
    strip.add_argument("notebooks", nargs="*", help="notebook paths (default: notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    try:
        if args.command == "strip":
            paths = args.notebooks or sorted(Path("notebooks").glob("*.ipynb"))
            for p in paths:
                if not Path(p).is_file():
                    raise WorkbookError(f"notebook {p} does not exist")
                print(f"{'stripped' if strip_notebook(p) else 'clean   '} {p}")
            return
        if args.cell_timeout is not None:
            _seconds(args.cell_timeout, "--cell-timeout")        # checked here to name the option
        shared = load_params_file(args.params_file) if args.params_file else {}
        for key, _ in args.parameter:
            if not key.isidentifier():
                raise WorkbookError(f"-p {key}: a parameter name must be a Python identifier")
        params = {key: parse_value(value) for key, value in args.parameter}
        if args.log_output:
            import logging

            logging.basicConfig(level=logging.INFO, format="%(message)s")
        summary = run_workbook(args.notebooks or None, params, args.out, shared=shared, kernel_name=args.kernel,
                               cell_timeout=args.cell_timeout,
                               overwrite=args.overwrite, progress=args.progress, log_output=args.log_output)
    except WorkbookError as exc:
        parser.exit(2, f"ssmkit workbook: {exc}\n")
    except Interrupted as exc:
        parser.exit(128 + exc.signum, f"ssmkit workbook: interrupted by {exc}; summary: "
                                      f"{Path(exc.summary['run']) / 'summary.md'}\n")
    except OSError as exc:                              # disk full, read-only or vanished directory
        parser.exit(1, f"ssmkit workbook: {describe_os_error(exc)}\n")
    print(f"summary: {Path(summary['run']) / 'summary.md'}")
    if summary["failed"]:
        parser.exit(1, f"ssmkit workbook: {summary['failed']} of {len(summary['notebooks'])} notebook(s) failed\n")


if __name__ == "__main__":
    main()
