"""Offline instruction sets for SFT: built here, from nothing but the standard library, in trl's
conversational format (``{"messages": [user, assistant]}``). :data:`SFT_SOURCES` names them; each
takes ``(split, seed, n)`` and returns rows for :func:`ssmkit.data.sft_format.parse_record`.

Splits are held out by the *item*, not by the draw: an item (a function, an arithmetic question) is
in "val" when the sha256 of a fixed salt and its name falls in the first :data:`VAL_PERCENT` of the
hash range. So "train" and "val" never share an item, whatever ``seed``, and the split of an item is
the same on every machine.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import re
import sysconfig
from pathlib import Path

VAL_PERCENT = 10
SPLITS = ("train", "val")


def in_val(salt: str, item: str) -> bool:
    """Whether ``item`` belongs to the held-out split (a fixed hash of ``salt/item``)."""
    return int(hashlib.sha256(f"{salt}/{item}".encode()).hexdigest()[:8], 16) % 100 < VAL_PERCENT


def _check(split: str, n):
    if split not in SPLITS:
        raise ValueError(
            f"split {split!r} is not valid for an offline SFT set; valid: {', '.join(SPLITS)}"
        )
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"the number of samples must be a positive integer or None; got {n!r}")


def _chat(question: str, answer: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    }


# --- sft-docstrings -------------------------------------------------------------------------------

DOC_SALT = "sft-docstrings"
DOC_SKIP = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "__pycache__",
    "idlelib",
    "turtledemo",
    "distutils",
    "ensurepip",
    "pydoc_data",
}
_SENTENCE = re.compile(r"(.+?[.!?])(?:\s|$)")


def first_sentence(doc: str) -> str | None:
    """The first sentence of a docstring's first paragraph, whitespace collapsed; None when it is
    not a usable answer (no sentence end, under 20 or over 160 characters, a signature line, an
    ellipsis)."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = _SENTENCE.match(para)
    if not m:
        return None
    s = m.group(1)
    if not 20 <= len(s) <= 160 or re.match(r"^[\w.]+\(", s) or s.endswith("..."):
        return None
    return s


def _module(rel: Path) -> str | None:
    parts = rel.with_suffix("").parts
    if any(p.startswith("_") and p != "__init__" for p in parts):
        return None  # private modules
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)
def docstring_items() -> dict[str, str]:
    """``{"json.dumps": "Serialize ``obj`` to a JSON formatted ``str``.", ...}``: every public
    module-level function and public method of a public class of the standard library's public
    modules (read with ``ast``, nothing imported) whose docstring has a usable
    :func:`first_sentence`. Sorted by name; read once per process (about 2 s), so do not change the
    dict returned."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not DOC_SKIP.intersection(p.relative_to(root).parts)
    )
    out: dict[str, str] = {}
    for path in files:
        module = _module(path.relative_to(root))
        if module is None:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        defs = (ast.FunctionDef, ast.AsyncFunctionDef)
        for node in tree.body:
            found = [(node.name, node)] if isinstance(node, defs) else []
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found = [
                    (f"{node.name}.{sub.name}", sub) for sub in node.body if isinstance(sub, defs)
                ]
            for name, fn in found:
                doc = ast.get_docstring(fn) if not fn.name.startswith("_") else None
                answer = first_sentence(doc) if doc else None
                if answer is not None:
                    out.setdefault(f"{module}.{name}", answer)
    return dict(sorted(out.items()))


def sft_docstrings(split: str = "train", seed: int = 0, n: int | None = None) -> list[dict]:
    """ "What does `json.dumps` do?" -> the first sentence of its docstring ("Serialize ``obj`` to a
    JSON formatted ``str``.").

    Measures: recall of facts seen in training (train) and, on "val", whether the model answers for
    functions it never saw in this form: the held-out loss shows how well it predicts a
    docstring-style summary from the name alone (the pretraining corpus stdlib-docs holds those
    docstrings as prose, so it is also a test of turning pretraining knowledge into an answer).
    Exact match on "val" is near 0 for small models; use the completion loss.

    About 2,800 train and 300 val items on CPython 3.11 (the corpus is the running interpreter's).
    The split is by function name (:func:`in_val`); ``seed`` orders the rows and ``n`` keeps the
    first n of that order (None: all)."""
    _check(split, n)
    items = [
        (name, answer)
        for name, answer in docstring_items().items()
        if in_val(DOC_SALT, name) == (split == "val")
    ]
    random.Random(f"{DOC_SALT}/{split}/{seed}").shuffle(items)
    return [_chat(f"What does `{name}` do?", answer) for name, answer in items[:n]]


# --- sft-arith ------------------------------------------------------------------------------------

ARITH_SALT = "sft-arith"
ARITH_SIZES = {"train": 3000, "val": 300}
ARITH_TASKS = ("add", "reverse", "sort")


def arith_question(rng: random.Random) -> str:
    """One question: "What is 37 + 45?" (0..99 each), "Reverse the list: 3 1 4" or "Sort the list:
    42 7 19" (3 to 5 items: digits to reverse, numbers 0..99 to sort), each task a third of the
    time."""
    task = rng.choice(ARITH_TASKS)
    if task == "add":
        return f"What is {rng.randrange(100)} + {rng.randrange(100)}?"
    items = [rng.randrange(10 if task == "reverse" else 100) for _ in range(rng.randint(3, 5))]
    return f"{'Reverse' if task == 'reverse' else 'Sort'} the list: {' '.join(map(str, items))}"


def arith_answer(question: str) -> str:
    """The exact answer to an :func:`arith_question`: "82", "4 1 3", "7 19 42"."""
    m = re.fullmatch(r"What is (\d+) \+ (\d+)\?", question)
    if m:
        return str(int(m.group(1)) + int(m.group(2)))
    m = re.fullmatch(r"(Reverse|Sort) the list: (\d+(?: \d+)*)", question)
    if not m:
        raise ValueError(f"not an sft-arith question: {question!r}")
    items = [int(v) for v in m.group(2).split()]
    return " ".join(map(str, items[::-1] if m.group(1) == "Reverse" else sorted(items)))


def sft_arith(split: str = "train", seed: int = 0, n: int | None = None) -> list[dict]:
    """Synthetic instructions with exactly checkable answers: addition of two numbers below 100,
    reversing a list of 3-5 digits, sorting 3-5 numbers below 100 (:func:`arith_question`,
    :func:`arith_answer`).

    Measures: whether fine-tuning teaches the format (answer, then EOS) and a little algorithm:
    exact-match accuracy of greedy answers on "val", whose questions never occur in "train" (split
    by question, :func:`in_val`). ``n`` distinct questions (default 3,000 train, 300 val) drawn with
    a generator seeded by (split, seed): the two splits come from different seeds and from disjoint
    halves of the question space."""
    _check(split, n)
    n = ARITH_SIZES[split] if n is None else n
    rng = random.Random(f"{ARITH_SALT}/{split}/{seed}")
    rows, seen = [], set()
    while len(rows) < n:
        q = arith_question(rng)
        if q in seen or in_val(ARITH_SALT, q) != (split == "val"):
            continue
        seen.add(q)
        rows.append(_chat(q, arith_answer(q)))
    return rows


SFT_SOURCES = {"sft-docstrings": sft_docstrings, "sft-arith": sft_arith}
