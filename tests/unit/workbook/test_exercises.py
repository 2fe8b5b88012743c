"""ssmkit.exercises: every declared exercise refuses its declared wrong answer with a hint;
an unanswered one (``...``, or the student copy's "your turn" error) is "not done yet"; strict mode
raises; the printed line never claims more than the public checks; and the exercises and the
masters' ``check("...")`` calls match one to one (notebooks/ and papers/ as they are, whichever
notebooks have exercises so far)."""

from __future__ import annotations

import inspect
import json
import re
from collections import Counter

import pytest
from helpers import ROOT

from ssmkit import exercises as ex
from ssmkit.exercises import ExerciseError, check, exercises, verdict

ALL = exercises()
MASTERS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "papers").glob("*.ipynb"))
PAPERS = sorted((ROOT / "papers").glob("[0-9][0-9]_*.ipynb"))
CHECK = re.compile(r"""\bcheck\(\s*["']([^"']+)["']""")


def needs_context(id) -> bool:
    """Whether exercise ``id``'s judge needs more than its answers (a model an earlier cell built):
    such a wrong answer is tried in the notebook's own test, with that context."""
    params = inspect.signature(ALL[id].judge).parameters.values()
    return any(p.default is p.empty and p.name not in ALL[id].wrong for p in params)


ALONE = sorted(i for i in ALL if not needs_context(i))
WITH_CONTEXT = sorted(i for i in ALL if needs_context(i))


def used_ids() -> dict[str, list[str]]:
    """{exercise id: the masters (relative paths) whose code cells call check() with it}."""
    found: dict[str, list[str]] = {}
    for path in MASTERS:
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            for id in CHECK.findall(source):
                found.setdefault(id, []).append(path.relative_to(ROOT).as_posix())
    return found


@pytest.fixture
def lenient(monkeypatch):
    monkeypatch.delenv(ex.STRICT_ENV, raising=False)


@pytest.fixture
def toy():
    """A throwaway exercise "99.1" (answer ``n``, right when 3), removed afterwards."""

    @ex.exercise("99.1", "toy", ("n",), wrong={"n": 4})
    def _(n, scale=1):
        if n == "raise":
            raise NotImplementedError("Exercise: your turn - replace this line with your answer")
        if n == "boom":
            raise ValueError("a learner's bug\nsecond line")
        return None if n * scale == 3 else "n is off"

    yield "99.1"
    ex._REGISTRY.pop("99.1")


@pytest.mark.parametrize("id", ALONE, ids=ALONE)
def test_every_exercise_refuses_its_wrong_answer_with_a_hint(id):
    e = ALL[id]
    hint = e.judge(**e.wrong)  # called directly: a judge that crashes on it does not pass here
    assert isinstance(hint, str) and hint.strip(), f"{id} accepted its wrong answer"
    assert verdict(id, **e.wrong) == ("wrong", hint)


@pytest.mark.parametrize("id", WITH_CONTEXT, ids=WITH_CONTEXT)
def test_an_exercise_that_needs_context_is_tried_with_it_elsewhere(id):
    """Its wrong answer is refused in tests/unit/workbook/test_exercises_notebooks.py, with the
    model it needs (``refuses_wrong(id, context...)``)."""
    tests = (ROOT / "tests/unit/workbook/test_exercises_notebooks.py").read_text(encoding="utf-8")
    assert f'refuses_wrong("{id}", ' in tests, f"{id}: no test tries its wrong answer in context"


@pytest.mark.parametrize("id", sorted(ALL), ids=sorted(ALL))
def test_ellipsis_answers_are_not_done(id):
    e = ALL[id]
    state, hint = verdict(id, **{**e.wrong, **{n: ... for n in e.answers}})
    assert state == "not done" and all(n in hint for n in e.answers)


def test_the_student_copys_your_turn_error_is_not_done(toy, lenient, capsys):
    assert verdict(toy, n="raise") == (
        "not done",
        "replace the `your turn` line with your answer",
    )
    assert check(toy, n="raise") is False
    assert "99.1 toy: not done yet - " in capsys.readouterr().out


def test_a_learners_error_is_a_one_line_hint(toy):
    state, hint = verdict(toy, n="boom")
    assert state == "wrong" and hint == "your answer raised ValueError: a learner's bug"


def test_the_printed_line_says_public_checks_never_all_tests(toy, lenient, capsys):
    assert check(toy, n=3) is True
    assert check(toy, n=1, scale=3) is True  # context keywords reach the judge
    assert check(toy, n=4) is False
    assert check(toy, n=...) is False
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "99.1 toy: public checks passed",
        "99.1 toy: public checks passed",
        "99.1 toy: not yet - n is off",
        "99.1 toy: not done yet - replace the ... in n",
    ]
    assert not any("all tests" in line for line in out)


def test_strict_mode_raises_on_wrong_and_unanswered(toy, monkeypatch, capsys):
    monkeypatch.setenv(ex.STRICT_ENV, "strict")
    with pytest.raises(ExerciseError, match="99.1 toy: not yet - n is off"):
        check(toy, n=4)
    with pytest.raises(ExerciseError, match="not done yet"):
        check(toy, n=...)
    assert check(toy, n=3) is True
    assert capsys.readouterr().out == "99.1 toy: public checks passed\n"


def test_an_unknown_id_lists_the_exercises():
    with pytest.raises(ExerciseError) as err:
        check("p99.9", x=1)
    assert "no exercise 'p99.9'" in str(err.value)
    assert all(id in str(err.value) for id in ALL)


def test_a_missing_answer_keyword_is_named(toy):
    with pytest.raises(ExerciseError, match=r"check\('99.1'\) needs the answer\(s\) n"):
        check(toy, scale=2)


def test_a_declaration_is_checked():
    with pytest.raises(ValueError, match="expected NN.K or pNN.K"):
        ex.exercise("1.1", "bad id", ("n",), wrong={"n": 0})
    with pytest.raises(ValueError, match=r"gives no value for \['m'\]"):
        ex.exercise("99.2", "no wrong m", ("n", "m"), wrong={"n": 0})
    with pytest.raises(ValueError, match="declared twice"):
        ex.exercise(next(iter(ALL)), "again", ("n",), wrong={"n": 0})(lambda n: None)


def test_every_paper_note_has_two_exercises_or_more():
    per_note = Counter(id.split(".")[0] for id in ALL if id.startswith("p"))
    assert PAPERS
    for path in PAPERS:
        assert per_note[f"p{path.stem[:2]}"] >= 2, f"{path.name} registers fewer than 2 exercises"


def test_masters_and_exercises_match_one_to_one():
    used = used_ids()
    unknown = sorted(set(used) - set(ALL))
    assert not unknown, f"check() of undeclared exercises: {unknown}"
    unused = sorted(set(ALL) - set(used))
    assert not unused, f"exercises no master checks: {unused}"
    twice = {id: where for id, where in used.items() if len(where) > 1}
    assert not twice, f"exercises checked more than once: {twice}"
    for id, (where,) in used.items():  # pNN.K in papers/NN_*, NN.K in notebooks/NN_*
        folder, number = ("papers", id[1:3]) if id.startswith("p") else ("notebooks", id[:2])
        assert where.startswith(f"{folder}/{number}_"), f"{id} is checked in {where}"


def test_the_instructors_guide_lists_every_exercise():
    """docs/workshop.md's exercise table names each exercise once, with its notebook."""
    guide = (ROOT / "docs/workshop.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(p?\d\d\.\d+)` \| `([^`]+)` \|", guide, re.M))
    assert set(rows) == set(ALL), set(rows) ^ set(ALL)
    for id, notebook in rows.items():
        assert notebook + ".ipynb" in used_ids()[id], (id, notebook)
