"""The workbook: one chapter per notebook, and the machinery that runs the notebooks headless.

    from ssmkit.workbook.chapters import ch01_prototype as chapter    # a notebook's own helpers
    p = chapter.PARAMETERS.check(globals())                            # its parameters, checked
    summary = run_workbook(["notebooks/00_setup.ipynb"], parameters={"seed": 1}, out="runs/try")

    ssmkit workbook run [NOTEBOOK ...] [-p key value] [-f params.yaml] [--out runs/NAME] \
        [--overwrite]
    ssmkit workbook strip [NOTEBOOK ...]
    ssmkit workbook build --for student|solution|instructor OUT [NOTEBOOK ...]

Modules, in the order a reader meets them:

* :mod:`~ssmkit.workbook.chapters`: ``chNN_<name>.py`` per notebook: what it calls and its
  ``PARAMETERS``, declared once (default, check, help);
* :mod:`~ssmkit.workbook.params`: :class:`Param` / :class:`Parameters` (a notebook's parameters:
  checked in its first cell, written as its parameters cell), the checks every notebook shares, and
  how ``-p`` / ``-f`` / papermill's injected values reach each notebook;
* :mod:`~ssmkit.workbook.cells`: what the cells of every notebook share (:func:`train_config`,
  :func:`pick_device`, :func:`sample_text`, :func:`markdown_table`, :func:`format_duration`,
  :func:`write_metrics`);
* :mod:`~ssmkit.workbook.widgets`: sliders for the ideas a notebook teaches (:func:`explore`: live
  in JupyterLab, a static figure under papermill), with the pure functions behind each picture;
* :mod:`~ssmkit.workbook.launch`: :func:`launch_train`, ``ssmkit train --nproc N`` started from a
  cell, its output streamed live, its summary returned; interrupting the cell stops every rank;
* :mod:`~ssmkit.workbook.notebooks`: notebooks and params files on disk (:func:`find_notebooks`,
  :func:`declared_parameters`, :func:`strip_notebook`, :func:`load_params_file`);
* :mod:`~ssmkit.workbook.copies`: the student, solution and instructor copies of the masters
  (:func:`build_copies`, :func:`build_copy`);
* :mod:`~ssmkit.workbook.runner`: :func:`run_workbook`, papermill with per-cell timeouts;
  :mod:`~ssmkit.workbook.progress`: its line per cell and the slow-run warning;
* :mod:`~ssmkit.workbook.rundir`: the run directory's record and :func:`write_summary`;
* :mod:`~ssmkit.workbook.signals` (SIGINT / SIGTERM -> :class:`Interrupted`) and
  :mod:`~ssmkit.workbook.kernels` (the Jupyter kernels a run starts and ends, their peak memory
  sampled by :mod:`~ssmkit.workbook.memory`);
* :mod:`~ssmkit.workbook.cli`: :func:`main`, ``ssmkit workbook run|strip|build``.

papermill, matplotlib and the Jupyter machinery are imported only when a notebook is run; the
chapters (torch, the trainer) when a notebook imports one.
"""

from .cells import (
    format_duration,
    markdown_table,
    pick_device,
    run_config_names,
    sample_text,
    train_config,
    write_metrics,
)
from .cli import main
from .copies import build_copies, build_copy
from .launch import LaunchError, launch_train
from .memory import free_memory
from .notebooks import (
    PROJECT_ROOT,
    WorkbookError,
    declared_parameters,
    find_notebooks,
    load_params_file,
    strip_notebook,
)
from .params import Param, Parameters, notebooks_dir, resolve_out_dir
from .rundir import RECORD, write_summary
from .runner import DEFAULT_CELL_TIMEOUT, default_cell_timeout, run_workbook
from .signals import Interrupted

__all__ = [
    # what every notebook's cells share
    "format_duration",
    "free_memory",
    "markdown_table",
    "pick_device",
    "run_config_names",
    "sample_text",
    "train_config",
    "write_metrics",
    # a notebook's parameters
    "Param",
    "Parameters",
    "notebooks_dir",
    "resolve_out_dir",
    # launching ``ssmkit train --nproc N`` from a cell
    "LaunchError",
    "launch_train",
    # notebooks and params files
    "PROJECT_ROOT",
    "WorkbookError",
    "declared_parameters",
    "find_notebooks",
    "load_params_file",
    "strip_notebook",
    # workshop copies of the masters
    "build_copies",
    "build_copy",
    # the runner and its command line
    "DEFAULT_CELL_TIMEOUT",
    "RECORD",
    "Interrupted",
    "default_cell_timeout",
    "main",
    "run_workbook",
    "write_summary",
]
