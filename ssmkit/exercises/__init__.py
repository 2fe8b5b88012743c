"""Exercises that check themselves: a learner's answer in, one line out.

    from ssmkit.exercises import check
    check("p01.1", zoh=zoh, bilinear=bilinear)
    # p01.1 ZOH and bilinear by hand: public checks passed
    # p01.1 ZOH and bilinear by hand: not yet - bilinear: Ā is off; ...   (a hint, never the answer)
    # p01.1 ZOH and bilinear by hand: not done yet - replace the ... in zoh, bilinear

An exercise's id is ``NN.K`` for notebook ``notebooks/NN_*.ipynb`` and ``pNN.K`` for the paper note
``papers/NN_*.ipynb`` (``K``: its number in the notebook). Its checks live in the library, in one
module per notebook in this package (``nbNN_<name>.py``, ``pNN_<name>.py``), each exercise declared
with :func:`exercise`: what it is called, the names of its answers, and a wrong answer its check
must refuse (the unit tests try every one, so no check can pass everything).

A student copy (``ssmkit workbook build --for student``) holds ``name = ...`` where the master holds
the answer, so a copy run top to bottom reports each unanswered exercise as "not done yet" and goes
on. The line says "public checks passed", never "all tests passed": an instructor's copy may hold
hidden tests beyond these.

With ``SSMKIT_EXERCISES=strict`` in the environment (the test suite sets it, so every master's run
in CI is checked), a wrong or missing answer raises :class:`ExerciseError` instead of printing.
"""

from __future__ import annotations

import importlib
import math
import os
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "STRICT_ENV",
    "Exercise",
    "ExerciseError",
    "check",
    "close",
    "exercise",
    "exercises",
    "verdict",
]

STRICT_ENV = (
    "SSMKIT_EXERCISES"  # "strict": a wrong or missing answer raises (CI runs the masters so)
)
_ID = re.compile(r"^(p?)(\d\d)\.(\d+)$")


class ExerciseError(AssertionError):
    """A wrong or unanswered exercise under ``SSMKIT_EXERCISES=strict``, or an unknown id."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``id`` (``"p01.1"``), a short ``title``, the ``answers`` a learner gives
    (names, as keywords of :func:`check`), ``wrong``: answers its check must refuse, and ``judge``:
    ``judge(**answers_and_context) -> None`` when right, else a hint (a string) that does not give
    the answer away."""

    id: str
    title: str
    answers: tuple[str, ...]
    wrong: dict
    judge: Callable[..., str | None] = field(repr=False)


_REGISTRY: dict[str, Exercise] = {}


def exercise(id: str, title: str, answers: tuple[str, ...], wrong: dict):
    """Declare an exercise; decorates its judge (see :class:`Exercise`)::

    @exercise("p01.3", "memory of a ZOH mode", ("steps",), wrong={"steps": 100})
    def _(steps):
        if not close(math.exp(-0.005 * steps), math.exp(-1)):
            return "after that many steps |Ā|^k is not 1/e: solve e^(-Δk/2) = e^(-1) for k"
    """
    if not _ID.match(id):
        raise ValueError(f"exercise id {id!r}: expected NN.K or pNN.K, e.g. '01.2' or 'p03.1'")
    missing = set(answers) - set(wrong)
    if missing:
        raise ValueError(f"exercise {id}: `wrong` gives no value for {sorted(missing)}")

    def register(judge):
        if id in _REGISTRY:
            raise ValueError(f"exercise {id} is declared twice")
        _REGISTRY[id] = Exercise(id, title, tuple(answers), dict(wrong), judge)
        return judge

    return register


def _load_all() -> None:
    """Import every module of this package (each declares its notebook's exercises)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def exercises() -> dict[str, Exercise]:
    """Every declared exercise, by id, in id order."""
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def _find(id: str) -> Exercise:
    if id not in _REGISTRY:
        _load_all()
    if id not in _REGISTRY:
        known = ", ".join(_REGISTRY) or "none"
        raise ExerciseError(f"no exercise {id!r}; the exercises are: {known}")
    return _REGISTRY[id]


def _not_done(error: BaseException) -> bool:
    """Whether ``error`` is a student copy's "your turn" line running (an unanswered function)."""
    return isinstance(error, NotImplementedError) and "your turn" in str(error)


def verdict(id: str, **answers) -> tuple[str, str | None]:
    """``(state, hint)`` for ``answers`` to exercise ``id``: ``("passed", None)``,
    ``("not done", which names)`` or ``("wrong", the judge's hint)``; nothing printed."""
    ex = _find(id)
    absent = [n for n in ex.answers if n not in answers]
    if absent:
        raise ExerciseError(f"check({id!r}) needs the answer(s) {', '.join(absent)} as keywords")
    todo = [n for n in ex.answers if answers[n] is Ellipsis]
    if todo:
        return "not done", f"replace the ... in {', '.join(todo)}"
    try:
        hint = ex.judge(**answers)
    except Exception as error:  # the learner's code raised: say so in one line
        if _not_done(error):
            return "not done", "replace the `your turn` line with your answer"
        hint = f"your answer raised {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return ("passed", None) if hint is None else ("wrong", hint)


def check(id: str, **answers) -> bool:
    """Check ``answers`` (keywords: the exercise's answer names, plus any context its judge takes)
    to exercise ``id``; print one line and return whether the public checks passed."""
    state, hint = verdict(id, **answers)
    title = f"{id} {_REGISTRY[id].title}"
    line = {
        "passed": f"{title}: public checks passed",
        "not done": f"{title}: not done yet - {hint}",
        "wrong": f"{title}: not yet - {hint}",
    }[state]
    if state != "passed" and os.environ.get(STRICT_ENV) == "strict":
        raise ExerciseError(line)
    print(line)
    return state == "passed"


def close(got, want, rel: float = 1e-6, abs: float = 1e-9) -> bool:
    """Whether number(s) ``got`` equal ``want`` within ``rel`` / ``abs`` (sequences and tensors
    element by element; a wrong length or a non-number is simply not close)."""
    try:
        if hasattr(got, "tolist"):
            got = got.tolist()
        if hasattr(want, "tolist"):
            want = want.tolist()
        if isinstance(want, (list, tuple)):
            return (
                isinstance(got, (list, tuple))
                and len(got) == len(want)
                and all(close(g, w, rel, abs) for g, w in zip(got, want))
            )
        return math.isclose(complex(got).real, complex(want).real, rel_tol=rel, abs_tol=abs) and (
            math.isclose(complex(got).imag, complex(want).imag, rel_tol=rel, abs_tol=abs)
        )
    except (TypeError, ValueError):
        return False
