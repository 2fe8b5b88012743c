"""`make strip` after a JupyterLab session gives back the committed notebook, byte for byte.

JupyterLab saves through jupyter_server's contents manager (used here as is, the same class
`make lab` runs); what the browser side adds before it saves is applied by hand, as JupyterLab 4
writes it: outputs and execution counts, per-cell ``execution`` timings (the "record timing"
setting), ``scrolled`` / ``collapsed`` / ``jupyter.{source,outputs}_hidden`` view state, the
``trusted`` flag of each cell, the kernel's full ``language_info`` (version, lexer, codemirror mode)
and the ``widgets`` state of ipywidgets (tqdm's bars). Another editor's formatting (indent 2, keys
in its own order) strips to the same bytes too.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("jupyter_server")
from helpers import ROOT
from jupyter_server.services.contents.filemanager import FileContentsManager  # noqa: E402

from ssmkit import cli  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "papers").glob("*.ipynb"))
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
    "version": "3.12.3",
}
WIDGETS = {
    "application/vnd.jupyter.widget-state+json": {
        "state": {
            "a1b2": {
                "model_module": "@jupyter-widgets/controls",
                "model_name": "FloatProgressModel",
                "model_module_version": "2.0.0",
                "state": {"value": 120, "max": 120},
            }
        },
        "version_major": 2,
        "version_minor": 0,
    }
}


def a_session_in_jupyterlab(nb: dict) -> None:
    """What JupyterLab's notebook model holds after running every cell, collapsing and scrolling
    some."""
    nb["metadata"]["language_info"] = dict(LANGUAGE_INFO)
    nb["metadata"]["widgets"] = WIDGETS
    for i, cell in enumerate(nb["cells"]):
        cell["metadata"]["trusted"] = True
        if cell["cell_type"] != "code":
            continue
        cell["execution_count"] = i
        cell["outputs"] = [
            {"output_type": "stream", "name": "stdout", "text": f"cell {i}\n"},
            {
                "output_type": "display_data",
                "metadata": {},
                "data": {"text/plain": ["<Figure>"], "image/png": "iVBORw0KGgo="},
            },
        ]
        cell["metadata"]["execution"] = {
            "iopub.execute_input": "2026-12-01T10:00:00.100Z",
            "iopub.status.busy": "2026-12-01T10:00:00.090Z",
            "iopub.status.idle": "2026-12-01T10:00:01.200Z",
            "shell.execute_reply": "2026-12-01T10:00:01.190Z",
        }
        if i % 2:
            cell["metadata"].update(
                scrolled=True,
                collapsed=False,
                jupyter={"outputs_hidden": False, "source_hidden": False},
            )
        else:
            cell["metadata"].update(collapsed=True, jupyter={"outputs_hidden": True})


def make_strip(path: Path, capsys) -> None:
    """The `make strip` command (its recipe is checked below), on one notebook."""
    cli.main(["workbook", "strip", str(path)])
    capsys.readouterr()


def test_make_strip_runs_workbook_strip():
    recipe = re.search(r"^strip:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(
        1
    )
    assert recipe.endswith("-m ssmkit.cli workbook strip"), recipe


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_strip_undoes_a_jupyterlab_save(path, tmp_path, capsys):
    shutil.copy(path, tmp_path / path.name)
    contents = FileContentsManager(root_dir=str(tmp_path))
    nb = contents.get(path.name)["content"]  # what JupyterLab loads ...
    a_session_in_jupyterlab(nb)
    contents.save({"type": "notebook", "format": "json", "content": nb}, path.name)  # ... and saves
    saved = (tmp_path / path.name).read_bytes()
    assert (
        saved != path.read_bytes() and b'"outputs_hidden"' in saved and b'"pygments_lexer"' in saved
    )
    make_strip(tmp_path / path.name, capsys)
    assert (tmp_path / path.name).read_bytes() == path.read_bytes()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_strip_writes_what_nbformat_writes(path, tmp_path, capsys):
    nb = json.loads(path.read_text(encoding="utf-8"))
    a_session_in_jupyterlab(nb)
    other = tmp_path / path.name  # another editor: indent 2, its own key order
    other.write_text(json.dumps(dict(reversed(list(nb.items()))), indent=2), encoding="utf-8")
    make_strip(other, capsys)
    assert other.read_bytes() == path.read_bytes()
    make_strip(other, capsys)  # and a clean notebook stays as it is
    assert other.read_bytes() == path.read_bytes()
