"""Every companion note in papers/: committed clean, its parameters cell and papers/README.md
written from its module, its exercises marked, and it runs top to bottom under papermill with
params/papers-ci.yaml, every claim checked (identities pass; orderings at CI size are shown, not
judged)."""

from __future__ import annotations

import ast
import json
import re

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")

from helpers import ROOT  # noqa: E402

from ssmkit import workbook  # noqa: E402
from ssmkit.papers import index, note_names, note_of  # noqa: E402
from ssmkit.workbook.chapters import parameters_cell  # noqa: E402
from ssmkit.workbook.memory import BINDER_MIB  # noqa: E402

NOTES = sorted((ROOT / "papers").glob("[0-9][0-9]_*.ipynb"))
IDS = [p.stem for p in NOTES]
MAX_CELL_LINES = 15
REQUIRED = {"device", "out_dir"}


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_every_note_has_a_module_and_every_module_a_note():
    assert NOTES, "no papers/NN_*.ipynb"
    assert sorted(n[1:] for n in note_names()) == [p.stem[:2] + "_" + p.stem[3:] for p in NOTES]


def test_readme_is_written_from_the_notes():
    readme = (ROOT / "papers" / "README.md").read_text(encoding="utf-8")
    assert readme == index(ROOT / "papers"), "papers/README.md is stale: python -m ssmkit.papers"


@pytest.mark.parametrize("path", NOTES, ids=IDS)
def test_structure(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in code_cells(nb)), (
        "outputs committed: make strip"
    )
    module = note_of(path)
    have, want = parameters_cell(path, module)
    assert have == want, (
        "parameters cell differs from the module's PARAMETERS: python -m ssmkit.papers"
    )
    assert REQUIRED <= set(workbook.declared_parameters(path))
    from papermill.translators import PythonTranslator

    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    seen = [p.name for p in PythonTranslator.inspect(cell)]
    assert seen == list(module.PARAMETERS.names), "papermill cannot parse every parameter line"
    assert nb.metadata.get("ssmkit", {}).get("cpu_seconds"), "state the CPU time in metadata"
    first = code_cells(nb)[1].source
    assert f"from ssmkit.papers import {module.__name__.rsplit('.', 1)[1]} as note" in first
    assert "note.PARAMETERS.check(globals())" in first and "note.claim_book()" in first
    assert "book.verify()" in code_cells(nb)[-1].source, "the note ends by verifying its claims"
    for cell in code_cells(nb):
        tree = ast.parse(
            "\n".join(
                "" if ln.lstrip().startswith(("%", "!")) else ln for ln in cell.source.splitlines()
            )
        )
        assert not any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in ast.walk(tree)), (
            "functions belong in the note's module"
        )
        logic = [
            ln for ln in cell.source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
        ]
        assert len(logic) <= MAX_CELL_LINES or "parameters" in cell.metadata.get("tags", []), (
            f"a cell of {len(logic)} lines: move its logic into {module.__name__}"
        )


@pytest.mark.parametrize("path", NOTES, ids=IDS)
def test_exercises_are_marked(path):
    """At least two exercises, each solution between nbgrader's markers in a cell tagged
    'solution', so a student copy can strip it."""
    nb = nbformat.read(path, as_version=4)
    solutions = [c for c in nb.cells if "solution" in c.metadata.get("tags", [])]
    assert len(solutions) >= 2
    for cell in solutions:
        src = cell.source
        assert src.count("### BEGIN SOLUTION") == 1 and src.count("### END SOLUTION") == 1
        assert src.index("### BEGIN SOLUTION") < src.index("### END SOLUTION")
    unmarked = [c for c in nb.cells if "SOLUTION" in c.source and c not in solutions]
    assert not unmarked, "solution markers in a cell not tagged 'solution'"


@pytest.mark.parametrize("path", NOTES, ids=IDS)
def test_runs_under_papermill_with_every_claim_checked(path, tmp_path):
    ci = workbook.load_params_file(ROOT / "params" / "papers-ci.yaml")
    summary = workbook.run_workbook([path], out=tmp_path / "run", shared=ci, cell_timeout=300)
    (entry,) = summary["notebooks"]
    assert entry["status"] == "ok", (
        f"{path.name} failed at cell {entry.get('cell')}:\n{entry.get('source')}\n"
        f"{entry.get('error')}"
    )
    assert entry["peak_rss_mb"] is not None and entry["peak_rss_mb"] <= BINDER_MIB, (
        f"{path.name}: peak RSS {entry['peak_rss_mb']} MiB, over a Binder session's {BINDER_MIB}"
    )
    records = json.loads((tmp_path / "run" / path.stem / "claims.json").read_text())
    assert [r["id"] for r in records] == [c.id for c in note_of(path).CLAIMS]
    for r in records:
        assert r["outcome"] is not None, f"{r['id']} never checked"
        if r["kind"] == "identity":
            assert r["outcome"]["passed"] is True, r
        assert r["outcome"]["passed"] is not False, r
    figures = list((tmp_path / "run" / path.stem).glob("*.png"))
    assert figures, "a note re-plots at least one figure from its own run"
    assert not re.search(r"Traceback", json.dumps(entry))
