"""Notebooks and parameter files on disk: find the workbook's notebooks, read a ``parameters`` cell,
strip outputs, read a params file and a ``-p`` value.

    find_notebooks()                            # [notebooks/00_setup.ipynb, notebooks/01_...]
    declared_parameters("01_a.ipynb")           # the parameters cell: {"lr": 0.1, ...}
    load_params_file("params/ci.yaml")          # {"device": "cpu", "seed": 0, "max_tokens": 16384}

Values typed on a command line and params files are read with :mod:`ssmkit.checks`' one grammar
(YAML with ``1e3`` a float, ``none`` null, only ``true``/``false`` booleans). Every problem a user
can fix raises :class:`WorkbookError` naming the file.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from ..checks import load_yaml
from ..io import describe_os_error, write_atomically

PROJECT_ROOT = (
    Path(__file__).resolve().parents[2]
)  # a source checkout: notebooks/, configs/, params/

__all__ = [
    "PROJECT_ROOT",
    "WorkbookError",
    "cell_source",
    "declared_parameters",
    "find_notebooks",
    "load_params_file",
    "read_notebook",
    "strip_notebook",
]


class WorkbookError(ValueError):
    """A problem the user can fix: a missing notebook, a bad parameter or params file."""


def find_notebooks(root: str | Path | None = None) -> list[Path]:
    """``notebooks/NN_*.ipynb`` under ``root`` (default: ./notebooks if it exists, else the
    checkout's), sorted."""
    if root is None:
        root = Path("notebooks") if Path("notebooks").is_dir() else PROJECT_ROOT / "notebooks"
    found = sorted(p for p in Path(root).glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise WorkbookError(
            f"no notebooks matching NN_*.ipynb in {root}; pass notebook paths explicitly"
        )
    return found


def read_notebook(path: Path) -> dict:
    """A notebook's JSON (a dict with a list of ``cells``), or :class:`WorkbookError`."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise WorkbookError(f"{path} is not a readable notebook: {exc}") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells", []), list):
        raise WorkbookError(
            f"{path} is not a notebook: expected a JSON object with a list of cells"
        )
    return nb


def cell_source(cell: dict) -> str:
    """A cell's source as one string (nbformat stores a string or a list of lines)."""
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def declared_parameters(path: str | Path) -> dict:
    """Names and default values assigned in the notebook's cell tagged ``parameters`` ({} if
    none)."""
    path = Path(path)
    for cell in read_notebook(path).get("cells", []):
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            try:
                tree = ast.parse(cell_source(cell))
            except SyntaxError as exc:
                raise WorkbookError(
                    f"{path}: the parameters cell is not valid Python: {exc}"
                ) from None
            out = {}
            for node in tree.body:
                if isinstance(node, ast.AnnAssign):
                    node = ast.Assign(targets=[node.target], value=node.value)
                for t in getattr(node, "targets", []):
                    if isinstance(t, ast.Name):
                        try:
                            out[t.id] = ast.literal_eval(node.value)
                        except (ValueError, TypeError, SyntaxError):
                            out[t.id] = ast.unparse(node.value)  # not a plain value: its source
            return out
    return {}


def strip_notebook(path: str | Path) -> bool:
    """Clear outputs, execution counts and what a session adds (papermill's run metadata,
    ipywidgets' state, the kernel's ``language_info`` beyond its name, per-cell execution timings,
    view state: ``collapsed``, ``scrolled``, ``jupyter.{source,outputs}_hidden``, the ``trusted``
    flag, empty ``tags``) in place, and write it as nbformat does (keys sorted, indent 1), so that a
    notebook run and saved in JupyterLab strips back to the committed bytes. True if the file
    changed."""
    path = Path(path)
    nb = read_notebook(path)
    meta = nb.setdefault("metadata", {})
    for key in ("papermill", "widgets"):
        meta.pop(key, None)
    info = meta.get("language_info")
    if (
        isinstance(info, dict) and "name" in info
    ):  # a kernel adds version, mimetype, codemirror_mode...
        meta["language_info"] = {"name": info["name"]}
    for cell in nb.get("cells", []):
        cell_meta = cell.setdefault("metadata", {})
        for key in ("papermill", "execution", "collapsed", "scrolled", "trusted"):
            cell_meta.pop(key, None)
        view = cell_meta.get("jupyter")
        if isinstance(view, dict):
            for key in ("source_hidden", "outputs_hidden"):
                view.pop(key, None)
            if not view:
                del cell_meta["jupyter"]
        if cell_meta.get("tags") == []:
            del cell_meta["tags"]
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    text = json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"
    if path.read_text(encoding="utf-8") == text:
        return False
    write_atomically(path, text)
    return True


def _shown(data) -> str:
    """``data`` for an error message, in at most ~200 characters however large or deeply shared
    it is (``reprlib`` cuts each level before building it; ``f"{data!r:.200}"`` would build the
    whole repr first)."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 3, 4, 4, 40, 40
    return f"a {type(data).__name__}: {short.repr(data)[:200]}"


def load_params_file(path: str | Path) -> dict:
    """A YAML (or JSON) mapping of parameter names to plain values, read by
    :func:`ssmkit.checks.load_yaml`."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise WorkbookError(f"params file {path} does not exist")
    if not path.is_file():
        raise WorkbookError(
            f"params file {path} is not a file; expected a YAML file of parameter names and values"
        )
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise WorkbookError(
            f"params file {path} is not valid YAML: {' '.join(str(exc).split())}"
        ) from None
    except OSError as exc:
        raise WorkbookError(
            f"params file {path} cannot be read: {describe_os_error(exc)}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) and k.isidentifier() for k in data):
        raise WorkbookError(
            f"params file {path} must be a mapping of parameter names to values; got {_shown(data)}"
        )
    return data
