"""`ssmkit workbook build` on every real master (notebooks/, papers/): the student copies leak no
answer, hidden test or instructor note; the solution copies hold every answer; the instructor copies
are the masters. A student copy holds ``name = ...  # Exercise: your turn`` for each name an answer
assigns (or one raising "your turn" line).

The oracle reads the masters' markers with its own few lines (a region is the lines between two
marker lines), independent of ssmkit.workbook.copies; the copies are read with nbformat and
validated against its schema. Nothing is executed (papermill on the real notes is
test_papers.py's and test_notebooks.py's business).
"""

from __future__ import annotations

import json
import re

import pytest

nbformat = pytest.importorskip("nbformat")

from helpers import ROOT  # noqa: E402

from ssmkit import cli  # noqa: E402

MASTERS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "papers").glob("*.ipynb"))
SOLUTION = ("### BEGIN SOLUTION", "### END SOLUTION")
HIDDEN = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")


def regions(source: str, markers: tuple[str, str]) -> list[list[str]]:
    """The lines between each pair of ``markers`` lines of one cell."""
    found, inside = [], None
    for line in source.splitlines():
        if line.strip() == markers[0]:
            inside = []
        elif line.strip() == markers[1]:
            found.append(inside)
            inside = None
        elif inside is not None:
            inside.append(line)
    return found


def outside(source: str) -> str:
    """A cell's lines that lie in no marked region."""
    kept, inside = [], False
    for line in source.splitlines():
        if line.strip() in (SOLUTION[0], HIDDEN[0]):
            inside = True
        elif line.strip() in (SOLUTION[1], HIDDEN[1]):
            inside = False
        elif not inside:
            kept.append(line.strip())
    return "\n".join(kept)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The three builds of every master, made by the command with its default masters."""
    out = tmp_path_factory.mktemp("copies")
    before = {p: p.read_bytes() for p in MASTERS}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        for kind in ("student", "solution", "instructor"):
            cli.main(["workbook", "build", "--for", kind, str(out / kind)])
    assert {p: p.read_bytes() for p in MASTERS} == before, "a build changed a master"
    return out


def test_every_master_is_built_in_each_kind(built):
    assert MASTERS
    for kind in ("student", "solution", "instructor"):
        copies = sorted((built / kind).rglob("*.ipynb"))
        assert [c.relative_to(built / kind) for c in copies] == sorted(
            m.relative_to(ROOT) for m in MASTERS
        )
        for c in copies:
            nbformat.validate(nbformat.read(c, as_version=4))


@pytest.mark.parametrize("master", MASTERS, ids=[f"{p.parent.name}/{p.stem}" for p in MASTERS])
def test_copies_of_a_master(master, built):
    rel = master.relative_to(ROOT)
    nb = nbformat.read(master, as_version=4)
    student = nbformat.read(built / "student" / rel, as_version=4)
    solution = nbformat.read(built / "solution" / rel, as_version=4)
    instructor = nbformat.read(built / "instructor" / rel, as_version=4)
    answers = [r for c in nb.cells for r in regions(c.source, SOLUTION)]
    hidden = [r for c in nb.cells for r in regions(c.source, HIDDEN)]
    notes = [c.source for c in nb.cells if "instructor" in c.metadata.get("tags", [])]
    visible = "\n".join(outside(c.source) for c in nb.cells)  # what every copy may show

    text = "\n".join(c.source for c in student.cells)
    for region in answers + hidden:
        for line in region:
            if line.strip() and line.strip() not in visible:
                assert line.strip() not in text, f"{rel}: student copy leaks {line!r}"
    for marker in (*SOLUTION, *HIDDEN):
        assert marker not in text
    asked = re.findall(r"^\s*(\w+) = \.\.\.  # Exercise: your turn", text, re.M)
    assert text.count("Exercise: your turn") >= len(answers)
    stray = [n for n in asked if not any(re.search(rf"\b{n}\b", "\n".join(r)) for r in answers)]
    assert not stray, f"{rel}: placeholders for names no answer assigns: {stray}"
    assert not any(n and n in text for n in notes)
    assert all(c.get("outputs", []) == [] for c in student.cells)
    assert len(student.cells) == len(nb.cells) - len(notes)

    text = "\n".join(c.source for c in solution.cells)
    for region in answers:
        assert "\n".join(region) in text, f"{rel}: solution copy lacks an answer"
    for marker in (*SOLUTION, *HIDDEN):
        assert marker not in text
    assert "your turn" not in text and not any(n and n in text for n in notes)
    for region in hidden:
        assert not any(line.strip() and line.strip() not in visible and line in text
                       for line in region)  # fmt: skip

    assert instructor.cells == nb.cells
    assert instructor.metadata.ssmkit["copy"] == "instructor"
    print(f"{rel}: {len(answers)} exercises, {len(hidden)} hidden tests, {len(notes)} notes")


def test_a_second_build_of_another_kind_into_a_handout_is_refused(built, capsys):
    before = (built / "student" / "papers" / "01_s4.ipynb").read_bytes()
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as done:
        mp.chdir(ROOT)
        cli.main(["workbook", "build", "--for", "solution", str(built / "student")])
    assert done.value.code == 2 and "holds a student build" in capsys.readouterr().err
    assert (built / "student" / "papers" / "01_s4.ipynb").read_bytes() == before
    assert json.loads((built / "student" / ".ssmkit-copies.json").read_text())["kind"] == "student"
