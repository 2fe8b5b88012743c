"""``ssmkit workbook run|strip``: the command line of the runner.

    ssmkit workbook run [NOTEBOOK ...] [-p key value] [-f params.yaml] [--out runs/NAME]
                        [--overwrite] [--cell-timeout SECONDS] [--kernel NAME] [--quiet]
                        [--progress] [--log-output]
    ssmkit workbook strip [NOTEBOOK ...]          # clear outputs before committing
    ssmkit workbook build --for student|solution|instructor OUT [NOTEBOOK ...]   # workshop copies

Without NOTEBOOKs, every ``notebooks/NN_*.ipynb`` runs, in order, printing a line per notebook and
one per code cell as it ends (``--quiet``: per notebook only). ``-p`` values are read with the
grammar of ``ssmkit train --set`` (:func:`ssmkit.checks.parse_value`: ``none``, ``true``, ``1e3``,
``[1, 2]``, ``"text"``); ``-f`` is a YAML params file. Exit status: 0 all ok, 1 a notebook failed
(or a file could not be written), 2 bad arguments or inputs (a refused run touches nothing), 128 +
signal number when interrupted (130, 143). ``build`` writes the student, solution or instructor copy
of each master (:mod:`ssmkit.workbook.copies`); a refused master or OUT is one line, status 2, and
nothing written. The options are declared once, in :func:`add_run_arguments`,
:func:`add_strip_arguments` and :func:`add_build_arguments`; the ``ssmkit`` command's table names
them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checks import parse_value
from ..io import describe_os_error
from .copies import KINDS, build_copies, default_masters
from .notebooks import WorkbookError, load_params_file, strip_notebook
from .runner import DEFAULT_CELL_TIMEOUT, run_workbook, timeout_seconds
from .signals import Interrupted

__all__ = [
    "add_build_arguments",
    "add_run_arguments",
    "add_strip_arguments",
    "build",
    "main",
    "run",
    "strip",
]


def add_run_arguments(run: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``ssmkit workbook run``."""
    run.add_argument(
        "notebooks", nargs="*", help="notebook paths (default: notebooks/NN_*.ipynb in order)"
    )
    run.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("KEY", "VALUE"),
        help="a parameter for the notebooks that declare it (repeatable); a TrainConfig key "
        "goes to the notebooks that train (their `overrides`); any other key is an error",
    )
    run.add_argument(
        "-f",
        "--params-file",
        help="YAML file of parameters; each notebook gets the keys it declares, and a notebook "
        "that trains (declares `overrides`) TrainConfig keys too; other keys are errors",
    )
    run.add_argument(
        "--out", help="run directory (default: runs/<timestamp>); one that holds a run is refused"
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of an earlier run in --out (never a file that no run wrote)",
    )
    run.add_argument(
        "--kernel", help="a Jupyter kernel spec name (default: ipykernel on this Python)"
    )
    run.add_argument(
        "--cell-timeout",
        metavar="SECONDS",
        help="seconds one cell may run, 0: no limit "
        f"(default: $SSMKIT_CELL_TIMEOUT or {DEFAULT_CELL_TIMEOUT})",
    )
    run.add_argument("--quiet", action="store_true", help="one line per notebook, none per cell")
    run.add_argument(
        "--progress", action="store_true", help="papermill's progress bar over the cells"
    )
    run.add_argument(
        "--log-output", action="store_true", help="stream the notebooks' output to the terminal"
    )
    return run


def add_strip_arguments(strip: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``ssmkit workbook strip``."""
    strip.add_argument(
        "notebooks", nargs="*", help="notebook paths (default: notebooks/*.ipynb, papers/*.ipynb)"
    )
    return strip


def add_build_arguments(build: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``ssmkit workbook build``."""
    build.add_argument(
        "--for",
        dest="kind",
        required=True,
        choices=KINDS,
        help="student: each answer replaced by 'name = ...  # Exercise: your turn' lines (so its "
        "check() says 'not done yet'; a line that raises where it assigns no name), hidden tests "
        "and instructor cells removed, outputs cleared; solution: the same with the answers; "
        "instructor: the masters as they are",
    )
    build.add_argument(
        "out",
        metavar="OUT",
        help="folder for the copies (OUT/notebooks/..., OUT/papers/...); new, or one an earlier "
        "build of the same kind wrote; never a master's folder",
    )
    build.add_argument(
        "notebooks", nargs="*", help="master notebooks (default: notebooks/*.ipynb, papers/*.ipynb)"
    )
    return build


def _fail(status: int, message: str) -> int:
    """A user's error (or an interrupted run): ``ssmkit workbook: message`` on stderr."""
    print(f"ssmkit workbook: {message}", file=sys.stderr)
    return status


def strip(args) -> int:
    """``ssmkit workbook strip``: clear each notebook's outputs in place (a missing one: 2); by
    default the workbook's and the paper notes' (``notebooks/``, ``papers/``)."""
    try:
        for p in args.notebooks or default_masters():
            if not Path(p).is_file():
                raise WorkbookError(f"notebook {p} does not exist")
            print(f"{'stripped' if strip_notebook(p) else 'clean   '} {p}")
    except WorkbookError as exc:
        return _fail(2, str(exc))
    except OSError as exc:
        return _fail(1, describe_os_error(exc))
    return 0


def build(args) -> int:
    """``ssmkit workbook build``: the ``--for`` copy of each master under OUT, a line per copy; a
    refused master or OUT: 2, nothing written; a file that cannot be written: 1."""
    try:
        for path in build_copies(args.notebooks or None, args.kind, args.out):
            print(f"{args.kind} {path}")
    except WorkbookError as exc:
        return _fail(2, str(exc))
    except OSError as exc:
        return _fail(1, describe_os_error(exc))
    return 0


def run(args) -> int:
    """``ssmkit workbook run``: the notebooks under papermill; returns 1 if a notebook failed (or a
    file could not be written), 2 on bad arguments or inputs (a refused run touches nothing),
    128 + signal number when interrupted (130, 143)."""
    try:
        if args.cell_timeout is not None:
            timeout_seconds(args.cell_timeout, "--cell-timeout")  # checked here to name the option
        shared = load_params_file(args.params_file) if args.params_file else {}
        for key, _ in args.parameter:
            if not key.isidentifier():
                raise WorkbookError(f"-p {key}: a parameter name must be a Python identifier")
        params = {key: parse_value(value) for key, value in args.parameter}
        if args.log_output:
            import logging

            logging.basicConfig(level=logging.INFO, format="%(message)s")
        summary = run_workbook(
            args.notebooks or None,
            params,
            args.out,
            shared=shared,
            kernel_name=args.kernel,
            cell_timeout=args.cell_timeout,
            overwrite=args.overwrite,
            progress=args.progress,
            log_output=args.log_output,
            quiet=args.quiet,
        )
    except WorkbookError as exc:
        return _fail(2, str(exc))
    except Interrupted as exc:
        return _fail(
            128 + exc.signum,
            f"interrupted by {exc}; summary: {Path(exc.summary['run']) / 'summary.md'}",
        )
    except OSError as exc:  # disk full, read-only or vanished directory
        return _fail(1, describe_os_error(exc))
    print(f"summary: {Path(summary['run']) / 'summary.md'}")
    if summary["failed"]:
        return _fail(1, f"{summary['failed']} of {len(summary['notebooks'])} notebook(s) failed")
    return 0


def main(argv=None) -> None:
    """``python -m ssmkit.workbook run|strip|build ...`` (and ``ssmkit.workbook.main``): parse,
    then :func:`run`, :func:`strip` or :func:`build`; exits with their status when it is not 0."""
    parser = argparse.ArgumentParser(
        prog="ssmkit workbook", description="run the notebooks headless with papermill"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(
        sub.add_parser("run", help="execute notebooks into runs/NAME/ and write summary.md")
    )
    add_strip_arguments(sub.add_parser("strip", help="clear outputs and execution counts in place"))
    add_build_arguments(
        sub.add_parser("build", help="write the student, solution or instructor copies")
    )
    args = parser.parse_args(argv)
    status = {"strip": strip, "build": build}.get(args.command, run)(args)
    if status:
        sys.exit(status)
