"""``python -m ssmkit.workbook.chapters [--check] [NOTEBOOK ...]``: write each notebook's parameters
cell from its chapter's ``PARAMETERS`` (``--check``: only say which differ, exit 1 if any)."""

import argparse
import sys

from ..notebooks import find_notebooks
from . import parameters_cell, write_parameters_cell

parser = argparse.ArgumentParser(prog="python -m ssmkit.workbook.chapters", description=__doc__)
parser.add_argument("notebooks", nargs="*", help="notebook paths (default: notebooks/NN_*.ipynb)")
parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a cell differs")
args = parser.parse_args()
drift = []
for path in args.notebooks or find_notebooks():
    if args.check:
        have, want = parameters_cell(path)
        if have != want:
            drift.append(str(path))
            print(f"differs  {path}")
    else:
        print(f"{'written' if write_parameters_cell(path) else 'same   '}  {path}")
sys.exit(1 if drift else 0)
