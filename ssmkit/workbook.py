"""The workbook: run the notebooks headless with papermill and summarise them; small helpers the notebooks call.

    ssmkit workbook run [NOTEBOOK ...] [-p key value] [-f params.yaml] [--out runs/NAME]
    ssmkit workbook strip [NOTEBOOK ...]          # clear outputs before committing

    summary = run_workbook(["notebooks/00_setup.ipynb"], parameters={"seed": 1}, out="runs/try")

Without NOTEBOOKs, every ``notebooks/NN_*.ipynb`` runs, in order. Each executed copy lands in
``runs/NAME/``; each notebook gets ``out_dir = runs/NAME/<stem>/`` (unless given) for its figures
and ``metrics.json``. ``runs/NAME/summary.md`` (and ``summary.json``) list each notebook's status,
wall time and key metrics; a failing notebook is reported with its cell and error, the others
still run, and the command exits 1 if any failed.

Parameters. ``-p`` values are explicit: a key that no notebook of the run declares in its
``parameters`` cell is an error (a typo would otherwise run silently with the default). A
``-f`` file is a shared recipe: each notebook gets the keys it declares and the rest are listed
as unused. ``-p`` wins over ``-f``. Notebooks run with their own folder as working directory, as
in JupyterLab, on a kernel of the Python that runs this module (so ssmkit is importable there).

Notebook helpers (cells stay short; logic lives here): :func:`check_params` (validate the
``parameters`` cell, resolve ``device="auto"``), :func:`pick_device`, :func:`system_info`,
:func:`preset_info`, :func:`train_config`, :func:`sample_text`, :func:`summarize_run`, :func:`markdown_table`,
:func:`format_duration`, :func:`write_metrics`. papermill, matplotlib and the
Jupyter machinery are imported only when a notebook is run.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

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
    from .data.shards import write_atomically

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


def summarize_run(records: list[dict]) -> dict:
    """The headline numbers of a Trainer history: tokens seen, first and last validation loss, the last
    perplexity, and the median training tokens/s (``None`` where the history has no such records)."""
    evals = [r for r in records if r.get("kind") == "eval"]
    rates = sorted(r["tokens_per_s"] for r in records if r.get("kind") == "train")
    return {"tokens": evals[-1]["tokens"] if evals else None,
            "first_val_loss": round(evals[0]["val_loss"], 4) if evals else None,
            "val_loss": round(evals[-1]["val_loss"], 4) if evals else None,
            "val_ppl": round(evals[-1]["val_ppl"], 2) if evals else None,
            "train_tok_s": round(rates[len(rates) // 2]) if rates else None}


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
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WorkbookError(f"{path} is not a readable notebook: {exc}") from None


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
    from .data.shards import write_atomically

    write_atomically(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return True


def load_params_file(path: str | Path) -> dict:
    """A YAML (or JSON) mapping of parameter names to plain values."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise WorkbookError(f"params file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise WorkbookError(f"params file {path} is not valid YAML: {exc}") from None
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

def _kernel_manager_class():
    """A kernel manager whose kernel is ipykernel on *this* interpreter (whatever ``python3`` spec a user has)."""
    from ipykernel.kernelspec import RESOURCES, get_kernel_dict
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec

    class ThisPythonKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            if "transport_encryption" in self.trait_names():   # jupyter_client >= 8.7: CurveZMQ when possible
                import zmq

                self.transport_encryption = "auto" if zmq.has("curve") else "disabled"

        @property
        def kernel_spec(self):
            return KernelSpec(resource_dir=RESOURCES, **get_kernel_dict())

    return ThisPythonKernelManager


def _excerpt(source: str, lines: int = 8) -> str:
    rows = source.strip("\n").splitlines()
    return "\n".join(rows[:lines] + (["..."] if len(rows) > lines else []))


def _failure(exc: Exception, executed: Path) -> dict:
    """Where and why a notebook failed; the cell index counts cells of the original notebook (0-based)."""
    from papermill.exceptions import PapermillExecutionError

    if not isinstance(exc, PapermillExecutionError):
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:2000]}"}
    index = exc.cell_index
    try:
        cells = _load(executed)["cells"][:index]
        index -= sum("injected-parameters" in c.get("metadata", {}).get("tags", []) for c in cells)
    except (WorkbookError, KeyError):
        pass
    return {"cell": index, "execution_count": exc.exec_count, "source": _excerpt(exc.source),
            "error": f"{exc.ename}: {exc.evalue}"}


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


def run_workbook(notebooks=None, parameters: dict | None = None, out=None, *, shared: dict | None = None,
                 kernel_name: str | None = None, cell_timeout: float | None = None, progress: bool = False,
                 log_output: bool = False) -> dict:
    """Execute notebooks with papermill into ``out`` and write ``summary.md`` / ``summary.json`` there.

    notebooks: paths (default: :func:`find_notebooks`); parameters: explicit values, each must be
    declared by at least one notebook; shared: values (a params file) given to the notebooks that
    declare them; out: the run directory (default ``runs/<timestamp>``); kernel_name: a Jupyter
    kernel spec to use instead of this interpreter; cell_timeout: seconds one cell may run (None:
    no limit). Returns the summary dict (also summary.json, written even after Ctrl-C);
    ``summary["failed"]`` counts failed notebooks. Raises :class:`WorkbookError` before running
    anything when a notebook is missing or a parameter is declared by none of them.
    """
    paths = [Path(p) for p in notebooks] if notebooks else find_notebooks()
    for p in paths:
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
    out = Path(out) if out else Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    summary = {"run": str(out), "started": datetime.now().isoformat(timespec="seconds"), "python": sys.executable,
               "parameters": parameters, "shared": shared, "notebooks": [], "failed": 0}
    options = {"kernel_name": kernel_name or "python3", "language": "python", "progress_bar": progress,
               "log_output": log_output, "execution_timeout": cell_timeout}
    if not kernel_name:
        options["kernel_manager_class"] = _kernel_manager_class()
    try:
        for i, path in enumerate(paths, 1):
            print(f"[{i}/{len(paths)}] {path.name} ...", flush=True)
            values = {k: v for k, v in {**shared, **parameters}.items() if k in declared[path]}
            entry = _run_one(path, values, out, declared[path], options)
            entry["unused_shared"] = sorted(set(shared) - set(declared[path]))
            summary["notebooks"].append(entry)
            summary["failed"] += entry["status"] != "ok"
            error = f": {entry['error']}" if "error" in entry else ""
            print(f"      {entry['status']} in {entry['seconds']} s{error}", flush=True)
    finally:                   # also after Ctrl-C: what ran is summarised
        summary["finished"] = datetime.now().isoformat(timespec="seconds")
        write_summary(summary, out)
    return summary


def _run_one(path: Path, values: dict, out: Path, declared: dict, options: dict) -> dict:
    """Execute one notebook into ``out/<name>``; returns its summary entry (never raises for a notebook error)."""
    import papermill

    if "out_dir" in declared and "out_dir" not in values:
        (out / path.stem).mkdir(exist_ok=True)
        values["out_dir"] = str((out / path.stem).resolve())
    executed = out / path.name
    entry = {"notebook": str(path), "executed": str(executed), "parameters": values}
    start = time.perf_counter()
    try:
        papermill.execute_notebook(str(path), str(executed), parameters=values, cwd=str(path.resolve().parent),
                                   **options)
        entry["status"] = "ok"
    except Exception as exc:   # a cell error, a dead kernel, a timeout: report it and go on
        entry["status"] = "failed"
        entry.update(_failure(exc, executed))
    entry["seconds"] = round(time.perf_counter() - start, 1)
    # a relative out_dir given as a parameter starts at the notebook's folder (its working directory)
    metrics = (path.resolve().parent / values["out_dir"] if "out_dir" in values else out / path.stem) / "metrics.json"
    entry["metrics_file"] = str(metrics) if metrics.exists() else None
    entry["metrics"] = _key_metrics(metrics)
    return entry


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value).replace("|", "\\|")


def write_summary(summary: dict, out: str | Path) -> Path:
    """``out/summary.md`` (a table, then one section per failure) and ``out/summary.json``; returns the .md path."""
    out = Path(out)
    rows = [f"# Workbook run `{summary['run']}`", "",
            f"Started {summary['started']}, finished {summary.get('finished', '?')}; "
            f"{len(summary['notebooks']) - summary['failed']} ok, {summary['failed']} failed.", "",
            "| notebook | status | time (s) | key metrics |", "|---|---|---|---|"]
    for e in summary["notebooks"]:
        metrics = ", ".join(f"{k}={_fmt(v)}" for k, v in e["metrics"].items()) or "–"
        rows.append(f"| {Path(e['notebook']).name} | {e['status']} | {e['seconds']} | {metrics} |")
    for e in summary["notebooks"]:
        if e["status"] != "ok":
            rows += ["", f"## {Path(e['notebook']).name} failed", ""]
            if "cell" in e:
                rows += [f"Cell {e['cell']} (execution count {e['execution_count']}):", "", "```python",
                         e["source"], "```", ""]
            rows += [f"Error: `{e['error']}`", "", f"Executed copy with the traceback: `{e['executed']}`"]
    if summary.get("parameters") or summary.get("shared"):
        rows += ["", "## Parameters", "", f"- explicit (-p): `{summary['parameters']}`",
                 f"- shared (-f): `{summary['shared']}`"]
        rows += [f"- {Path(e['notebook']).name} ignores: {', '.join(e['unused_shared'])}"
                 for e in summary["notebooks"] if e["unused_shared"]]
    md, js = out / "summary.md", out / "summary.json"
    from .data.shards import write_atomically

    write_atomically(md, "\n".join(rows) + "\n")
    write_atomically(js, json.dumps(summary, indent=2, default=str) + "\n")
    return md


# --- command line ---------------------------------------------------------------------------------

def main(argv=None) -> None:
    """``ssmkit workbook run|strip ...``; exits 1 if a notebook failed, 2 on bad arguments or inputs."""
    parser = argparse.ArgumentParser(prog="ssmkit workbook", description="run the notebooks headless with papermill")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks into runs/NAME/ and write summary.md")
    run.add_argument("notebooks", nargs="*", help="notebook paths (default: notebooks/NN_*.ipynb in order)")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                     help="a parameter for the notebooks that declare it (repeatable); an undeclared key is an error")
    run.add_argument("-f", "--params-file", help="YAML file of parameters; each notebook gets the keys it declares")
    run.add_argument("--out", help="run directory (default: runs/<timestamp>)")
    run.add_argument("--kernel", help="a Jupyter kernel spec name (default: ipykernel on this Python)")
    run.add_argument("--cell-timeout", type=float, help="seconds one cell may run (default: no limit)")
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
        shared = load_params_file(args.params_file) if args.params_file else {}
        for key, _ in args.parameter:
            if not key.isidentifier():
                raise WorkbookError(f"-p {key}: a parameter name must be a Python identifier")
        params = {key: parse_value(value) for key, value in args.parameter}
        if args.log_output:
            import logging

            logging.basicConfig(level=logging.INFO, format="%(message)s")
        summary = run_workbook(args.notebooks or None, params, args.out, shared=shared, kernel_name=args.kernel,
                               cell_timeout=args.cell_timeout, progress=args.progress, log_output=args.log_output)
    except WorkbookError as exc:
        parser.exit(2, f"ssmkit workbook: {exc}\n")
    print(f"summary: {Path(summary['run']) / 'summary.md'}")
    if summary["failed"]:
        parser.exit(1, f"ssmkit workbook: {summary['failed']} of {len(summary['notebooks'])} notebook(s) failed\n")


if __name__ == "__main__":
    main()
