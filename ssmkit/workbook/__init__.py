"""The workbook: small helpers the notebooks call, and the papermill runner that executes them headless.

    from ssmkit import workbook
    p = workbook.check_params(preset="cpu-tiny", device="auto", out_dir="../runs/lab/00", seed=0)  # in a cell
    summary = workbook.run_workbook(["notebooks/00_setup.ipynb"], parameters={"seed": 1}, out="runs/try")

    ssmkit workbook run [NOTEBOOK ...] [-p key value] [-f params.yaml] [--out runs/NAME] [--overwrite]
    ssmkit workbook strip [NOTEBOOK ...]

Modules, in the order a reader meets them:

* :mod:`~ssmkit.workbook.params`: :func:`check_params`, the first cell of every notebook (each parameter
  checked, a relative ``out_dir`` taken from notebooks/, names papermill injected compared with the
  declared ones, ``overrides`` of TrainConfig keys), and how ``-p`` / ``-f`` reach each notebook;
* :mod:`~ssmkit.workbook.cells`: what the other cells call (:func:`pick_device`,
  :func:`system_info`, :func:`preset_info`, :func:`train_config`, :func:`sample_text`,
  :func:`markdown_table`, :func:`format_duration`, :func:`write_metrics`; :func:`summarize_run` is
  :func:`ssmkit.eval.summarize_run`);
* :mod:`~ssmkit.workbook.hybrid`: what notebook 03 (hybrid SSM + attention) calls: :func:`hybrid_config`
  (Jamba's rule), :func:`layer_pattern`, :func:`parameter_split`, :func:`train_on_task`, :func:`ratio_sweep`,
  :func:`context_costs`, :func:`extrapolation`, ...;
* :mod:`~ssmkit.workbook.scale_up`: what notebook 02 (scale-up) calls: :func:`compare_strategies` (one
  process, DDP, FSDP), :func:`memory_rows`, :func:`scale_up_plans`, :func:`slurm_command`,
  :func:`prepare_at_scale`, :func:`stream_remote`, :func:`precision_runs`, ...; its parameters' checks join
  :data:`~ssmkit.workbook.params.CHECKS`; :mod:`~ssmkit.workbook.scaling` its measuring half:
  :func:`mixer_throughput`, :func:`evaluate_models`, :func:`scaling_sweep`, :func:`fit_power_law`, ...;
* :mod:`~ssmkit.workbook.finetune`: what notebook 04 (fine-tuning) calls: :func:`base_checkpoint`,
  :func:`plan_snippet_on_transformers`, :func:`finetune_config` (LoRA or full), :func:`compare_finetuning`,
  :func:`step_memory`, :func:`export_to_transformers`; its parameters' checks join
  :data:`~ssmkit.workbook.params.CHECKS`;
* :mod:`~ssmkit.workbook.launch`: :func:`launch_train`, ``ssmkit train --nproc N`` started from a cell, its
  output streamed live, its metrics returned; interrupting the cell stops every rank;
* :mod:`~ssmkit.workbook.notebooks`: notebooks and params files on disk (:func:`find_notebooks`,
  :func:`declared_parameters`, :func:`strip_notebook`, :func:`load_params_file`, :func:`parse_value`);
* :mod:`~ssmkit.workbook.runner`: :func:`run_workbook`, papermill with per-cell timeouts;
  :mod:`~ssmkit.workbook.progress`: its line per cell and the slow-run warning;
* :mod:`~ssmkit.workbook.rundir`: the run directory's record and :func:`write_summary`;
* :mod:`~ssmkit.workbook.signals` (SIGINT / SIGTERM -> :class:`Interrupted`) and
  :mod:`~ssmkit.workbook.kernels` (the Jupyter kernels a run starts and ends);
* :mod:`~ssmkit.workbook.cli`: :func:`main`, ``ssmkit workbook run|strip``.

papermill, matplotlib and the Jupyter machinery are imported only when a notebook is run.
"""

from . import params
from .cells import (
    format_duration,
    markdown_table,
    pick_device,
    preset_info,
    preset_names,
    sample_text,
    summarize_run,
    system_info,
    train_config,
    write_metrics,
)
from .cli import main
from .finetune import PARAMETER_CHECKS as FINETUNE_CHECKS
from .finetune import (
    base_checkpoint,
    compare_finetuning,
    export_to_transformers,
    finetune_config,
    plan_snippet_on_transformers,
    sft_split,
    step_memory,
)
from .hybrid import (
    attention_share,
    build_lm,
    context_costs,
    context_models,
    crossovers,
    extrapolation,
    hybrid_config,
    layer_pattern,
    mixer_comparison,
    parameter_split,
    plot_panels,
    ratio_sweep,
    train_on_task,
)
from .launch import LaunchError, launch_train
from .notebooks import (
    PROJECT_ROOT,
    WorkbookError,
    declared_parameters,
    find_notebooks,
    load_params_file,
    parse_value,
    strip_notebook,
)
from .params import check_params, notebooks_dir, resolve_out_dir
from .rundir import RECORD, write_summary
from .runner import DEFAULT_CELL_TIMEOUT, default_cell_timeout, run_workbook
from .scale_up import (
    PARAMETER_CHECKS,
    autocast_support,
    compare_strategies,
    loss_table,
    max_loss_difference,
    memory_rows,
    precision_metrics,
    precision_rows,
    precision_runs,
    prepare_at_scale,
    scale_up_plans,
    slurm_command,
    strategy_metrics,
    stream_remote,
)
from .scaling import (
    evaluate_models,
    fit_power_law,
    mixer_throughput,
    model_compute,
    plot_scaling,
    predict_loss,
    scaling_sweep,
    score_table,
)
from .signals import Interrupted

params.CHECKS.update(PARAMETER_CHECKS)          # notebook 02's parameters (see scale_up.PARAMETER_CHECKS)
params.CHECKS.update(FINETUNE_CHECKS)           # notebook 04's (finetune.PARAMETER_CHECKS)

__all__ = [
    # cells
    "check_params", "format_duration", "markdown_table", "pick_device", "preset_info", "preset_names",
    "sample_text", "summarize_run", "system_info", "train_config", "write_metrics",
    # notebook 03: hybrids
    "attention_share", "build_lm", "context_costs", "context_models", "crossovers", "extrapolation",
    "hybrid_config", "layer_pattern", "mixer_comparison", "parameter_split", "plot_panels", "ratio_sweep",
    "train_on_task",
    # launching ``ssmkit train --nproc N`` from a cell
    "LaunchError", "launch_train",
    # notebook 02: scale-up
    "autocast_support", "compare_strategies", "evaluate_models", "fit_power_law", "loss_table",
    "max_loss_difference", "memory_rows", "mixer_throughput", "model_compute", "plot_scaling",
    "precision_metrics", "precision_rows", "precision_runs", "predict_loss", "prepare_at_scale",
    "scale_up_plans", "scaling_sweep", "score_table", "slurm_command", "strategy_metrics", "stream_remote",
    # notebook 04: fine-tuning
    "base_checkpoint", "compare_finetuning", "export_to_transformers", "finetune_config",
    "plan_snippet_on_transformers", "sft_split", "step_memory",
    # notebooks and params files
    "PROJECT_ROOT", "WorkbookError", "declared_parameters", "find_notebooks", "load_params_file",
    "parse_value", "strip_notebook",
    # parameters
    "notebooks_dir", "resolve_out_dir",
    # the runner and its command line
    "DEFAULT_CELL_TIMEOUT", "RECORD", "Interrupted", "default_cell_timeout", "main", "run_workbook",
    "write_summary",
]
