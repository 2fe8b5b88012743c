"""ssmkit.workbook.copies: the student, solution and instructor copies of a master notebook.

Oracles: a synthetic master made with nbformat whose answers, hidden tests and instructor notes are
known strings; the copies are read back with nbformat (and validated against its schema), and their
code cells are run in this process: the solution copy's checks pass; the student copy's
``name = ...`` placeholder makes its ``check()`` report "not done yet" and the copy runs on, and an
answer that assigns nothing (a function's body) stops it with the "your turn" error. Every refusal
is injected into an otherwise good master and must name the cell and leave OUT untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from ssmkit import cli, exercises
from ssmkit.workbook import WorkbookError, build_copies, build_copy
from ssmkit.workbook.copies import PLACEHOLDER, RECORD, YOUR_TURN

ANSWER = "answer = 6 * 7  # the secret"
HIDDEN = "assert answer % 2 == 0  # the secret check"
NOTE = "Instructor: most learners forget the factor 7."
FUNC_ANSWER = "return x * x  # the squared secret"
CHECK = 'check("99.5", answer=answer)'  # the toy exercise below
ASKED = PLACEHOLDER.format(name="answer")  # the student copy's line in place of ANSWER


@pytest.fixture(autouse=True)
def toy_exercise():
    """Exercise "99.5" of the synthetic master: right when ``answer`` is 42."""

    @exercises.exercise("99.5", "the answer", ("answer",), wrong={"answer": 41})
    def _(answer):
        return None if answer == 42 else "not 42"

    yield
    exercises._REGISTRY.pop("99.5")


def master_cells() -> list:
    """A small master: setup, two exercises (one indented inside a function), hidden tests, an
    instructor note, a markdown exercise."""
    return [
        new_markdown_cell("# A note\nSome prose."),
        new_code_cell("base = 6", metadata={"tags": ["parameters"]}),
        new_code_cell(
            "from ssmkit.exercises import check\n\nfactor = 7\n### BEGIN SOLUTION\n"
            f"{ANSWER}\n### END SOLUTION\n{CHECK}",
            metadata={"tags": ["solution"]},
            outputs=[new_output("stream", name="stdout", text="42\n")],
            execution_count=3,
        ),
        new_code_cell(
            "assert answer is not None\n### BEGIN HIDDEN TESTS\n" + HIDDEN + "\n"
            "### END HIDDEN TESTS"
        ),
        new_markdown_cell(NOTE, metadata={"tags": ["instructor"]}),
        new_code_cell(
            f"def square(x):\n    ### BEGIN SOLUTION\n    {FUNC_ANSWER}\n    ### END SOLUTION\n"
            "\nassert square(3) == 9",
            metadata={"tags": ["solution"]},
        ),
        new_markdown_cell(
            "Why 42?\n### BEGIN SOLUTION\nBecause it is 6 x 7.\n### END SOLUTION",
            metadata={"tags": ["solution"]},
        ),
    ]


def write_master(folder: Path, cells=None, name: str = "01_note.ipynb") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    nbformat.write(new_notebook(cells=master_cells() if cells is None else cells), path)
    return path


@pytest.fixture
def master(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return write_master(tmp_path / "papers")


def run_code(nb, ns: dict | None = None) -> dict:
    """Run a copy's code cells in order in one namespace (as a kernel would); returns it."""
    ns = {} if ns is None else ns
    for cell in nb.cells:
        if cell.cell_type == "code":
            exec(compile(cell.source, "<cell>", "exec"), ns)
    return ns


def read(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    return nb


def test_student_copy_asks_for_each_answer_and_hides_the_rest(
    master, tmp_path, monkeypatch, capsys
):
    before = master.read_bytes()
    (path,) = build_copies([master], "student", tmp_path / "out")
    assert path == tmp_path / "out" / "papers" / master.name and master.read_bytes() == before
    nb = read(path)
    text = json.dumps(nb)
    for secret in (ANSWER, HIDDEN, NOTE, FUNC_ANSWER, "6 x 7", "BEGIN", "END"):
        assert secret not in text, secret
    assert len(nb.cells) == len(master_cells()) - 1  # the instructor note is gone
    first, hidden, func, prose = nb.cells[2], nb.cells[3], nb.cells[4], nb.cells[5]
    assert first.source.endswith(f"factor = 7\n{ASKED}\n{CHECK}")
    assert first.outputs == [] and first.execution_count is None
    assert first.metadata.tags == ["exercise"]
    assert hidden.source == "assert answer is not None"
    assert func.source == f"def square(x):\n    {YOUR_TURN}\n\nassert square(3) == 9"
    assert prose.source.startswith("Why 42?\n_Exercise: your turn")
    assert nb.metadata.ssmkit == {"copy": "student"}
    monkeypatch.delenv(exercises.STRICT_ENV, raising=False)
    ns: dict = {}
    with pytest.raises(NotImplementedError, match="Exercise: your turn - replace this line"):
        run_code(nb, ns)  # the first exercise reports and runs on; the function's body stops it
    assert ns["factor"] == 7 and ns["answer"] is Ellipsis
    assert capsys.readouterr().out == (
        "99.5 the answer: not done yet - replace the ... in answer\n"
    )


def test_solution_copy_holds_each_answer_and_its_checks_pass(master, tmp_path):
    (path,) = build_copies([master], "solution", tmp_path / "out")
    nb = read(path)
    text = json.dumps(nb)
    for gone in (HIDDEN, NOTE, "###", "your turn"):
        assert gone not in text, gone
    assert nb.cells[2].source.endswith(f"factor = 7\n{ANSWER}\n{CHECK}")
    assert nb.cells[4].source == f"def square(x):\n    {FUNC_ANSWER}\n\nassert square(3) == 9"
    assert nb.cells[5].source == "Why 42?\nBecause it is 6 x 7."
    assert run_code(nb)["answer"] == 42  # under the suite's strict mode: check() raised nothing


def test_instructor_copy_is_the_master_with_its_kind_recorded(master, tmp_path):
    (path,) = build_copies([master], "instructor", tmp_path / "out")
    nb, original = read(path), nbformat.read(master, as_version=4)
    assert nb.cells == original.cells  # markers, hidden tests, notes and outputs kept
    assert nb.metadata.ssmkit == {"copy": "instructor"}
    run_code(nb)  # hidden tests included, the master's answers pass them


BAD = {
    "an answer never closed": ("x = 1\n### BEGIN SOLUTION\nx = 2", ["solution"], "never closed"),
    "an end with no begin": ("x = 1\n### END SOLUTION", ["solution"], "has no '### BEGIN"),
    "hidden tests inside an answer": (
        "### BEGIN SOLUTION\nx = 2\n### BEGIN HIDDEN TESTS\nassert x\n### END HIDDEN TESTS\n"
        "### END SOLUTION",
        ["solution"],
        "may not nest",
    ),
    "an answer inside an answer": (
        "### BEGIN SOLUTION\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION\n### END SOLUTION",
        ["solution"],
        "may not nest",
    ),
    "ends crossed": (
        "### BEGIN SOLUTION\nx = 2\n### END HIDDEN TESTS",
        ["solution"],
        "inside the solution region",
    ),
    "a misspelled marker": (
        "# BEGIN SOLUTION\nx = 2\n### END SOLUTION",
        ["solution"],
        "mentions a marker but is not one",
    ),
    "markers in an untagged cell": (
        "### BEGIN SOLUTION\nx = 2\n### END SOLUTION",
        [],
        "is not tagged 'solution'",
    ),
    "a solution cell with no marked answer": ("x = 2  # leaks", ["solution"], "marks no answer"),
}


@pytest.mark.parametrize("source, tags, message", BAD.values(), ids=list(BAD))
def test_a_bad_master_is_refused_naming_the_cell_and_nothing_is_written(
    source, tags, message, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    good = write_master(tmp_path / "notebooks", name="00_good.ipynb")
    cells = master_cells()
    cells.insert(3, new_code_cell(source, metadata={"tags": tags}))
    bad = write_master(tmp_path / "papers", cells)
    for kind in ("student", "solution", "instructor"):
        with pytest.raises(WorkbookError, match=message) as refused:
            build_copies([good, bad], kind, tmp_path / "out")
        assert f"{bad} cell 3" in str(refused.value)
        assert not (tmp_path / "out").exists()


def test_a_copy_is_not_a_master(master, tmp_path):
    (copy,) = build_copies([master], "solution", tmp_path / "out")
    with pytest.raises(WorkbookError, match="is a solution copy, not a master"):
        build_copies([copy], "student", tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_out_may_not_overlap_a_master_folder(master, tmp_path):
    for out in (tmp_path / "papers", tmp_path / "papers" / "student", tmp_path):
        with pytest.raises(WorkbookError, match="overlaps the master folder"):
            build_copies([master], "student", out)
    assert sorted(p.name for p in (tmp_path / "papers").iterdir()) == [master.name]


def test_out_keeps_files_it_did_not_write_and_kinds_apart(master, tmp_path):
    out = tmp_path / "out"
    (out / "papers").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "papers" / master.name).write_text("a learner's own work")
    with pytest.raises(WorkbookError, match="was not written by `ssmkit workbook build`"):
        build_copies([master], "student", out)
    assert (out / "papers" / master.name).read_text() == "a learner's own work"
    (out / "papers" / master.name).unlink()
    build_copies([master], "student", out)
    build_copies([master], "student", out)  # a rebuild replaces its own files
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / RECORD).read_text()) == {
        "kind": "student",
        "written": [f"papers/{master.name}"],
    }
    before = (out / "papers" / master.name).read_bytes()
    with pytest.raises(WorkbookError, match="holds a student build"):
        build_copies([master], "solution", out)
    assert (out / "papers" / master.name).read_bytes() == before  # no answers on the handout
    (tmp_path / "file").write_text("")
    with pytest.raises(WorkbookError, match="is a file"):
        build_copies([master], "student", tmp_path / "file")


def test_build_copy_writes_one_file_and_replaces_only_a_copy(master, tmp_path):
    target = tmp_path / "one" / "student.ipynb"
    assert build_copy(master, "student", target) == target
    assert read(target).metadata.ssmkit == {"copy": "student"}
    build_copy(master, "solution", target)  # a copy it wrote may be replaced
    assert ANSWER in target.read_text()
    (tmp_path / "mine.ipynb").write_text("{}")
    for where, message in (
        (tmp_path / "mine.ipynb", "is not a copy"),
        (master, "lies in the master folder"),
        (master.parent / "02_other.ipynb", "lies in the master folder"),
    ):
        with pytest.raises(WorkbookError, match=message):
            build_copy(master, "student", where)
    assert (tmp_path / "mine.ipynb").read_text() == "{}"
    assert not (master.parent / "02_other.ipynb").exists()
    with pytest.raises(WorkbookError, match="unknown copy kind 'teacher'"):
        build_copy(master, "teacher", tmp_path / "t.ipynb")


def test_the_command_builds_by_default_and_refuses_in_one_line(master, tmp_path, capsys):
    notebooks = write_master(tmp_path / "notebooks", name="00_setup.ipynb")
    cli.main(["workbook", "build", "--for", "student", "handout"])  # default: notebooks/, papers/
    out = capsys.readouterr().out.splitlines()
    assert out == [f"student {Path('handout') / 'notebooks' / notebooks.name}",
                   f"student {Path('handout') / 'papers' / master.name}"]  # fmt: skip
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1", metadata={"tags": ["solution"]})]),
                   master)  # fmt: skip
    with pytest.raises(SystemExit) as done:
        cli.main(["workbook", "build", "--for", "solution", "answers", str(master)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"ssmkit workbook: {master} cell 0 is tagged 'solution'")
    assert not Path("answers").exists()
