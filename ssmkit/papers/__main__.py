"""``python -m ssmkit.papers [--check]``: write each note's parameters cell from its module's
``PARAMETERS`` and ``papers/README.md`` from the notes' claims (``--check``: change nothing, exit 1
if either differs). ``python -m ssmkit.papers --report RUN``: every claim of a run of the notes as
one table, printed and written to RUN/claims.md."""

import argparse
import sys

from ..io import write_atomically
from ..workbook.chapters import parameters_cell, write_parameters_cell
from . import find_notes, index, note_of, papers_dir, report

parser = argparse.ArgumentParser(prog="python -m ssmkit.papers", description=__doc__)
parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
parser.add_argument("--report", metavar="RUN", help="a run of the notes: its claims as one table")
args = parser.parse_args()
if args.report:
    from pathlib import Path

    from ..workbook.notebooks import WorkbookError

    try:
        table = report(args.report)
    except WorkbookError as exc:
        sys.exit(f"error: {exc}")
    write_atomically(Path(args.report) / "claims.md", table)
    print(table, end="")
    sys.exit(0)
drift = []
for path in find_notes():
    if args.check:
        have, want = parameters_cell(path, note_of(path))
        if have != want:
            drift.append(str(path))
            print(f"differs  {path}")
    else:
        print(f"{'written' if write_parameters_cell(path, note_of(path)) else 'same   '}  {path}")
readme = papers_dir() / "README.md"
text = index()
if readme.is_file() and readme.read_text(encoding="utf-8") == text:
    print(f"same     {readme}")
elif args.check:
    drift.append(str(readme))
    print(f"differs  {readme}")
else:
    write_atomically(readme, text)
    print(f"written  {readme}")
sys.exit(1 if drift else 0)
