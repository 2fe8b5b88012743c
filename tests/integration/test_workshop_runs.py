"""Workshop copies run top to bottom under papermill, as a learner and as CI run them.

The student copy of a master whose exercises report through ``check()`` runs to its end without
strict mode (a learner's kernel), printing "not done yet" once per exercise; the solution copy runs
under the suite's ``SSMKIT_EXERCISES=strict`` (tests/conftest.py; the kernel inherits it), so one
refused answer would fail the run. Parameters: the small ones the masters' own papermill tests use
(params/papers-ci.yaml for papers/, params/ci.yaml for notebooks/).
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("papermill")

from helpers import ROOT  # noqa: E402

from ssmkit import workbook  # noqa: E402
from ssmkit.exercises import STRICT_ENV  # noqa: E402
from ssmkit.workbook.copies import build_copy  # noqa: E402

CASES = [ROOT / "papers" / "01_s4.ipynb", ROOT / "notebooks" / "00_setup.ipynb"]
CHECK = re.compile(r"""\bcheck\(\s*["']([^"']+)["']""")
PARAMS = {"papers": "papers-ci.yaml", "notebooks": "ci.yaml"}


def exercise_ids(master) -> list[str]:
    """The ids the master's code cells check, in order."""
    nb = json.loads(master.read_text(encoding="utf-8"))
    return [i for c in nb["cells"] if c["cell_type"] == "code" for i in CHECK.findall(
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"])]  # fmt: skip


def run_copy(master, kind: str, tmp_path) -> str:
    """Build the ``kind`` copy of ``master`` under ``tmp_path`` and run it with run_workbook;
    returns the executed notebook's stdout, all cells together."""
    copy = build_copy(master, kind, tmp_path / kind / master.relative_to(ROOT))
    ci = workbook.load_params_file(ROOT / "params" / PARAMS[master.parent.name])
    # one notebook at a time, outside the checkout: only the keys it declares
    ci = {k: v for k, v in ci.items() if k in workbook.declared_parameters(master)}
    summary = workbook.run_workbook(
        [copy], out=tmp_path / f"run-{kind}", shared=ci, cell_timeout=300
    )
    (entry,) = summary["notebooks"]
    assert entry["status"] == "ok", (
        f"{kind} copy of {master.name} failed at cell {entry.get('cell')}:\n"
        f"{entry.get('source')}\n{entry.get('error')}"
    )
    executed = json.loads((tmp_path / f"run-{kind}" / copy.name).read_text(encoding="utf-8"))
    return "".join(
        "".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", [])
    )


@pytest.mark.parametrize("master", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_student_copy_runs_to_its_end_reporting_each_exercise_not_done(
    master, tmp_path, monkeypatch
):
    ids = exercise_ids(master)
    assert ids, f"{master.name} has no check() exercises"
    monkeypatch.delenv(STRICT_ENV, raising=False)  # a learner's kernel: no strict mode
    out = run_copy(master, "student", tmp_path)
    for id in ids:
        assert len(re.findall(rf"^{re.escape(id)} .*: not done yet - ", out, re.M)) == 1, (id, out)
    assert out.count("not done yet") == len(ids) and "public checks passed" not in out


@pytest.mark.parametrize("master", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_solution_copy_passes_every_check_in_strict_mode(master, tmp_path):
    ids = exercise_ids(master)
    assert ids, f"{master.name} has no check() exercises"
    import os

    assert os.environ.get(STRICT_ENV) == "strict"  # tests/conftest.py; the kernel inherits it
    out = run_copy(master, "solution", tmp_path)
    for id in ids:
        assert len(re.findall(rf"^{re.escape(id)} .*: public checks passed$", out, re.M)) == 1, id
    assert "not yet" not in out and "not done" not in out
