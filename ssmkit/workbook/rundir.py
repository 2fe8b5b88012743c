"""The run directory: what a run writes there, what it may replace, and the summary it leaves.

A run writes ``summary.md``, ``summary.json``, the executed copies ``<name>.ipynb`` and the out dirs
``<stem>/``, and records those names in ``.ssmkit-workbook.json`` (:data:`RECORD`; ``.ssmkit.lock``
keeps a second run out while one is writing). A directory holding a run is refused unless
``--overwrite`` is given; then the previous summaries and executed copies of the notebooks being run
are replaced and the notebooks write into their out dirs again (their own code replaces their files,
e.g. the Trainer's ``overwrite=True``). A file or folder of one of those names that no run recorded
is never replaced, ``--overwrite`` or not; other files in the directory are left alone.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

from ..io import read_json, write_atomically, write_json
from .notebooks import WorkbookError

# in a run directory: the names runs wrote there (what --overwrite may replace)
RECORD = ".ssmkit-workbook.json"

__all__ = ["RECORD", "claim", "previous_outputs", "write_summary"]


def recorded(out: Path) -> set[str]:
    """The names earlier runs recorded as written in ``out`` (empty if none)."""
    path = out / RECORD
    if not path.exists():
        return set()
    try:
        names = read_json(path, "run record").get("written")
    except (ValueError, AttributeError):
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise WorkbookError(
            f"run record {path} is not readable: move {out} aside or choose another --out"
        )
    return set(names)


def previous_outputs(out: Path, names: list[str], overwrite: bool) -> list[str]:
    """The ``names`` a run would write that ``out`` already holds; raises :class:`WorkbookError`
    (touching nothing) if one of them was not written by a run, or if there are any and not
    ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise WorkbookError(f"--out {out} is a file; expected a directory for the run")
    if not out.exists():
        return []
    ours = recorded(out)
    present = [n for n in names if os.path.lexists(out / n)]
    for n in present:
        if n not in ours or (out / n).is_symlink():
            raise WorkbookError(
                f"{out / n} exists and was not written by `ssmkit workbook run` "
                f"(not in {RECORD}): refusing to replace it; move it or choose another --out"
            )
    if present and not overwrite:
        shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
        raise WorkbookError(
            f"--out {out} already holds a run ({shown}): "
            "pass --overwrite to replace its results, or choose another directory"
        )
    return present


def claim(out: Path, files: list[str], dirs: list[str], overwrite: bool) -> None:
    """Check ``out`` again (now under the run's lock), record the names this run writes, and remove
    the previous run's summaries and executed copies among them (its out dirs stay: the notebooks
    rewrite their files)."""
    present = previous_outputs(out, files + dirs, overwrite)
    write_json(out / RECORD, {"written": sorted(recorded(out) | set(files) | set(dirs))})
    for name in present:
        if name in files:
            (out / name).unlink()


# a metric's unit, read from the last word of its name (val_loss, train_tok_s, config_params,
# disk_free_gb)
UNITS = {
    "loss": "nats/token",
    "tok_s": "tokens/s",
    "tokens_per_s": "tokens/s",
    "seconds": "s",
    "params": "parameters",
    "gb": "GiB",
    "mb": "MiB",
    "flops": "FLOPs",
    "tokens": "tokens",
}


def unit(name: str) -> str:
    """The unit of metric ``name``: :data:`UNITS` of the name itself or of its ending ``_<word>``
    (``val_loss`` nats/token, ``train_tok_s`` tokens/s, ``smoke_seconds`` s, ``config_params``
    parameters, ``disk_free_gb`` GiB, ...); "" for none (perplexity, counts, names)."""
    for word, what in UNITS.items():
        if name == word or name.endswith("_" + word):
            return what
    return ""


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def _link(path: str, out: Path) -> str:
    rel = os.path.relpath(path, out)
    return f"[{Path(path).name}]({f'<{rel}>' if ' ' in rel else rel})"


def write_summary(summary: dict, out: str | Path) -> Path:
    """``out/summary.md`` and ``out/summary.json``; returns the .md path.

    summary.md: a table of the notebooks (status, time, stated CPU time, peak RSS: the kernel's and
    its children's, sampled; and what the kernel still held after its last cell), a warning for
    each CPU run that took far longer than stated, then per notebook its metrics as a table (name,
    value, unit: :func:`unit`) and links to the figures it wrote, a section per failed or
    interrupted notebook, and the parameters.
    """
    out = Path(out)
    counts = Counter(e["status"] for e in summary["notebooks"])
    tally = f"{counts['ok']} ok, {counts['failed']} failed" + "".join(
        f", {counts[s]} {s}" for s in ("interrupted", "not run") if counts[s]
    )
    stopped = f" Interrupted by {summary['interrupted']}." if summary.get("interrupted") else ""
    rows = [
        f"# Workbook run `{summary['run']}`",
        "",
        f"Started {summary['started']}, finished {summary.get('finished', '?')}; {tally}.{stopped}",
        "",
        "| notebook | status | time (s) | stated CPU time (s) | peak RSS (MiB) | held at the end "
        "(MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for e in summary["notebooks"]:
        stated = f"~{e['cpu_seconds']:g}" if e.get("cpu_seconds") else "–"
        rss, held = (e.get(k) for k in ("peak_rss_mb", "held_rss_mb"))
        mib = ["–" if v is None else f"{v:,.0f}" for v in (rss, held)]
        rows.append(
            f"| {Path(e['notebook']).name} | {e['status']} | {_fmt(e['seconds'])} | {stated} "
            f"| {mib[0]} | {mib[1]} |"
        )
    warnings = [e["warning"] for e in summary["notebooks"] if e.get("warning")]
    if warnings:
        rows += [""] + [f"> **Warning**: {w}." for w in warnings]
    for e in summary["notebooks"]:
        if e["metrics"] or e.get("figures"):
            rows += ["", f"## {Path(e['notebook']).name}", ""]
        if e["metrics"]:
            rows += ["| metric | value | unit |", "|---|---|---|"]
            rows += [f"| {k} | {_fmt(v)} | {unit(k) or '–'} |" for k, v in e["metrics"].items()]
            rows += [""] if e.get("figures") else []
        if e.get("figures"):
            rows.append("Figures: " + ", ".join(_link(f, out) for f in e["figures"]))
    for e in summary["notebooks"]:
        if e["status"] in ("failed", "interrupted"):
            rows += ["", f"## {Path(e['notebook']).name} {e['status']}", ""]
            if "cell" in e:
                rows += [
                    f"Cell {e['cell']} (execution count {e['execution_count']}):",
                    "",
                    "```python",
                    e["source"],
                    "```",
                    "",
                ]
            rows += [
                f"Error: `{e['error']}`",
                "",
                f"Executed copy with the traceback: `{e['executed']}`",
            ]
    if summary.get("parameters") or summary.get("shared"):
        rows += [
            "",
            "## Parameters",
            "",
            f"- explicit (-p): `{summary['parameters']}`",
            f"- shared (-f): `{summary['shared']}`",
        ]
        rows += [
            f"- {Path(e['notebook']).name} trains with overrides: `{e['parameters']['overrides']}`"
            for e in summary["notebooks"]
            if e["parameters"].get("overrides")
        ]
        rows += [
            f"- {Path(e['notebook']).name} ignores: {', '.join(e['unused_shared'])}"
            for e in summary["notebooks"]
            if e["unused_shared"]
        ]
    try:
        write_atomically(out / "summary.md", "\n".join(rows) + "\n")
        write_atomically(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    except OSError as exc:
        exc.filename = exc.filename or str(out / "summary.md")  # a failed fsync names no file
        raise
    return out / "summary.md"
