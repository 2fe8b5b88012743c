"""The papermill runner: execute notebooks headless into a run directory and summarise them.

    summary = run_workbook(["notebooks/00_setup.ipynb"], parameters={"seed": 1}, out="runs/try")

Each executed copy lands in ``out/``; each notebook that declares ``out_dir`` gets
``out/<stem>/`` (unless given) for its figures and ``metrics.json``. The summary
(:func:`~ssmkit.workbook.rundir.write_summary`) lists each notebook's status (ok, failed,
interrupted, not run), wall time and key metrics, read from a ``metrics.json`` the notebook wrote
in this run, never a stale one, and its peak memory: the largest resident set size of its kernel and
the kernel's children, sampled (:mod:`~ssmkit.workbook.memory`; ``peak_rss_mb``, MiB). A failing
notebook is reported with its cell and error; the others
still run.

Parameters (:func:`~ssmkit.workbook.params.route_parameters`). ``parameters`` are explicit: a key
that no notebook of the run declares in its ``parameters`` cell is an error (a typo would otherwise
run silently with the default). ``shared`` (a params file) is a recipe: each notebook gets the keys
it declares, and a notebook that declares ``overrides`` (it trains) gets the TrainConfig keys it
does not declare in its ``overrides`` (a recipe's ``micro_batch``, ``lr``, ...); the keys a notebook
does not take are listed in the summary; a key that is neither a parameter of a notebook of the
workbook (the run's, the ``NN_*.ipynb`` beside them, and, for a run of the checkout's notebooks or
notes, those of both notebooks/ and papers/: params/workshop.yaml serves both) nor a TrainConfig
key is an error.
``parameters`` win over ``shared``. A relative ``out_dir`` starts at the checkout's notebooks/
folder (:func:`~ssmkit.workbook.params.resolve_out_dir`), as in the notebooks' own check. Notebooks
run with their own folder as working directory, as in JupyterLab, on a kernel of the Python that
runs this module (so ssmkit is importable there), with ``SSMKIT_PROGRESS=text`` (unless set): the
Trainer's progress bar as text lines, which papermill's output keeps (a widget bar shows frozen
there).

Output. One line per notebook, and one per code cell as it ends
(:class:`~ssmkit.workbook.progress.CellLines`; ``quiet``: none); a notebook that ran more than 3x
its stated CPU time (``metadata.ssmkit.cpu_seconds``) on a CPU is flagged in the terminal and in
summary.md.

Timeouts. A cell that runs longer than ``cell_timeout`` seconds (default
:data:`DEFAULT_CELL_TIMEOUT`, or ``$SSMKIT_CELL_TIMEOUT``; 0: no limit) fails its notebook with
"timeout after N s". Signals: see :mod:`ssmkit.workbook.signals`; the run directory's rules:
:mod:`ssmkit.workbook.rundir`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from .. import checks
from ..io import DirLock, LockError, describe_os_error
from .kernels import check_kernel, end_kernels, kernel_manager_class
from .notebooks import (
    WorkbookError,
    cell_source,
    declared_parameters,
    find_notebooks,
    read_notebook,
)
from .params import resolve_out_dir, route_parameters, workbook_folders, workbook_parameters
from .progress import CellLines, slow_warning
from .rundir import claim, previous_outputs, write_summary
from .signals import Interrupted, StopOnSignals

# s: no CPU-default cell comes near it (a whole notebook takes <= 5 min); a hang ends
DEFAULT_CELL_TIMEOUT = 3600
KERNEL_ENV = {"SSMKIT_PROGRESS": "text"}  # what a headless kernel gets unless this process sets it

__all__ = ["DEFAULT_CELL_TIMEOUT", "default_cell_timeout", "run_workbook", "timeout_seconds"]


def timeout_seconds(value, what: str) -> int | None:
    """A cell timeout as nbclient takes it: whole seconds (rounded up), None for 0 (no limit).
    ``value``: a number or its text (``--cell-timeout``, ``$SSMKIT_CELL_TIMEOUT``)."""
    try:
        seconds = checks.number(float(value) if isinstance(value, str) else value, what, low=0)
    except ValueError:
        raise WorkbookError(
            f"{what} must be a number of seconds >= 0 (0: no limit); got {value!r}"
        ) from None
    return math.ceil(seconds) or None


def default_cell_timeout() -> int | None:
    """Seconds a cell may run by default: ``$SSMKIT_CELL_TIMEOUT`` (0: no limit), else
    :data:`DEFAULT_CELL_TIMEOUT`."""
    text = os.environ.get("SSMKIT_CELL_TIMEOUT", "").strip()
    return timeout_seconds(text, "SSMKIT_CELL_TIMEOUT") if text else DEFAULT_CELL_TIMEOUT


def _checked_paths(notebooks) -> list[Path]:
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
    return paths


def _folders(paths: list[Path]) -> set[Path]:
    """The folders whose notebooks' parameters a params file may hold: the run's, and, for a run of
    the checkout's workbook, both its notebooks/ and papers/ (:func:`workbook_folders`)."""
    folders = {p.parent.resolve() for p in paths}
    checkout = {f.resolve() for f in workbook_folders()}
    return folders | checkout if folders & checkout else folders


def _lock(out: Path, files: list[str], dirs: list[str], overwrite: bool) -> DirLock:
    """Take ``out``'s lock and claim the names this run writes; any failure is one
    :class:`WorkbookError`."""
    lock = DirLock(out, "workbook run")
    try:
        lock.acquire()
        try:
            claim(out, files, dirs, overwrite)
        except BaseException:
            lock.release()
            raise
    except LockError as exc:
        raise WorkbookError(str(exc)) from None
    except OSError as exc:
        raise WorkbookError(describe_os_error(exc)) from None
    return lock


def run_workbook(
    notebooks=None,
    parameters: dict | None = None,
    out=None,
    *,
    shared: dict | None = None,
    kernel_name: str | None = None,
    cell_timeout: float | None = None,
    overwrite: bool = False,
    progress: bool = False,
    log_output: bool = False,
    quiet: bool = False,
) -> dict:
    """Execute notebooks with papermill into ``out`` and write ``summary.md`` / ``summary.json``
    there.

    notebooks: paths (default: :func:`find_notebooks`); parameters: explicit values, each must be
    declared by at least one notebook; shared: values (a params file) given to the notebooks that
    declare them; out: the run directory (default ``runs/<timestamp>``); overwrite: replace the
    results of an earlier run in ``out`` (see :mod:`ssmkit.workbook.rundir`); kernel_name: a Jupyter
    kernel spec to use instead of this interpreter; cell_timeout: seconds one cell may run (None:
    :func:`default_cell_timeout`, 0: no limit); progress: papermill's bar over the cells;
    log_output: the notebooks' output on this terminal; quiet: no line per cell. Returns the summary
    dict (also summary.json); ``summary["failed"]`` counts failed notebooks. Raises
    :class:`WorkbookError` before running anything (and without touching ``out``) when a notebook is
    missing, a parameter reaches none of them, or ``out`` holds a run; raises :class:`Interrupted`
    on SIGINT / SIGTERM, after the summary is written.
    """
    paths = _checked_paths(notebooks)
    parameters, shared = dict(parameters or {}), dict(shared or {})
    declared = {p: declared_parameters(p) for p in paths}
    values, unused = route_parameters(
        declared,
        parameters,
        shared,
        workbook_parameters(_folders(paths)) if shared else set(),
    )
    timeout = (
        default_cell_timeout()
        if cell_timeout is None
        else timeout_seconds(cell_timeout, "cell_timeout")
    )
    try:
        import papermill  # noqa: F401
    except ImportError:
        raise WorkbookError("papermill is not installed: pip install 'ssmkit[workbook]'") from None
    if kernel_name:
        check_kernel(kernel_name)
    for p in paths:
        if "out_dir" in values[p]:  # the notebooks' own rule, so that the runner finds metrics.json
            values[p]["out_dir"] = str(resolve_out_dir(values[p]["out_dir"]))
    out = Path(out) if out else Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    files = ["summary.md", "summary.json", *(p.name for p in paths)]
    dirs = [p.stem for p in paths if "out_dir" in declared[p] and "out_dir" not in values[p]]
    previous_outputs(out, files + dirs, overwrite)  # a refused run touches nothing
    lock = _lock(out, files, dirs, overwrite)
    entries = [
        {
            "notebook": str(p),
            "status": "not run",
            "executed": None,
            "parameters": values[p],
            "seconds": None,
            "peak_rss_mb": None,
            "held_rss_mb": None,
            "cpu_seconds": _stated_cpu_seconds(p),
            "metrics_file": None,
            "metrics": {},
            "figures": [],
            "unused_shared": unused[p],
        }
        for p in paths
    ]
    summary = {
        "run": str(out),
        "started": datetime.now().isoformat(timespec="seconds"),
        "python": sys.executable,
        "parameters": parameters,
        "shared": shared,
        "cell_timeout": timeout,
        "notebooks": entries,
        "failed": 0,
        "interrupted": None,
    }
    kernels = []
    options = {
        "kernel_name": kernel_name or "python3",
        "language": "python",
        "progress_bar": progress,
        "log_output": log_output,
        "execution_timeout": timeout,
        "kernel_manager_class": kernel_manager_class(kernel_name, kernels, env=KERNEL_ENV),
    }
    stopped = None
    try:
        with StopOnSignals() as signals:
            try:
                for i, (path, entry) in enumerate(zip(paths, entries), 1):
                    unused_here = ", ".join(entry["unused_shared"])
                    print(
                        f"[{i}/{len(paths)}] {path.name} ..."
                        + (f" (not used here: {unused_here})" if unused_here else ""),
                        flush=True,
                    )
                    lines = None if quiet else CellLines(path.stem)
                    hooks = lines.hooks() if lines else {}
                    try:
                        _run_one(path, entry, out, declared[path], {**options, **hooks})
                    finally:
                        if lines:
                            lines.stop()
                        peak, held = end_kernels(kernels)
                        entry["peak_rss_mb"] = round(peak / 2**20, 1) if peak is not None else None
                        entry["held_rss_mb"] = round(held / 2**20, 1) if held is not None else None
                    error = f": {entry['error']}" if "error" in entry else ""
                    rss = entry["peak_rss_mb"]
                    memory = f", peak RSS {rss:,.0f} MiB" if rss is not None else ""
                    if entry["held_rss_mb"] is not None:
                        memory += f" (held at the end {entry['held_rss_mb']:,.0f} MiB)"
                    print(
                        f"      {entry['status']} in {entry['seconds']} s{memory}{error}",
                        flush=True,
                    )
                    entry["warning"] = (
                        entry["cpu_seconds"]
                        and slow_warning(
                            path.name, entry["seconds"], entry["cpu_seconds"], _device(entry)
                        )
                        or None
                    )
                    if entry["warning"]:
                        print(f"      warning: {entry['warning']}", flush=True)
            except Interrupted as exc:
                stopped, summary["interrupted"] = exc, str(exc)
                signals.settle()
                for e in entries:
                    if e["status"] == "running":  # stopped before papermill ran it
                        e.update(status="interrupted", error=f"interrupted by {exc}")
            finally:  # also after an error: what ran is summarised, and no signal stops that
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
    """Execute one notebook into ``out/<name>``, filling in its summary ``entry``. A notebook's
    error is reported there, never raised; :class:`Interrupted` passes through once the entry says
    "interrupted"."""
    import papermill

    executed, values = out / path.name, entry["parameters"]
    entry.update(status="running", executed=str(executed))
    start, began, metrics, old_metrics = time.perf_counter(), time.time(), None, None
    try:
        if "out_dir" in declared and "out_dir" not in values:
            (out / path.stem).mkdir(exist_ok=True)
            values["out_dir"] = str((out / path.stem).resolve())
        # out_dir is absolute here (run_workbook resolved a given one)
        metrics = (
            Path(values["out_dir"] if "out_dir" in values else out / path.stem) / "metrics.json"
        )
        old_metrics = _stamp(metrics)
        papermill.execute_notebook(
            str(path), str(executed), parameters=values, cwd=str(path.resolve().parent), **options
        )
        entry["status"] = "ok"
    except Interrupted as exc:
        entry.update(status="interrupted", **_stopped_cell(executed), error=f"interrupted by {exc}")
        raise
    except (
        Exception
    ) as exc:  # a cell error, a dead kernel, a timeout, a full disk: report it and go on
        entry["status"] = "failed"
        entry.update(_failure(exc, executed, options["execution_timeout"]))
    finally:
        entry["seconds"] = round(time.perf_counter() - start, 1)
        if metrics is not None and _stamp(metrics) not in (
            None,
            old_metrics,
        ):  # this run's, not a stale one
            entry["metrics_file"], entry["metrics"] = str(metrics), _key_metrics(metrics)
        if metrics is not None:  # figures this run wrote in out_dir (not an earlier run's)
            entry["figures"] = _figures(metrics.parent, since=began - 1)


def _stated_cpu_seconds(path: Path) -> float | None:
    """The CPU time a notebook states in ``metadata.ssmkit.cpu_seconds`` (None if none)."""
    value = (read_notebook(path).get("metadata", {}).get("ssmkit") or {}).get("cpu_seconds")
    return float(value) if checks.is_number(value) and value > 0 else None


def _device(entry: dict) -> str | None:
    """The device a notebook ran on: its metrics' ``device``, else its ``device`` parameter ("auto":
    what it resolves to here); None if unknown."""
    device = entry["metrics"].get("device") or entry["parameters"].get("device")
    if device == "auto" or (device is None and "device" not in entry["parameters"]):
        from ..env import pick_device

        device = pick_device("auto")
    return str(device).partition(":")[0] if device else None


def _figures(folder: Path, since: float) -> list[str]:
    """The .png files directly in ``folder`` written at or after ``since`` (epoch seconds),
    sorted."""
    try:
        return sorted(
            str(p) for p in folder.glob("*.png") if p.is_file() and p.stat().st_mtime >= since
        )
    except OSError:
        return []


# --- where and why a notebook stopped ------------------------------------------------------------


def _excerpt(source: str, lines: int = 8) -> str:
    rows = source.strip("\n").splitlines()
    return "\n".join(rows[:lines] + (["..."] if len(rows) > lines else []))


def _original_index(cells: list, index: int) -> int:
    """Cell ``index`` of an executed copy, counted in the original notebook (papermill's injected
    cell left out)."""
    return index - sum(
        "injected-parameters" in c.get("metadata", {}).get("tags", []) for c in cells[:index]
    )


def _stopped_cell(executed: Path) -> dict:
    """Where a notebook stopped without a cell error (a timeout, a signal): the last cell papermill
    started in the executed copy, as ``cell`` (original notebook, 0-based), ``execution_count`` and
    ``source``; {} if unknown."""
    try:
        cells = read_notebook(executed)["cells"]
    except (WorkbookError, KeyError):
        return {}
    started = [
        i
        for i, c in enumerate(cells)
        if (c.get("metadata", {}).get("papermill") or {}).get("start_time")
    ]
    if not started:
        return {}
    cell = cells[started[-1]]
    return {
        "cell": _original_index(cells, started[-1]),
        "execution_count": cell.get("execution_count"),
        "source": _excerpt(cell_source(cell)),
    }


def _failure(exc: Exception, executed: Path, timeout: int | None) -> dict:
    """Where and why a notebook failed; the cell index counts cells of the original notebook
    (0-based)."""
    from nbclient.exceptions import CellTimeoutError
    from papermill.exceptions import PapermillExecutionError

    if isinstance(exc, CellTimeoutError) and "Cell execution timed out" in str(exc):
        return {
            **_stopped_cell(executed),
            "error": f"timeout after {timeout} s "
            "(raise it with --cell-timeout SECONDS; 0: no limit)",
        }
    if not isinstance(exc, PapermillExecutionError):
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:2000]}"}
    try:
        index = _original_index(read_notebook(executed)["cells"], exc.cell_index)
    except (WorkbookError, KeyError):
        index = exc.cell_index
    return {
        "cell": index,
        "execution_count": exc.exec_count,
        "source": _excerpt(exc.source),
        "error": f"{exc.ename}: {exc.evalue}",
    }


# --- the metrics a notebook wrote ----------------------------------------------------------------


def _stamp(path: Path):
    """What tells a rewritten file from the old one (an atomic rename makes a new inode)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _key_metrics(path: Path, limit: int = 24) -> dict:
    """Scalar entries of a metrics.json (numbers, bools, short strings), at most ``limit``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    keep = {
        k: v
        for k, v in data.items()
        if isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 60) or v is None
    }
    return dict(list(keep.items())[:limit])
