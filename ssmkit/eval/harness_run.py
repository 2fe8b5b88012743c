"""Running lm-evaluation-harness on an ssmkit model: :func:`run_lm_eval`, its markdown table,
lm-eval's CLI.

    results = ssmkit.eval.run_lm_eval("runs/cpu-tiny/checkpoints/latest/model", "ssmkit_lastword",
                                      tokenizer="gpt2", limit=100, out_dir="runs/eval")
    print(ssmkit.eval.lm_eval_table(results))

Task names resolve through an lm-eval ``TaskManager`` whose include path is ssmkit's offline tasks
(:data:`~ssmkit.eval.offline_tasks.TASKS_DIR`); lm-eval's own tasks (the plan's, :data:`PLAN_TASKS`)
are indexed only when one is asked for (indexing them is slow) and need their datasets from the
hub or its local cache. lm_eval is imported inside the functions: importing this module (and
``ssmkit``) does not.

``python -m ssmkit.eval.harness_run [lm-eval arguments]`` is lm-eval's own command line with the
``ssmkit`` model registered and the offline tasks on its include path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import io
from .offline_tasks import OFFLINE_TASKS, PLAN_TASKS, TASKS_DIR

BOOTSTRAP_ITERS = 1000  # resamples for the stderr of perplexity (means have a closed form)
_MANAGERS: dict[
    bool, object
] = {}  # include lm-eval's own tasks? -> TaskManager (built once per process)


def task_names(tasks) -> list[str]:
    """A list of task names from a comma-separated string or a list, each once, in order."""
    parts = tasks.split(",") if isinstance(tasks, str) else list(tasks or [])
    names = list(dict.fromkeys(str(t).strip() for t in parts if str(t).strip()))
    if not names:
        raise ValueError(
            f"no task given; offline tasks: {', '.join(OFFLINE_TASKS)}; the plan's (need the "
            f"hub or its cache): {', '.join(PLAN_TASKS)}"
        )
    return names


def task_manager(names: list[str]):
    """An lm-eval TaskManager that knows ``names``: ssmkit's offline tasks, plus lm-eval's own tasks
    when a name is not one of them. Unknown names, or tasks whose data cannot be loaded (the hub out
    of reach and not cached), are a ValueError of one line naming them and the offline tasks."""
    from lm_eval.tasks import TaskManager

    defaults = any(n not in OFFLINE_TASKS for n in names)
    if defaults not in _MANAGERS:
        _MANAGERS[defaults] = TaskManager(include_path=str(TASKS_DIR), include_defaults=defaults)
    manager = _MANAGERS[defaults]
    known = set(manager.all_tasks) | set(manager.all_groups) | set(manager.all_tags)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown task{'s' * (len(unknown) > 1)} {', '.join(unknown)}; offline tasks: "
            f"{', '.join(OFFLINE_TASKS)}; the plan's (online): {', '.join(PLAN_TASKS)}; "
            "lm-eval lists its own with `lm_eval ls tasks`"
        )
    failed = []
    for name in (
        n for n in names if n not in OFFLINE_TASKS
    ):  # the offline ones load from our JSONL
        try:
            manager.load([name])  # its dataset: a download or the HF cache
        except Exception as exc:
            failed.append((name, exc))
    if failed:
        name, exc = failed[0]
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"task{'s' * (len(failed) > 1)} {', '.join(n for n, _ in failed)} need their "
            "datasets from the Hugging Face hub (a network, or the datasets already in the HF "
            f"cache), which failed here ({type(exc).__name__}: {reason}); offline tasks that "
            f"ship with ssmkit: {', '.join(OFFLINE_TASKS)}"
        )
    return manager


def _number(value) -> str:
    """4 decimals, or 4 significant digits for a large number (an untrained model's perplexity)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    return f"{value:.4g}" if abs(value) >= 1e4 else f"{value:.4f}"


def lm_eval_table(results: dict) -> str:
    """A markdown table of lm-eval's results: a row per task and metric (``metric,filter`` keys)
    with its value and stderr (empty where lm-eval has none)."""
    lines = ["| task | metric | value | stderr |", "|---|---|---|---|"]
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")
            if not comma or metric.endswith("_stderr") or not _number(value):
                continue
            label = metric if filt == "none" else f"{metric} ({filt})"
            stderr = _number(metrics.get(f"{metric}_stderr,{filt}"))
            lines.append(f"| {task} | {label} | {_number(value)} | {stderr} |")
    return "\n".join(lines) + "\n"


def write_results(results: dict, out_dir: str | Path) -> Path:
    """``out_dir/results.json`` (lm-eval's results; objects JSON cannot hold written as text) and
    ``out_dir/results.md`` (:func:`lm_eval_table`), each written atomically."""
    from lm_eval.utils import handle_non_serializable

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    io.write_atomically(out / "results.json", text + "\n")
    io.write_atomically(out / "results.md", lm_eval_table(results))
    return out


def run_lm_eval(
    model,
    tasks,
    *,
    tokenizer=None,
    batch_size: int = 8,
    limit: int | float | None = None,
    out_dir: str | Path | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    """Evaluate ``model`` on lm-eval ``tasks`` and return lm-eval's results dict
    (``results["results"] [task]["acc,none"]``, ...; no per-sample logs).

    model: a model directory or hub id (:func:`ssmkit.from_pretrained`, loaded in fp32) or an
    ``nn.Module`` (moved to ``device`` in place). tasks: names, a list or one comma-separated
    string: the offline tasks (:data:`OFFLINE_TASKS`) or any of lm-eval's (the plan's
    :data:`PLAN_TASKS` need the hub or its cache). tokenizer: a name for
    :func:`ssmkit.data.get_tokenizer` or a tokenizer (default: the model directory's). limit: at
    most this many items per task (a float < 1: that fraction). out_dir: also write ``results.json``
    and ``results.md`` there. seed: lm-eval's seeds (python, numpy, torch, few-shot) and sampled
    generation's. Bad task names and unreachable datasets are a one-line ValueError before the model
    is loaded."""
    from lm_eval import simple_evaluate

    from .harness import SsmkitLM

    names = task_names(tasks)
    manager = task_manager(names)
    lm = SsmkitLM(model, tokenizer=tokenizer, batch_size=batch_size, device=device, seed=seed)
    results = simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=manager,
        limit=limit,
        log_samples=False,
        bootstrap_iters=BOOTSTRAP_ITERS,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    if out_dir is not None:
        write_results(results, out_dir)
    return results


def lm_eval_cli(argv: list[str] | None = None) -> None:
    """lm-eval's command line (``lm_eval run|ls|validate ...``) with the ``ssmkit`` model registered
    and, unless given, ``--include_path`` ssmkit's offline tasks and (``run``) ``--device auto``
    (lm-eval's own default is cuda:0, which the ssmkit model refuses on a machine without CUDA)."""
    from lm_eval.__main__ import cli_evaluate

    from . import harness  # noqa: F401  (registers the "ssmkit" model)

    args = list(sys.argv[1:] if argv is None else argv)

    def given(option):
        return any(a == option or a.startswith(option + "=") for a in args)

    if args and not {"-h", "--help"} & set(args):
        if not given("--include_path"):
            args += ["--include_path", str(TASKS_DIR)]
        if not given("--device") and args[0] not in ("ls", "validate"):
            args += ["--device", "auto"]
    sys.argv = ["lm_eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    lm_eval_cli()
