"""Companion notes to the papers: ``papers/NN_<name>.ipynb`` read one paper each, with its equations
next to the ssmkit code that computes them and every claim checked; ``pNN_<name>.py`` here holds
what note NN calls, its parameters (declared once, as the workbook's chapters do) and its claims.

    from ssmkit.papers import p04_mamba2 as note        # in papers/04_mamba2.ipynb
    p = note.PARAMETERS.check(globals())
    book = note.claim_book()                            # the note's claims, checked cell by cell

    note_of("papers/04_mamba2.ipynb")                   # the module of a note (by NN)
    python -m ssmkit.papers [--check]                   # write (or check) parameters cells and
                                                        # papers/README.md
    python -m ssmkit.papers --report runs/papers-X      # every claim of a run of the notes, one
                                                        # table (runs/papers-X/claims.md)

Each note module declares ``TITLE`` (the paper), ``ARXIV``, ``QUESTION`` (the question the paper
answers, one sentence), ``CLAIMS`` (:class:`~ssmkit.papers.claims.Claim` records) and
``PARAMETERS``. The modules are imported on first use (they import torch and the models).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from ..io import read_json
from ..workbook.notebooks import PROJECT_ROOT, WorkbookError, read_notebook

__all__ = ["find_notes", "index", "note_names", "note_of", "papers_dir", "report"]

_FOLDER = Path(__file__).resolve().parent


def papers_dir() -> Path:
    """The checkout's ``papers/`` folder (./papers when it exists, for a copy of the checkout)."""
    return Path("papers") if Path("papers").is_dir() else PROJECT_ROOT / "papers"


def note_names() -> list[str]:
    """The note modules of this package, in order: ``["p01_s4", "p02_h3", ...]``."""
    return sorted(p.stem for p in _FOLDER.glob("p[0-9][0-9]_*.py"))


def find_notes(root: str | Path | None = None) -> list[Path]:
    """``papers/NN_*.ipynb`` under ``root`` (default :func:`papers_dir`), sorted."""
    found = sorted(Path(root or papers_dir()).glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise WorkbookError(f"no notes matching NN_*.ipynb in {root or papers_dir()}")
    return found


def note_of(notebook):
    """The module of a note (a path or a name ``NN_...``): the one whose number is its ``NN``."""
    number = re.match(r"(\d\d)_", Path(notebook).name)
    found = [n for n in note_names() if number and n[1:3] == number.group(1)]
    if len(found) != 1:
        raise WorkbookError(
            f"{Path(notebook).name}: no note module ssmkit/papers/pNN_*.py with its number; "
            f"notes: {', '.join(note_names())}"
        )
    return importlib.import_module(f"{__name__}.{found[0]}")


def _kinds(claims) -> str:
    counts = {}
    for c in claims:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in counts.items())


def index(root: str | Path | None = None) -> str:
    """``papers/README.md``: one line per note (the paper, its question, the claims it checks by
    kind, its stated CPU time), from the note modules and the notebooks' metadata."""
    lines = [
        "# papers/: companion notes",
        "",
        "<!-- written by `python -m ssmkit.papers` from each note's module",
        "     (ssmkit/papers/pNN_*.py: TITLE, QUESTION, CLAIMS) and its stated CPU time;",
        "     do not edit by hand -->",
        "",
        "One notebook per paper: its key equations, each followed by the ssmkit code that",
        "computes it and an assertion; its results checked as claims with their provenance",
        "(kinds: identity, ordering, threshold, cited; `ssmkit.papers.claims`); a figure from the",
        "note's own run; and exercises. An identity that fails stops its note; an ordering or",
        "threshold that does not hold on every seed of the note's fixed recipe is reported as",
        '"not reproduced". Run one with `ssmkit workbook run papers/NN_name.ipynb`, all with',
        "`make papers`, which ends with every claim of the run in one table",
        "(`python -m ssmkit.papers --report runs/papers-NAME` writes its claims.md).",
        "",
        "| note | paper | question | claims checked | CPU time |",
        "|---|---|---|---|---|",
    ]
    for path in find_notes(root):
        note = note_of(path)
        meta = (read_notebook(path).get("metadata", {}).get("ssmkit") or {}).get("cpu_seconds")
        cpu = f"~{meta / 60:.1f} min" if meta else "–"
        lines.append(
            f"| [{path.stem}]({path.name}) | {note.TITLE} (arXiv {note.ARXIV}) | {note.QUESTION} "
            f"| {len(note.CLAIMS)}: {_kinds(note.CLAIMS)} | {cpu} |"
        )
    return "\n".join(lines) + "\n"


def report(run_dir: str | Path) -> str:
    """Every claim of a run of the notes (``ssmkit workbook run papers/...`` or ``make papers``) as
    one markdown table: note, claim, kind, the paper's value, ours, verdict; from each note's
    ``claims.json`` under ``run_dir/NN_name/``, followed by the count of each verdict. A note whose
    run left no claims.json (it stopped early) is listed as such."""
    run_dir = Path(run_dir)
    folders = sorted(p for p in run_dir.glob("[0-9][0-9]_*") if p.is_dir())
    if not folders:
        raise WorkbookError(f"{run_dir}: no note folders NN_name/ (a run of papers/*.ipynb?)")
    rows = [
        "| note | claim | kind | paper's value | ours | verdict |",
        "|---|---|---|---|---|---|",
    ]
    verdicts: dict[str, int] = {}
    stopped = 0
    for folder in folders:
        path = folder / "claims.json"
        if not path.is_file():
            rows.append(f"| {folder.name} | – | – | – | – | no claims.json: the run stopped |")
            stopped += 1
            continue
        for rec in read_json(path):
            out = rec.get("outcome") or {}
            verdict = out.get("verdict", "NOT CHECKED")
            verdicts[verdict] = verdicts.get(verdict, 0) + 1
            cells = [
                folder.name,
                f"**{rec['id']}**: {rec['statement']}",
                rec["kind"],
                rec.get("paper_value") or "(in words)",
                out.get("ours", "–"),
                verdict,
            ]
            rows.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    counts = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
    tail = f"; {stopped} note(s) stopped before their claims table" if stopped else ""
    return "\n".join(rows) + f"\n\n{sum(verdicts.values())} claims: {counts}{tail}\n"
