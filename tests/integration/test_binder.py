"""binder/ (mybinder.org's build of this repository), checked offline against the project's venv.

* every line of binder/requirements.txt, and every requirement of the extras postBuild installs, is
  satisfied by a distribution installed here (importlib.metadata + packaging): what Binder builds is
  what the tests ran with;
* every extra whose packages the notebooks and paper notes reach is installed by postBuild: the
  oracle is the import graph read with ``ast`` from the notebooks' code cells through every ssmkit
  module they reach (imports inside functions too), so notebook 02's lm-eval and 04's peft count;
  the few optional paths it also reaches are listed in :data:`NOT_FOR_BINDER` with their reason;
* ipywidgets' JupyterLab extension is present in this venv, as postBuild asserts on Binder;
* the README's Binder badge agrees with the one setting it comes from, pyproject.toml's
  ``[project.urls] Repository``: the badge for that repository when it is a GitHub one, else no
  badge and the line that says how to launch Binder on a fork.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import sys
from pathlib import Path

import pytest
from helpers import ROOT

requirements = pytest.importorskip("packaging.requirements")
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

BINDER = ROOT / "binder"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# extras the import graph reaches on optional paths the notebooks do not take at their defaults
NOT_FOR_BINDER = {
    "cuda": "mamba_ssm / causal_conv1d: CUDA only; Binder is CPU",
    "track": "wandb: experiment tracking, only when a run config asks for it (and online)",
    "dev": "datasets (remote corpora by name, online) and the tests' tools",
}
BADGE = "https://mybinder.org/badge_logo.svg"
LAUNCH = "https://mybinder.org/v2/gh/{repo}/HEAD?urlpath=lab/tree/notebooks/00_setup.ipynb"


def requirement_lines(path: Path) -> list[str]:
    """The requirement lines of a requirements file (comments, blanks and pip options left out)."""
    lines = [line.split(" #")[0].strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "-"))]


def unmet(requirement: str) -> str | None:
    """Why the installed distributions do not satisfy ``requirement`` (None: they do)."""
    req = requirements.Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate():
        return None
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        return f"{requirement}: not installed"
    if not req.specifier.contains(version, prereleases=True):
        return f"{requirement}: {version} installed"
    return None


def postbuild_extras() -> set[str]:
    """The extras postBuild's ``pip install ... -e ".[...]"`` names."""
    found = re.findall(r'-e\s+"?\.\[([a-z,]+)\]', (BINDER / "postBuild").read_text())
    assert len(found) == 1, 'postBuild: one `pip install ... -e ".[extras]"` line expected'
    return set(found[0].split(","))


def test_requirements_and_extras_are_what_the_venv_has():
    extras = PYPROJECT["project"]["optional-dependencies"]
    wanted = requirement_lines(BINDER / "requirements.txt")
    assert {"torch", "jupyterlab", "ipywidgets", "jupyterlab_widgets"} <= {
        requirements.Requirement(r).name for r in wanted
    }
    for extra in sorted(postbuild_extras()):
        assert extra in extras, f"postBuild installs extra {extra!r}, not in pyproject.toml"
        wanted += extras[extra]
    problems = [p for p in map(unmet, wanted) if p]
    assert not problems, "binder/ asks for what this venv does not hold: " + "; ".join(problems)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in (
        (BINDER / "requirements.txt").read_text()
    ), "the CPU torch index"
    python = re.search(r"python=(\d+\.\d+)", (BINDER / "environment.yml").read_text())
    assert python and python[1] == f"{sys.version_info[0]}.{sys.version_info[1]}", (
        "binder/environment.yml's Python is the one the tests run on"
    )


# --- the extras the notebooks reach ---------------------------------------------------------------


def _imports(tree: ast.AST, package: str) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base + [node.module or ""]).strip(".") if node.level else node.module
            names |= {module, *(f"{module}.{a.name}" for a in node.names)}
    return names


def _cells(path: Path) -> ast.Module:
    lines = [
        "" if line.lstrip().startswith(("%", "!")) else line
        for cell in json.loads(path.read_text())["cells"]
        if cell["cell_type"] == "code"
        for line in "".join(cell["source"]).splitlines()
    ]
    return ast.parse("\n".join(lines))


def reached_packages() -> set[str]:
    """Top-level names of the non-ssmkit modules the notebooks and papers import, directly or
    through any ssmkit module they reach."""
    files = {}
    for path in (ROOT / "ssmkit").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    todo = [
        name
        for nb in sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("papers/*.ipynb")])
        for name in _imports(_cells(nb), "")
    ]
    seen, outside = set(), set()
    while todo:
        name = todo.pop()
        if name.split(".")[0] != "ssmkit":
            outside.add(name.split(".")[0])
        elif name in files and name not in seen:
            seen.add(name)
            path = files[name]
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            todo += _imports(ast.parse(path.read_text()), package)
    return outside - set(sys.stdlib_module_names)


def test_every_extra_the_notebooks_reach_is_installed():
    dists = md.packages_distributions()
    reached = {d.lower().replace("_", "-") for m in reached_packages() for d in dists.get(m, [m])}
    extras = PYPROJECT["project"]["optional-dependencies"]
    needed = {
        extra
        for extra, reqs in extras.items()
        for r in reqs
        if requirements.Requirement(r).name.lower().replace("_", "-") in reached
    }
    assert {"workbook", "eval", "finetune"} <= needed, needed  # lm_eval (02), peft (04) reached
    missing = needed - postbuild_extras() - set(NOT_FOR_BINDER)
    assert not missing, (
        f"the notebooks reach extra(s) {sorted(missing)} that binder/postBuild does not install"
    )


def test_the_widget_extension_is_in_the_venv():
    share = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "@jupyter-widgets"
    package = json.loads((share / "jupyterlab-manager" / "package.json").read_text())
    assert package["name"] == "@jupyter-widgets/jupyterlab-manager"
    owned = [str(f) for f in md.files("jupyterlab_widgets") or []]
    assert any(
        f.endswith("labextensions/@jupyter-widgets/jupyterlab-manager/package.json") for f in owned
    ), "the extension comes with the pinned jupyterlab_widgets"
    assert "jupyterlab-manager.*enabled" in (BINDER / "postBuild").read_text()


# --- the README's badge ---------------------------------------------------------------------------


def binder_repository() -> str | None:
    """``owner/name`` of the GitHub repository pyproject.toml names, or None."""
    url = PYPROJECT["project"].get("urls", {}).get("Repository", "")
    match = re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?/?", url)
    return match[1] if match else None


def test_readme_badge_follows_the_repository_setting():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"https://mybinder\.org/v2/gh/[^)\s`]+", readme)
    repo = binder_repository()
    if repo:
        badge = f"[![Binder]({BADGE})]({LAUNCH.format(repo=repo)})"
        assert badge in readme, f"the README's Binder badge should read:\n{badge}"
        assert set(links) == {LAUNCH.format(repo=repo)}, links
    else:
        assert BADGE not in readme, (
            "no [project.urls] Repository in pyproject.toml: no badge (it would be a dead link)"
        )
        assert links == [LAUNCH.format(repo="<you>/<fork>")], (
            "without a repository setting the README says how to launch Binder on a fork"
        )
