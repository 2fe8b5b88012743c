"""One chapter per notebook: ``chNN_<name>.py`` holds what ``notebooks/NN_<name>.ipynb`` calls and
its parameters, declared once (``PARAMETERS``, :class:`~ssmkit.workbook.params.Parameters`). A new
notebook is one new chapter file plus the notebook.

    from ssmkit.workbook.chapters import ch01_prototype as chapter     # in the notebook
    p = chapter.PARAMETERS.check(globals())

    chapter_of("notebooks/01_prototype_130m.ipynb")      # the chapter module of a notebook (by NN)
    python -m ssmkit.workbook.chapters [--check]          # write (or check) every parameters cell

The chapters are imported on first use (they import torch and the trainer).
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

from ..notebooks import WorkbookError, cell_source, read_notebook

__all__ = ["chapter_names", "chapter_of", "parameters_cell", "write_parameters_cell"]

_FOLDER = Path(__file__).resolve().parent


def chapter_names() -> list[str]:
    """The chapter modules of this package, in order: ``["ch00_setup", "ch01_prototype", ...]``."""
    return sorted(p.stem for p in _FOLDER.glob("ch[0-9][0-9]_*.py"))


def chapter_of(notebook):
    """The chapter module of ``notebook`` (a path or a name ``NN_...``): the one whose number is its
    ``NN``. A notebook without a chapter is a :class:`~ssmkit.workbook.notebooks.WorkbookError`."""
    number = re.match(r"(\d\d)_", Path(notebook).name)
    found = [n for n in chapter_names() if number and n[2:4] == number.group(1)]
    if len(found) != 1:
        raise WorkbookError(
            f"{Path(notebook).name}: no chapter module ssmkit/workbook/chapters/chNN_*.py "
            f"with its number; chapters: {', '.join(chapter_names())}"
        )
    return importlib.import_module(f"{__name__}.{found[0]}")


def _parameters_cell(nb: dict, path) -> dict:
    cells = [
        c for c in nb.get("cells", []) if "parameters" in c.get("metadata", {}).get("tags", [])
    ]
    if len(cells) != 1:
        raise WorkbookError(f"{path}: expected one cell tagged 'parameters', found {len(cells)}")
    return cells[0]


def parameters_cell(notebook, chapter=None) -> tuple[str, str]:
    """(the notebook's parameters cell as it is, as its chapter declares it). ``chapter``: the
    module declaring ``PARAMETERS`` (default :func:`chapter_of` the notebook; a paper's note
    passes its own, :func:`ssmkit.papers.note_of`)."""
    path = Path(notebook)
    cell = _parameters_cell(read_notebook(path), path)
    return cell_source(cell), (chapter or chapter_of(path)).PARAMETERS.cell()


def write_parameters_cell(notebook, chapter=None) -> bool:
    """Rewrite the notebook's parameters cell from its chapter's declaration (``chapter`` as in
    :func:`parameters_cell`), keeping the rest of the file (written as nbformat does: keys sorted,
    indent 1). True if it changed."""
    from ...io import write_atomically

    path = Path(notebook)
    nb = read_notebook(path)
    cell = _parameters_cell(nb, path)
    text = (chapter or chapter_of(path)).PARAMETERS.cell()
    if cell_source(cell) == text:
        return False
    cell["source"] = text.splitlines(keepends=True)
    write_atomically(path, json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n")
    return True
