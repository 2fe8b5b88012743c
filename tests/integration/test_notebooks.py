"""Every notebook in notebooks/: committed clean and well-formed, and it runs top to bottom under
papermill.

Structure (the conventions in docs/workbook.md): no outputs or execution counts; exactly one cell
tagged ``parameters`` holding plain values with a comment each, including config, data, max_tokens,
device ("auto"), out_dir and seed (written from its chapter's declaration: tests/unit/workbook/
test_params.py); the first code cell after it imports the notebook's own chapter and checks every
parameter with ``chapter.PARAMETERS.check(globals())``; a stated CPU time in the metadata
(``ssmkit.cpu_seconds``); no ``sys.path`` hacks; no hard-coded "cuda" device strings; imports of
ssmkit's public API (and the notebook's chapter) only; no functions or classes defined in cells
(they belong in the library); short cells. Execution: each notebook under papermill on CPU with
params/ci.yaml (the keys it declares; a notebook that trains gets the file's TrainConfig keys
through its ``overrides``, and they reach the run's config.yaml), failing on any cell error, writing
out_dir/metrics.json, its peak RSS within a Binder session's 2 GB; and a bad ``device`` stops it
in the first cell after the parameters with ssmkit's error.

New notebooks are picked up automatically; params/ci.yaml holds their small CI parameters.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")

from helpers import ROOT  # noqa: E402

from ssmkit import workbook  # noqa: E402
from ssmkit.workbook.memory import BINDER_MIB  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]
REQUIRED = {"config", "data", "max_tokens", "device", "out_dir", "seed"}
MAX_CELL_LINES = 15  # lines of logic per code cell; longer belongs in ssmkit
DEVICE_STRING = re.compile(r"cuda(:\d*)?", re.IGNORECASE)


def code_cells(nb):
    """(index in the notebook, cell) of every code cell."""
    return [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def parse(source: str) -> ast.Module:
    """A cell's Python, with IPython magics / shell escapes (``%time``, ``!ls``) blanked out."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    return ast.parse("\n".join(lines))


def test_there_are_notebooks():
    assert (ROOT / "notebooks" / "00_setup.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_structure(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", "kernelspec must be python3"
    assert re.fullmatch(r"\d\d_[a-z0-9_]+", path.stem), "name notebooks NN_topic.ipynb"
    dirty = [i for i, cell in code_cells(nb) if cell.outputs or cell.execution_count is not None]
    assert not dirty, (
        f"{path.name}: cells {dirty} hold outputs or execution counts (saved by JupyterLab or "
        "papermill): close the notebook in JupyterLab (its autosave would write them back), "
        "run `make strip`, then commit"
    )
    assert "papermill" not in nb.metadata, "metadata of a papermill run: run `make strip`"
    assert set(nb.metadata.get("language_info", {})) <= {"name"}, (
        "a kernel's metadata: run `make strip`"
    )
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{len(tagged)} cells tagged `parameters`; exactly one is needed"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert cell.cell_type == "code"
    tree = parse(cell.source)
    names = {}
    for node in tree.body:
        assert (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ), f"parameters cell: only `name = value` lines, got {ast.unparse(node)!r}"
        try:
            names[node.targets[0].id] = ast.literal_eval(node.value)
        except ValueError:
            raise AssertionError(
                f"parameters cell: plain values only, got {ast.unparse(node)!r}"
            ) from None
    for line in cell.source.splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line, f"parameters cell: every value needs a comment: {line!r}"
    assert REQUIRED <= set(names), f"parameters cell lacks {sorted(REQUIRED - set(names))}"
    assert names["device"] == "auto", (
        "the default device must be 'auto' (a fallback, never hard-coded)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_check_cell_checks_every_parameter_with_the_notebooks_chapter(path):
    """So that each one is checked, and names papermill injected are compared with all of them: the
    first code cell after the parameters imports this notebook's chapter and calls its
    PARAMETERS.check once, on the notebook's namespace."""
    from ssmkit.workbook.chapters import chapter_of

    nb = nbformat.read(path, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    cell = next(c for c in nb.cells[index + 1 :] if c.cell_type == "code")
    tree = parse(cell.source)
    chapter = chapter_of(path).__name__.rpartition(".")[2]
    imports = [
        (n.module, a.name, a.asname)
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        for a in n.names
    ]
    assert ("ssmkit.workbook.chapters", chapter, "chapter") in imports, (
        f"import this notebook's chapter: from ssmkit.workbook.chapters import {chapter} as chapter"
    )
    calls = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "check"
    ]
    assert calls == ["chapter.PARAMETERS.check(globals())"], calls
    stated = nb.metadata.get("ssmkit", {}).get("cpu_seconds")
    assert isinstance(stated, (int, float)) and stated > 0, (
        "state the CPU time with params/cpu.yaml in metadata.ssmkit.cpu_seconds"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_code_uses_the_library_and_hardcodes_nothing(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in code_cells(nb):
        where = f"cell {i}"
        assert "sys.path" not in cell.source, (
            f"{where}: no sys.path hacks; `pip install -e .` instead"
        )
        tree = parse(cell.source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not DEVICE_STRING.fullmatch(node.value), (
                    f"{where}: hard-coded device {node.value!r}; use the `device` parameter"
                )
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                raise AssertionError(
                    f"{where}: defines {node.name!r}; helpers belong in ssmkit, not in a notebook"
                )
            modules = []
            if isinstance(node, ast.Import):
                modules = [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{where}: relative import"
                modules = [(node.module or "", [a.name for a in node.names])]
            for module, names in modules:
                if module.split(".")[0] == "ssmkit":
                    parts = module.split(".")
                    public = len(parts) <= 2 or module == "ssmkit.workbook.chapters"
                    assert public and not any(p.startswith("_") for p in parts + names), (
                        f"{where}: import the public API (ssmkit, ssmkit.<module>, the notebook's "
                        "chapter), "
                        f"not {module} {names}"
                    )
        assert not re.search(r"\bssmkit(\.\w+)*\._\w", cell.source), (
            f"{where}: uses a private ssmkit name"
        )
        logic = [
            ln for ln in cell.source.splitlines() if ln.strip() and not ln.strip().startswith("#")
        ]
        parameters = "parameters" in cell.metadata.get(
            "tags", []
        )  # values, written from PARAMETERS
        assert len(logic) <= MAX_CELL_LINES or parameters, (
            f"{where} has {len(logic)} lines; move the logic into ssmkit"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_runs_under_papermill(path, tmp_path):
    ci = workbook.load_params_file(ROOT / "params" / "ci.yaml")
    summary = workbook.run_workbook([path], out=tmp_path / "run", shared=ci, cell_timeout=600)
    (entry,) = summary["notebooks"]
    assert entry["status"] == "ok", (
        f"{path.name} failed at cell {entry.get('cell')}:\n"
        f"{entry.get('source')}\n{entry.get('error')}"
    )
    assert entry["metrics_file"], "the notebook must write out_dir/metrics.json"
    assert entry["metrics_file"].startswith(str((tmp_path / "run").resolve())), (
        "metrics.json outside out_dir"
    )
    assert entry["peak_rss_mb"] is not None and entry["peak_rss_mb"] <= BINDER_MIB, (
        f"{path.name}: peak RSS {entry['peak_rss_mb']} MiB with CI parameters; the workshop "
        f"budget is {BINDER_MIB} MiB (a free Binder session)"
    )
    declared = workbook.declared_parameters(path)
    if "overrides" in declared:  # it trains: ci.yaml's TrainConfig keys reach every run it trains
        import yaml

        recipe = {
            k: v for k, v in ci.items() if k in workbook.params.train_keys() and k not in declared
        }
        assert recipe and not set(recipe) & set(entry["unused_shared"])
        configs = list(Path(entry["metrics_file"]).parent.rglob("config.yaml"))
        assert configs, "a notebook that trains leaves its runs' config.yaml"
        for config in configs:
            saved = yaml.safe_load(config.read_text())
            assert {k: saved[k] for k in recipe} == recipe, config


# the stages that build models from `config`, run with a Mamba-3 one; 02's Mamba-3 path (DDP and
# FSDP launches, the planner's state per rank) is tests/unit/workbook/test_workbook_scale_up.py's
# test_compare_strategies_trains_alike, a third of this notebook's CI time
TRAINING = [p for p in NOTEBOOKS if p.stem[:2] not in ("00", "02")]
# Smaller still than params/ci.yaml: these runs show every cell takes a Mamba-3 model, not that it
# learns (ci.yaml's runs above check the numbers): 2 steps, one evaluation, no Transformer
# baseline (it does not change with `config`), one context length, one step per sweep model
MAMBA3 = {
    "config": "cpu-tiny-mamba3",
    "max_tokens": 8192,
    "evals": 1,
    "baseline": False,
    "sweep_steps": 1,
    "context_lengths": [64],
    "sft_steps": 2,
}


@pytest.mark.slow
@pytest.mark.parametrize("path", TRAINING, ids=[p.stem for p in TRAINING])
def test_runs_with_mamba3_blocks(path, tmp_path):
    """Every stage takes a Mamba-3 model as its run config: CI parameters made smaller (MAMBA3),
    config cpu-tiny-mamba3."""
    ci = workbook.load_params_file(ROOT / "params" / "ci.yaml")
    declared = workbook.declared_parameters(path)
    summary = workbook.run_workbook(
        [path],
        parameters={k: v for k, v in MAMBA3.items() if k in declared},
        out=tmp_path / "run",
        shared=ci,
        cell_timeout=600,
    )
    (entry,) = summary["notebooks"]
    assert entry["status"] == "ok", (
        f"{path.name} with Mamba-3 failed at cell {entry.get('cell')}:\n"
        f"{entry.get('source')}\n{entry.get('error')}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_bad_parameter_fails_in_the_first_cell(path, tmp_path):
    summary = workbook.run_workbook([path], parameters={"device": "tpu"}, out=tmp_path / "run")
    (entry,) = summary["notebooks"]
    nb = nbformat.read(path, as_version=4)
    first = 1 + next(
        i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])
    )
    first += next(i for i, c in enumerate(nb.cells[first:]) if c.cell_type == "code")
    assert entry["status"] == "failed" and entry["cell"] == first, entry
    assert entry["error"].startswith(
        "WorkbookError: device='tpu' is not valid; valid: auto, cpu, cuda"
    )


def test_a_gpu_recipe_on_cpu_is_refused_in_the_first_cell(tmp_path):
    """`01 -f params/gpu-a100.yaml` with device cpu stops in its check cell, in seconds, before any
    data is prepared (a learner's run once printed `device cpu, 19074 steps` and went on)."""
    import json
    import os
    import subprocess
    import sys
    import time

    path = ROOT / "notebooks" / "01_prototype_130m.ipynb"
    out = tmp_path / "run"
    command = [sys.executable, "-m", "ssmkit.cli", "workbook", "run", str(path), "-f",
               str(ROOT / "params" / "gpu-a100.yaml"), "-p", "data", "stdlib-docs", "-p",
               "device", "cpu", "--out", str(out)]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True)
    seconds = time.monotonic() - start
    assert done.returncode != 0, done.stdout + done.stderr
    (entry,) = json.loads((out / "summary.json").read_text())["notebooks"]
    nb = nbformat.read(path, as_version=4)
    first = 1 + next(
        i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])
    )
    first += next(i for i, c in enumerate(nb.cells[first:]) if c.cell_type == "code")
    assert entry["status"] == "failed" and entry["cell"] == first, entry
    assert entry["error"].startswith(
        "WorkbookError: device resolved to cpu, and this is a GPU-sized run: mamba-130m"
    ), entry["error"]
    assert "allow_cpu" in entry["error"] and seconds < 60, seconds
    assert not any(out.rglob("*.bin")), "no data was prepared"
