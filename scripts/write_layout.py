"""Write docs/layout.md: every module of ssmkit/ (and of benchmarks/, scripts/) with its one job.

A module's job is the first sentence of its docstring, so the layout is written by the code and
cannot drift from it: tests/unit/test_layout.py fails when a module has no docstring or when
docs/layout.md differs from what this script writes. Packages are listed low layer first, in the
order of the layer table of tests/unit/test_layers.py (the one place that ranks them); the top-level
entries of the checkout have their job in TOP below, and the test fails when git tracks one that TOP
does not name.

    python scripts/write_layout.py            # (re)write docs/layout.md
    python scripts/write_layout.py --check    # exit 1, saying why, when docs/layout.md is stale
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "layout.md"
COMMAND = "python scripts/write_layout.py"
LAYERS_FILE = ROOT / "tests" / "unit" / "test_layers.py"
SCRIPT_DIRS = ("benchmarks", "scripts")  # their .py files are listed like the package's modules

# The checkout's top-level entries (as git tracks them) and their one job. A folder ends with "/".
TOP = {
    "README.md": "the front door: what ssmkit is, the two commands, the notebooks, "
    "the reading order",
    "docs/": "reference: data, models, hub formats, training, evaluation, fine-tuning, speed, GPU "
    "nodes, safety, the workbook's runner, and this layout",
    "pyproject.toml": "the package `ssmkit`, its extras (cuda, dev, workbook, eval, finetune, "
    "track), pytest and ruff settings",
    "Makefile": "`make run`, `make test` and the other targets; each sets up the venv it needs",
    "environment.yml": "the conda environment for GPU nodes (CUDA torch, the kernels' build needs)",
    ".ci/": "`.ci/run`: what CI runs (`make test`)",
    "binder/": "mybinder.org's CPU environment and postBuild: JupyterLab on the notebooks",
    "configs/": "training run configs in YAML (`ssmkit train --config`): CPU-sized and the plan's "
    "GPU recipes",
    "params/": "papermill parameter files for the notebooks (`-f params/NAME.yaml`)",
    "notebooks/": "the workbook: one notebook per stage of the plan (listed below)",
    "papers/": "companion notes, one notebook per paper",
    "ssmkit/": "the library (listed below, module by module)",
    "benchmarks/": "ssmkit timed against its peers in one process, printed as ratios "
    "(listed below)",
    "scripts/": "the GPU check, Slurm examples, and this file's generator (listed below)",
    "tests/": "tests laid out like the code: `tests/unit/<layer>/` and `tests/integration/`",
}
NOT_LISTED = {".gitignore"}


class LayoutError(Exception):
    """What the layout cannot be written from (a module without a docstring, an unknown entry)."""


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _markdown(text: str) -> str:
    """reST roles and double backticks made plain markdown code; table pipes escaped."""
    text = re.sub(
        r":(?:func|class|mod|meth|attr|data|exc|obj):`~?([^`]+)`",
        lambda m: f"`{m.group(1).split('.')[-1] if m.group(0).count('~') else m.group(1)}`",
        text,
    )
    return text.replace("``", "`").replace("|", "\\|")


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    # a sentence ends at . ! ? followed by a capital, a code span or a role; "et al. 2024" does not
    return re.split(r"(?<=[.!?])\s+(?=[A-Z`:*(\"])", paragraph, maxsplit=1)[0]


def module_job(path: Path) -> str:
    """The job of the module at ``path``: its docstring's first sentence (LayoutError without
    one)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    if not doc or not doc.strip():
        raise LayoutError(
            f"{_rel(path)} has no module docstring: add one whose first "
            "sentence names the module's one job"
        )
    return _markdown(first_sentence(doc))


def _py_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def layer_ranks() -> dict[str, int]:
    """The ``LAYERS`` table of tests/unit/test_layers.py: first part of a module path -> rank."""
    tree = ast.parse(LAYERS_FILE.read_text(encoding="utf-8"))
    for node in tree.body:
        targets = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        if "LAYERS" in targets or getattr(getattr(node, "target", None), "id", None) == "LAYERS":
            return ast.literal_eval(node.value)
    raise LayoutError(
        f"{LAYERS_FILE.relative_to(ROOT)} holds no LAYERS table: the layout orders packages by it"
    )


def tracked_top_level() -> set[str] | None:
    """The checkout's top-level entries as git tracks them ("name/" for a folder); None without
    git."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return {p.split("/")[0] + "/" if "/" in p else p for p in out.stdout.splitlines()} - NOT_LISTED


def _table(header: str, rows: list[tuple[str, str]]) -> list[str]:
    return [
        f"| {header} | job |",
        "|---|---|",
        *(f"| `{name}` | {job} |" for name, job in rows),
        "",
    ]


def _notebook_title(path: Path) -> str:
    """A notebook's first markdown heading, without its '#'s."""
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return _markdown(line.lstrip("#").strip())
    raise LayoutError(
        f"{_rel(path)} has no markdown heading: its first markdown cell "
        "should start with '# NN · Title'"
    )


def render() -> str:
    """The text of docs/layout.md for the checkout as it is now."""
    ranks = layer_ranks()
    package = ROOT / "ssmkit"
    folders: dict[Path, list[Path]] = {}
    for path in _py_files(package):
        folders.setdefault(path.parent, []).append(path)

    def rank(folder: Path) -> tuple:
        parts = folder.relative_to(package).parts
        if not parts:
            return (-1, "")  # ssmkit/ itself (its own files) first
        if parts[0] not in ranks:
            raise LayoutError(
                f"ssmkit/{parts[0]}/ is not in the LAYERS table of "
                f"{LAYERS_FILE.relative_to(ROOT)}: give it a layer there"
            )
        return (ranks[parts[0]], "/".join(parts))

    order = " < ".join(
        ", ".join(f"`{n}`" for n, r in ranks.items() if r == k) for k in sorted(set(ranks.values()))
    )
    lines = [
        "# Layout",
        "",
        f"<!-- written by `{COMMAND}` from the modules' docstrings: edit a docstring (or TOP",
        "     in the script) and run it again; tests/unit/test_layout.py fails "
        "when this file is stale -->",
        "",
        textwrap.fill(
            "Every file of the library with its one job: the first sentence of its docstring. "
            "Layers, low to high; a module imports only its own layer and lower ones "
            f"(`tests/unit/test_layers.py` checks it): {order}.",
            width=100,
            break_long_words=False,
            break_on_hyphens=False,
        ),
        "",
        "## The checkout",
        "",
        *_table(
            "entry",
            [(name, job) for name, job in TOP.items() if (ROOT / name.rstrip("/")).exists()],
        ),
    ]
    for name in ("notebooks", "papers"):
        if (ROOT / name).is_dir():
            lines += [
                f"## {name}/",
                "",
                *_table(
                    "notebook",
                    [(p.name, _notebook_title(p)) for p in sorted((ROOT / name).glob("*.ipynb"))],
                ),
            ]
    lines += ["## ssmkit/", ""]
    for folder in sorted(folders, key=rank):
        rel = folder.relative_to(ROOT).as_posix() + "/"
        init = folder / "__init__.py"
        lines += [f"### {rel}", ""]
        if init.exists():
            lines += [module_job(init), ""]
        lines += [
            *_table(
                "module",
                [(p.name, module_job(p)) for p in folders[folder] if p.name != "__init__.py"],
            )
        ]
    for name in SCRIPT_DIRS:
        files = _py_files(ROOT / name)
        if files:
            lines += [
                f"## {name}/",
                "",
                *_table(
                    "file", [(p.relative_to(ROOT / name).as_posix(), module_job(p)) for p in files]
                ),
            ]
    return "\n".join(lines).rstrip("\n") + "\n"


def check_top_level() -> list[str]:
    """What is wrong with TOP: tracked entries it does not name (empty when none, or without
    git)."""
    tracked = tracked_top_level()
    if tracked is None:
        return []
    return [
        f"{name} is tracked by git but has no job in TOP (scripts/write_layout.py)"
        for name in sorted(tracked - set(TOP))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="only check that docs/layout.md is current"
    )
    args = parser.parse_args(argv)
    try:
        text = render()
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    problems = check_top_level()
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(
                f"error: {OUT.relative_to(ROOT)} is out of date: run `{COMMAND}`", file=sys.stderr
            )
            return 1
        return 1 if problems else 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
