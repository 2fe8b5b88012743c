"""The notebooks under plain ``papermill``, the way cluster users run them (no
``ssmkit workbook run``): from the repository root, with ``-f`` recipe files and ``-p`` values as
papermill types them.

* a relative ``out_dir`` lands under the repository (it starts at notebooks/), not beside the
  working directory;
* a recipe's TrainConfig keys that the notebook does not declare (``micro_batch``, ...) reach the
  run's config.yaml through its ``overrides``; ``-p baseline false`` (the string "false") skips the
  Transformer;
* a misspelled name (papermill itself only warns "Passed unknown parameter") stops the run in the
  check cell;
* the executed copy shows the Trainer's progress as text, not as a frozen widget.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")
yaml = pytest.importorskip("yaml")

NOTEBOOK = "notebooks/01_prototype_130m.ipynb"
WIDGET = "application/vnd.jupyter.widget-view+json"


def papermill(*args, timeout=900):
    """``papermill ARGS`` from the repository root (offline: tests/conftest.py), SSMKIT_PROGRESS
    unset."""
    env = {k: v for k, v in os.environ.items() if k != "SSMKIT_PROGRESS"}
    return subprocess.run(
        [sys.executable, "-m", "papermill", *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def outputs(nb, marker: str) -> list:
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    return cell.outputs


def test_plain_papermill_from_the_repo_root(tmp_path):
    name = f"pytest-papermill-{os.getpid()}"  # under the checkout's runs/ (git-ignored)
    out_dir, outside = ROOT / "runs" / name, ROOT.parent / "runs" / name
    recipe = tmp_path / "recipe.yaml"  # params/ci.yaml + more of a recipe's TrainConfig keys
    recipe.write_text((ROOT / "params" / "ci.yaml").read_text() + "lr: 1.0e-3\nwarmup_steps: 1\n")
    executed = tmp_path / "out.ipynb"
    try:
        res = papermill(
            NOTEBOOK,
            executed,
            "-f",
            recipe,
            "-p",
            "baseline",
            "false",
            "-p",
            "out_dir",
            f"../runs/{name}",
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert (out_dir / "metrics.json").is_file() and not outside.exists()
        metrics = json.loads((out_dir / "metrics.json").read_text())
        assert metrics["device"] == "cpu" and metrics["tokens"] == 16384
        assert "transformer_val_loss" not in metrics and not (out_dir / "transformer").exists()
        config = yaml.safe_load((out_dir / "mamba" / "config.yaml").read_text())
        ci = yaml.safe_load((ROOT / "params" / "ci.yaml").read_text())
        assert (config["micro_batch"], config["eval_batches"]) == (
            ci["micro_batch"],
            ci["eval_batches"],
        )
        assert (config["lr"], config["warmup_steps"]) == (1e-3, 1)
        nb = nbformat.read(executed, as_version=4)
        text = "".join(o.get("text", "") for o in outputs(nb, "p = chapter.PARAMETERS.check("))
        assert (
            "overrides from papermill's parameters: micro_batch=4, eval_batches=2, lr=0.001, "
            "warmup_steps=1"
        ) in text
        training = outputs(nb, "history = trainer.fit()")
        assert not any(WIDGET in o.get("data", {}) for o in training), (
            "a widget bar shows frozen there"
        )
        assert "train Mamba" in "".join(
            o.get("text", "") for o in training if o.get("name") == "stderr"
        )
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def test_plain_papermill_stops_on_a_misspelled_parameter(tmp_path):
    executed = tmp_path / "out.ipynb"
    res = papermill(NOTEBOOK, executed, "-p", "max_tokenz", "1000", "-p", "out_dir", tmp_path / "o")
    assert "Passed unknown parameter: max_tokenz" in res.stderr  # all papermill itself does: warn
    assert res.returncode != 0
    nb = nbformat.read(executed, as_version=4)
    (error,) = [o for o in outputs(nb, "p = chapter.PARAMETERS.check(") if o.output_type == "error"]
    assert error.ename == "WorkbookError"
    assert error.evalue.startswith(
        "papermill passed parameter(s) max_tokenz that this notebook does not declare"
    )
    assert "its parameters: config, data, tokenizer, max_tokens, " in error.evalue
    assert not (tmp_path / "o").exists()  # stopped before anything was written
