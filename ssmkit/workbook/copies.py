"""Workshop copies of the master notebooks: a student, a solution and an instructor copy from one
master, written with plain JSON (no nbgrader, no grading server).

    build_copy("papers/01_s4.ipynb", "student", "handout/papers/01_s4.ipynb")
    build_copies(["notebooks/01_prototype_130m.ipynb", "papers/01_s4.ipynb"], "solution", "answers")
    # -> answers/notebooks/01_prototype_130m.ipynb, answers/papers/01_s4.ipynb

    ssmkit workbook build --for student|solution|instructor OUT [NOTEBOOK ...]

A master marks an exercise the way nbgrader does. A code cell tagged ``solution`` holds the setup,
then the answer between two marker lines, then its check (:mod:`ssmkit.exercises`; not
an ``assert`` on the answer, which a student copy's ``...`` would crash)::

    a, b = torch.tensor([-1.0]), torch.tensor([1.0])      # setup: kept in every copy
    ### BEGIN SOLUTION
    zoh = (math.exp(-0.5), 1 - math.exp(-0.5))            # the answer
    bilinear = (0.6, 0.4)
    ### END SOLUTION
    check("p01.1", zoh=zoh, bilinear=bilinear)            # the check: kept in every copy

Checks the learner must not see go between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``
(in any cell); a cell tagged ``instructor`` holds notes for the teacher.

========== ====================================================================================
kind       what the copy holds
========== ====================================================================================
student    each answer replaced by a placeholder: ``name = ...  # your turn`` for each name the
           answer assigns (so the cell's ``check(...)`` reports "not done yet" and the copy runs
           on to its end), else (an answer that assigns nothing, e.g. a function's body) one line
           at the marker's indentation that raises ``NotImplementedError("Exercise: your turn -
           ...")``; a markdown answer: a "your turn" sentence; hidden tests and ``instructor``
           cells removed; outputs and execution counts cleared; the ``solution`` tag becomes
           ``exercise``
solution   the student copy with the answers in place of the "your turn" lines (markers removed)
instructor the master as it is, markers and notes included
========== ====================================================================================

Each copy records its kind in its metadata (``metadata.ssmkit.copy``), so a copy is never taken for
a master and :func:`build_copy` replaces only a file that holds one.

A master is refused (:class:`~ssmkit.workbook.notebooks.WorkbookError` naming the notebook, the
cell index and what is wrong; nothing written) when a marker line is unbalanced or nested, a line
mentions a marker but is not exactly one (``# BEGIN SOLUTION``: an answer could leak), a cell holds
SOLUTION markers but is not tagged ``solution``, a cell tagged ``solution`` holds no marked answer,
or the notebook is itself a copy. :func:`build_copies` writes each file atomically into ``OUT``,
records what it wrote in ``OUT/.ssmkit-copies.json`` (:data:`RECORD`: the kind and the names), and
refuses (touching nothing) an ``OUT`` that overlaps a master's folder, a file in ``OUT`` it did not
write, and an ``OUT`` that holds a build of another kind (a solution copy never lands on a
student handout).
"""

from __future__ import annotations

import ast
import json
import os
import textwrap
from pathlib import Path

from ..io import DirLock, overlapping, read_json, write_atomically
from .notebooks import WorkbookError, cell_source, read_notebook

__all__ = [
    "KINDS",
    "MARKERS",
    "RECORD",
    "YOUR_TURN",
    "build_copies",
    "build_copy",
    "copy_notebook",
    "default_masters",
]

KINDS = ("student", "solution", "instructor")
# region name -> (its begin line, its end line), as nbgrader writes them
MARKERS = {
    "solution": ("### BEGIN SOLUTION", "### END SOLUTION"),
    "hidden tests": ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"),
}
# what a student copy holds in place of an answer (code cells, then markdown cells)
YOUR_TURN = 'raise NotImplementedError("Exercise: your turn - replace this line with your answer")'
YOUR_TURN_TEXT = "_Exercise: your turn - write your answer here._"
PLACEHOLDER = "{name} = ...  # Exercise: your turn - replace ... with your answer"
SOLUTION_TAG, INSTRUCTOR_TAG, EXERCISE_TAG = "solution", "instructor", "exercise"
COPY_KEY = "copy"  # a copy's metadata.ssmkit.copy: its kind (a master has none)
RECORD = ".ssmkit-copies.json"  # in OUT: {"kind": "student", "written": ["papers/01_s4.ipynb"]}
# a line that mentions one of these words but is not exactly a marker is refused
_MARKER_LINES = [line for pair in MARKERS.values() for line in pair]
_MARKER_WORDS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")


def default_masters() -> list[Path]:
    """The masters ``ssmkit workbook build`` and ``ssmkit workbook strip`` take without NOTEBOOKs:
    ``notebooks/*.ipynb`` and ``papers/*.ipynb`` under the working directory."""
    return [p for d in ("notebooks", "papers") for p in sorted(Path(d).glob("*.ipynb"))]


def _regions(lines: list[str], where: str) -> list[tuple[str, int, int]]:
    """The marked regions of a cell's ``lines``: ``(name, begin line, end line)`` indices of the
    marker lines, in order; :class:`WorkbookError` (``where`` names the cell) for a marker that is
    unbalanced, nested or misspelled."""
    found, open_ = [], None  # open_: (name, begin index) of the region being read
    for i, line in enumerate(lines):
        text = line.strip()
        for name, (begin, end) in MARKERS.items():
            if text == begin:
                if open_:
                    raise WorkbookError(
                        f"{where}: line {i + 1} '{begin}' inside the {open_[0]} region begun on "
                        f"line {open_[1] + 1}: markers may not nest; close it with "
                        f"'{MARKERS[open_[0]][1]}' first"
                    )
                open_ = (name, i)
                break
            if text == end:
                if not open_ or open_[0] != name:
                    inside = f" (inside the {open_[0]} region)" if open_ else ""
                    raise WorkbookError(
                        f"{where}: line {i + 1} '{end}' has no '{begin}' before it{inside}"
                    )
                found.append((name, open_[1], i))
                open_ = None
                break
        else:
            if any(word in line for word in _MARKER_WORDS):
                raise WorkbookError(
                    f"{where}: line {i + 1} mentions a marker but is not one ({text[:60]!r}); "
                    f"a marker line is exactly one of {', '.join(_MARKER_LINES)}"
                )
    if open_:
        raise WorkbookError(
            f"{where}: '{MARKERS[open_[0]][0]}' on line {open_[1] + 1} is never closed by "
            f"'{MARKERS[open_[0]][1]}'"
        )
    return found


def _assigned(lines: list[str]) -> list[str]:
    """The names an answer's ``lines`` assign at their own top level (``zoh = ...``, ``a, b = ...``,
    ``def f``, ``for i in``), in order; empty when they assign none or are not a whole block of
    Python (an answer that is part of a statement)."""
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return []
    names: list[str] = []
    for node in tree.body:
        targets = {
            ast.Assign: lambda n: n.targets,
            ast.AnnAssign: lambda n: [n.target],
            ast.AugAssign: lambda n: [n.target],
            ast.For: lambda n: [n.target],
        }.get(type(node), lambda n: [])(node)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name) and leaf.id not in names:
                    names.append(leaf.id)
    return names


def _placeholder(answer: list[str], indent: str, cell_type: str) -> list[str]:
    """What a student copy holds in place of ``answer`` (see the module docstring)."""
    if cell_type != "code":
        return [f"{indent}{YOUR_TURN_TEXT}\n"]
    names = _assigned(answer) if not indent else []
    if names:
        return [f"{indent}{PLACEHOLDER.format(name=name)}\n" for name in names]
    return [f"{indent}{YOUR_TURN}\n"]


def _rewrite(lines: list[str], regions, kind: str, cell_type: str) -> list[str]:
    """The lines of one cell in copy ``kind``: each region kept, replaced or removed."""
    if kind == "instructor":
        return lines
    out, start = [], 0
    for name, begin, end in regions:
        out += lines[start:begin]
        if name == "solution":
            if kind == "solution":
                out += lines[begin + 1 : end]
            else:
                marker = lines[begin]
                indent = marker[: len(marker) - len(marker.lstrip())]
                out += _placeholder(lines[begin + 1 : end], indent, cell_type)
        start = end + 1  # hidden tests: dropped from both copies
    out += lines[start:]
    if out and out[-1].endswith("\n"):  # nbformat stores no newline after a cell's last line
        out[-1] = out[-1][:-1]
    return out


def _stamp(nb: dict) -> str | None:
    """The kind a copy records in its metadata (``metadata.ssmkit.copy``); None for a master."""
    meta = nb.get("metadata")
    ssmkit = meta.get("ssmkit") if isinstance(meta, dict) else None
    return ssmkit.get(COPY_KEY) if isinstance(ssmkit, dict) else None


def copy_notebook(nb: dict, kind: str, name: str = "notebook") -> dict:
    """The copy ``kind`` (one of :data:`KINDS`) of master notebook ``nb`` (its JSON: a dict with a
    list of ``cells``, each a dict whose ``source`` is a string or a list of lines), as a new dict;
    ``name`` names the master in errors. Every cell is checked (see the module docstring) before
    anything is copied."""
    if kind not in KINDS:
        raise WorkbookError(f"unknown copy kind {kind!r}; choose one of {', '.join(KINDS)}")
    stamp = _stamp(nb)
    if stamp:
        raise WorkbookError(
            f"{name} is a {stamp} copy, not a master: build from the masters in notebooks/ "
            "or papers/"
        )
    nb = json.loads(json.dumps(nb))  # a deep copy: the master's dict is left as it is
    cells = []
    for index, cell in enumerate(nb.get("cells", [])):
        where = f"{name} cell {index}"
        meta = cell.setdefault("metadata", {})
        tags = list(meta.get("tags", []))
        lines = cell_source(cell).splitlines(keepends=True)
        regions = _regions(lines, where)
        answers = sum(1 for r in regions if r[0] == "solution")
        if answers and SOLUTION_TAG not in tags:
            raise WorkbookError(
                f"{where} holds '{MARKERS['solution'][0]}' but is not tagged '{SOLUTION_TAG}': "
                "tag it, or remove the markers"
            )
        if SOLUTION_TAG in tags and not answers:
            raise WorkbookError(
                f"{where} is tagged '{SOLUTION_TAG}' but marks no answer: put the answer between "
                f"'{MARKERS['solution'][0]}' and '{MARKERS['solution'][1]}' lines, or it would "
                "leak into the student copy"
            )
        if kind == "instructor":
            cells.append(cell)
            continue
        if INSTRUCTOR_TAG in tags:
            continue
        if regions:
            cell["source"] = _rewrite(lines, regions, kind, cell.get("cell_type", "code"))
        if SOLUTION_TAG in tags:
            meta["tags"] = [EXERCISE_TAG if t == SOLUTION_TAG else t for t in tags]
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
        cells.append(cell)
    nb["cells"] = cells
    nb.setdefault("metadata", {}).setdefault("ssmkit", {})[COPY_KEY] = kind
    return nb


def _as_text(nb: dict) -> str:
    """A notebook's JSON as nbformat writes it (keys sorted, indent 1, a final newline)."""
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def build_copy(master_path: str | os.PathLike, kind: str, out_path: str | os.PathLike) -> Path:
    """Write the copy ``kind`` of one master to ``out_path`` (atomically; its folder is made) and
    return ``out_path``. Refuses (:class:`WorkbookError`, nothing written) a master that fails the
    checks and an ``out_path`` that is the master itself. For a whole folder, with the record that
    keeps a build from replacing files it did not write, use :func:`build_copies`."""
    master, out_path = Path(master_path), Path(out_path)
    text = _as_text(copy_notebook(read_notebook(master), kind, str(master)))
    folder = master.resolve().parent
    if out_path.resolve() == master.resolve() or folder in out_path.resolve().parents:
        raise WorkbookError(
            f"{out_path} lies in the master folder {master.parent}: a copy could replace a master; "
            "write it somewhere else"
        )
    if os.path.lexists(out_path):
        try:
            ours = not out_path.is_symlink() and _stamp(read_notebook(out_path)) is not None
        except WorkbookError:
            ours = False
        if not ours:
            raise WorkbookError(
                f"{out_path} exists and is not a copy `ssmkit workbook build` wrote: refusing to "
                "replace it; move it or choose another path"
            )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(out_path, text)


def _target_name(master: Path, root: Path) -> str:
    """Where a master's copy goes under OUT: its path relative to ``root`` (``papers/01_s4.ipynb``),
    or its file name for a master outside ``root``."""
    try:
        return master.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return master.name


def _recorded(out: Path) -> tuple[str | None, set[str]]:
    """(the kind, the names) a previous build recorded in ``out``; (None, empty) if none."""
    path = out / RECORD
    if not path.exists():
        return None, set()
    try:
        record = read_json(path, "build record")
        kind, names = record.get("kind"), record.get("written")
    except (ValueError, AttributeError):
        kind, names = None, None
    if (
        kind not in KINDS
        or not isinstance(names, list)
        or not all(isinstance(n, str) for n in names)
    ):
        raise WorkbookError(
            f"build record {path} is not readable: move {out} aside or choose another OUT"
        )
    return kind, set(names)


def build_copies(
    masters: list[str | os.PathLike] | None,
    kind: str,
    out: str | os.PathLike,
    root: str | os.PathLike | None = None,
) -> list[Path]:
    """Write the copy ``kind`` of each master (default: :func:`default_masters`) under ``out``, at
    its path relative to ``root`` (default: the working directory; a master outside it: its file
    name), e.g. ``out/papers/01_s4.ipynb``; returns the written paths, in the masters' order.

    Every master is read and checked, and ``out`` too, before the first file is written: a refusal
    (:class:`WorkbookError`) touches nothing. ``out`` is refused when it is a file, overlaps a
    master's folder (it is, holds or lies inside ``notebooks/``), holds a build of another kind, or
    holds a file of a name the build writes that no build recorded in :data:`RECORD`; files of a
    previous build of the same kind are replaced, other files are left alone."""
    out = Path(out)
    root = Path.cwd() if root is None else Path(root)
    masters = [Path(m) for m in (masters if masters is not None else default_masters())]
    if not masters:
        raise WorkbookError("no notebooks to build: pass notebook paths, or run in a checkout")
    texts, names = {}, []
    for master in masters:
        if not master.is_file():
            raise WorkbookError(f"notebook {master} does not exist")
        if overlapping(out, master.parent):
            raise WorkbookError(
                f"OUT {out} overlaps the master folder {master.parent}: a copy could replace a "
                "master; choose a folder outside it"
            )
        name = _target_name(master, root)
        if name in texts:
            raise WorkbookError(f"two masters would be written to {out / name}; build them apart")
        texts[name] = _as_text(copy_notebook(read_notebook(master), kind, str(master)))
        names.append(name)
    if out.exists() and not out.is_dir():
        raise WorkbookError(f"OUT {out} is a file; expected a directory for the copies")
    out.mkdir(parents=True, exist_ok=True)
    with DirLock(out, "workbook build"):
        previous, ours = _recorded(out)
        present = [n for n in names if os.path.lexists(out / n)]
        if previous and previous != kind:
            raise WorkbookError(
                f"OUT {out} holds a {previous} build: refusing to write {kind} copies into it; "
                "choose another OUT"
            )
        for n in present:
            if n not in ours or (out / n).is_symlink() or not (out / n).is_file():
                raise WorkbookError(
                    f"{out / n} exists and was not written by `ssmkit workbook build` (not in "
                    f"{RECORD}): refusing to replace it; move it or choose another OUT"
                )
        write_atomically(
            out / RECORD,
            json.dumps({"kind": kind, "written": sorted(ours | set(names))}, indent=2) + "\n",
        )
        written = []
        for n in names:
            (out / n).parent.mkdir(parents=True, exist_ok=True)
            written.append(write_atomically(out / n, texts[n]))
    return written
