"""``python -m ssmkit.papers [--check]``: write each note's parameters cell from its module's
``PARAMETERS`` and ``papers/README.md`` from the notes' claims (``--check``: change nothing, exit 1
if either differs)."""

import argparse
import sys

from ..io import write_atomically
from ..workbook.chapters import parameters_cell, write_parameters_cell
from . import find_notes, index, note_of, papers_dir

parser = argparse.ArgumentParser(prog="python -m ssmkit.papers", description=__doc__)
parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
args = parser.parse_args()
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
