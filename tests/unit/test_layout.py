"""docs/layout.md names every module with its one job, and cannot drift from the code.

The file is written by scripts/write_layout.py from the modules' docstrings; these tests fail when a
module has no docstring, when a tracked top-level entry has no job, or when the file differs from
what the script writes now (a module added, moved or removed, a docstring edited): each failure says
what to do.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
from helpers import ROOT

_spec = importlib.util.spec_from_file_location("write_layout", ROOT / "scripts" / "write_layout.py")
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)

FILES = [p for folder in ("ssmkit", *layout.SCRIPT_DIRS) for p in layout._py_files(ROOT / folder)]


def test_every_module_has_a_docstring_naming_its_job():
    missing = []
    for path in FILES:
        try:
            layout.module_job(path)
        except layout.LayoutError as e:
            missing.append(str(e))
    assert not missing, "\n".join(missing)


def test_a_module_without_a_docstring_is_an_error_naming_it(tmp_path):
    bare = tmp_path / "bare.py"
    bare.write_text("import os\n")
    with pytest.raises(layout.LayoutError, match=r"bare\.py has no module docstring"):
        layout.module_job(bare)
    documented = tmp_path / "documented.py"
    documented.write_text('"""Does x, for ``y``.\n\nMore about it."""\n')
    assert layout.module_job(documented) == "Does x, for `y`."


@pytest.mark.parametrize(
    "doc, first",
    [
        ("One job. Then more.", "One job."),
        (
            "The mixer (Gu & Dao 2023,\nfigure 3).\n\nSecond paragraph.",
            "The mixer (Gu & Dao 2023, figure 3).",
        ),
        ("Zamba2 (Glorioso et al. 2024): layers. Rest.", "Zamba2 (Glorioso et al. 2024): layers."),
        (
            "Training step vs. sequence length, e.g. 2K. ``x`` is next.",
            "Training step vs. sequence length, e.g. 2K.",
        ),
        ("No full stop at all", "No full stop at all"),
    ],
)
def test_first_sentence(doc, first):
    assert layout.first_sentence(doc) == first


def test_docstring_markup_becomes_markdown():
    assert (
        layout._markdown(
            ":func:`prepare_sft` and :class:`~ssmkit.models.config.ModelConfig`, ``a|b``"
        )
        == "`prepare_sft` and `ModelConfig`, `a\\|b`"
    )


def test_every_tracked_top_level_entry_has_a_job():
    if layout.tracked_top_level() is None:
        pytest.skip("not a git checkout: the tracked entries are unknown")
    assert layout.check_top_level() == []


def test_the_layout_file_is_current():
    written = layout.OUT.read_text(encoding="utf-8") if layout.OUT.exists() else ""
    now = layout.render()
    if written == now:
        return
    rows = set(re.findall(r"^\| `([^`]+)` \|", written, flags=re.M))
    absent = sorted(
        p.relative_to(ROOT).as_posix()
        for p in FILES
        if p.name not in rows and p.name != "__init__.py"
    )
    pytest.fail(
        f"docs/layout.md is out of date: run `{layout.COMMAND}` and commit it"
        + (f"; files it does not list: {', '.join(absent)}" if absent else "")
    )


def test_the_layout_lists_every_module_under_its_folder():
    """The rendered file read back: each folder's section names each of its files (a package's
    __init__.py by its job, the paragraph under the heading)."""
    sections = {}
    for section in re.split(r"^#+ ", layout.render(), flags=re.M)[1:]:
        heading, _, body = section.partition("\n")
        sections[heading.strip()] = body
    for path in FILES:
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "ssmkit":
            body = sections.get(rel.parent.as_posix() + "/", "")
            name = rel.name
        else:
            body = sections.get(rel.parts[0] + "/", "")
            name = rel.relative_to(rel.parts[0]).as_posix()
        if path.name == "__init__.py":
            assert layout.module_job(path) in body, f"{rel}: its package's job is not in the layout"
        else:
            assert f"| `{name}` |" in body, f"{rel} is not in the layout"
