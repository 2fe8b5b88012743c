"""Every code block of README.md and of docs/*.md runs as a reader would run it: offline, on a CPU.

A block is ```python, ```bash or ```text (not code; any other language is an error). Markers on the
lines right above a block say what it needs (a skip's reason is required):

    <!-- readme-test: skip: REASON -->                   the whole block is not run
    <!-- readme-test: skip "COMMAND PREFIX": REASON -->  (bash) the lines starting with that prefix
    <!-- readme-test: uses runs/cpu-tiny -->             the block reads a trained run at that path

Everything else must run and succeed:

* python blocks run in order in one interpreter per file: the snippets of a page chain as a reader
  would chain them; a traceback names the file and line.
* bash blocks run line by line with ``bash -c`` (comments are bash's), this interpreter's ``bin``
  first on PATH (``ssmkit``, ``python``, ``papermill`` are this venv's).

Each file runs in a fresh directory of its own holding copies of configs/, notebooks/ and params/ (a
fresh clone, minus the code, which is installed), with HF_HUB_OFFLINE=1 and MPLBACKEND=Agg; one
SSMKIT_CACHE serves the whole session, as one reader's machine has one cache. A trained run that
several pages use (USES) is trained once per session and linked into each page's directory that asks
for it. To keep the time small the test substitutes small sizes in a few commands; each substitution
is listed in SMALL with the reason, and the test fails when its text is no longer in its file, so an
edited page cannot slip past it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV = Path(sys.prefix)
FENCE = re.compile(r"```(\w*)\s*")
MARKER = re.compile(
    r'<!--\s*readme-test:\s*(?:skip(?:\s+"([^"]+)")?:\s*(\S.*?)|uses\s+(\S+))\s*-->'
)
LANGUAGES = ("python", "bash", "text")
LINK = re.compile(r"\]\(([^)\s]+)\)")

# cpu-tiny's steps cut from 16 windows of 256 tokens to 2, one validation batch instead of 8, and
# the byte tokenizer (GPT-2's 50K-row LM head is most of a CPU step, and its tokenization of the
# corpus most of a first run): what a command shows is the same, in seconds instead of minutes
TINY = "--set batch_tokens=512 --set micro_batch=2 --set eval_batches=1 --set tokenizer=byte"

# What a `uses PATH` marker may name: the command that makes it, run once per session in a fresh
# clone
USES = {
    "runs/cpu-tiny": f"ssmkit train --config configs/cpu-tiny.yaml --set max_steps=2 {TINY}",
}

# (page, its text, what the test runs instead, why): plain text replacements inside a block
SMALL = [
    (
        "README.md",
        "make run ",
        f"make -n -C {ROOT} -o {VENV}/.ssmkit-installed run VENV={VENV} PARAMS=params/ci.yaml ",
        "make's dry run: the target and its command, not the 15 minutes of notebooks it starts "
        "(tests/integration/test_notebooks.py runs each notebook through the same runner with "
        "params/ci.yaml); -C: the checkout's Makefile, as the README's reader has it",
    ),
    (
        "docs/training.md",
        "ssmkit train --config configs/cpu-tiny.yaml               #",
        f"ssmkit train --config configs/cpu-tiny.yaml --set max_steps=2 {TINY} #",
        "2 small steps (TINY) instead of 120",
    ),
    (
        "docs/training.md",
        "ssmkit train --config configs/cpu-tiny.yaml --set max_steps=240 --resume",
        f"ssmkit train --config configs/cpu-tiny.yaml --set max_steps=4 {TINY} --resume",
        "resumes the 2-step run above and stops at step 4",
    ),
    (
        "docs/training.md",
        'overrides=["max_steps=50", "out_dir=runs/try"]',
        'overrides=["max_steps=2", "batch_tokens=512", "micro_batch=2", "eval_batches=1", '
        '"tokenizer=byte", '
        '"out_dir=runs/try"]',
        "2 small steps (TINY) instead of 50",
    ),
    (
        "docs/training.md",
        'overrides=["max_steps=60", "out_dir=runs/try"]',
        'overrides=["max_steps=4", "batch_tokens=512", "micro_batch=2", "eval_batches=1", '
        '"tokenizer=byte", '
        '"out_dir=runs/try"]',
        "resumes the 2-step run above and stops at step 4 instead of 60",
    ),
    (
        "docs/finetune.md",
        "ssmkit train --config configs/cpu-tiny-lora.yaml          #",
        f"ssmkit train --config configs/cpu-tiny-lora.yaml --set max_steps=2 {TINY} #",
        "2 small LoRA steps (TINY) instead of 60, on the 2-step runs/cpu-tiny of USES",
    ),
    (
        "docs/eval.md",
        "--tasks ssmkit_docstring_cloze,ssmkit_lastword --out",
        "--tasks ssmkit_docstring_cloze,ssmkit_lastword --limit 8 --out",
        "8 items per task instead of 268 and 207",
    ),
]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@dataclass
class Block:
    page: str  # "README.md", "docs/data.md"
    section: str
    lang: str
    line: int  # the page's line of the block's first code line
    code: str
    skip: str | None = None  # the reason the whole block is not run
    skip_lines: dict[str, str] = field(default_factory=dict)  # command prefix -> reason
    uses: list[str] = field(default_factory=list)  # USES paths it reads


def parse(text: str, page: str = "README.md") -> list[Block]:
    """The fenced blocks of ``text`` with their section and the markers right above them."""
    lines, blocks, section, i = text.splitlines(), [], "(top)", 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        fence = FENCE.fullmatch(lines[i])
        if not fence:
            i += 1
            continue
        end = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("```")), None)
        assert end is not None, f"{page}:{i + 1}: a code block that is never closed"
        block = Block(page, section, fence.group(1), i + 2, "\n".join(lines[i + 1 : end]))
        j = i - 1
        while j >= 0 and "readme-test" in lines[j]:
            marker = MARKER.fullmatch(lines[j].strip())
            assert marker, (
                f"{page}:{j + 1}: malformed marker {lines[j]!r}; expected {MARKER.pattern}"
            )
            prefix, reason, uses = marker.groups()
            if uses is not None:
                block.uses.append(uses)
            elif prefix is None:
                block.skip = reason
            else:
                block.skip_lines[prefix] = reason
            j -= 1
        blocks.append(block)
        i = end + 1
    return blocks


BLOCKS = {_name(p): parse(p.read_text(encoding="utf-8"), _name(p)) for p in PAGES}


def small(page: str, text: str) -> str:
    for where, old, new, _ in SMALL:
        if where == page:
            text = text.replace(old, new)
    return text


def units() -> list:
    """What runs, page by page: a page's runnable blocks are one test, run in order in the page's
    workspace (its python blocks together, placed at the first of them; each bash block on its own),
    so that a block finds what an earlier block of its page wrote whichever test worker runs it.
    Each skipped block is a test of its own that says why."""
    out = []
    for page, blocks in BLOCKS.items():
        python = [b for b in blocks if b.lang == "python" and b.skip is None]
        steps = []
        for b in blocks:
            if b.lang == "text":  # not code (a directory tree): nothing to run
                continue
            if b.skip is not None:
                out.append(pytest.param([[b]], id=f"{page}:{b.lang}:{b.line}"))
            elif b is (python[0] if python else None):
                steps.append(python)
            elif b.lang != "python":
                steps.append([b])
        if steps:
            out.append(pytest.param(steps, id=page))
    return out


@pytest.fixture(scope="session")
def session_home(tmp_path_factory):
    """The environment every page runs in: one cache for the session, offline, this venv first."""
    cache = tmp_path_factory.mktemp("docs-cache")
    return {
        **os.environ,
        "SSMKIT_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def _clone(home: Path) -> Path:
    """A reader's fresh clone at ``home``: configs/, notebooks/, params/."""
    home.mkdir(parents=True, exist_ok=True)
    for name in ("configs", "notebooks", "params"):
        shutil.copytree(ROOT / name, home / name)
    return home


def _run(command: str, cwd: Path, env: dict, where: str) -> None:
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, text=True, capture_output=True, timeout=600
    )
    assert done.returncode == 0, f"{where}: {command}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, session_home):
    """USES path -> its directory, each made the first time a block asks for it."""
    made: dict[str, Path] = {}

    def get(path: str) -> Path:
        if path not in made:
            home = _clone(tmp_path_factory.mktemp("shared-run"))
            _run(USES[path], home, session_home, f"USES[{path!r}]")
            made[path] = home / path
        return made[path]

    return get


@pytest.fixture(scope="session")
def workspaces(tmp_path_factory):
    """Page -> its fresh directory (a clone), made when its first block runs and kept for the
    page's later blocks."""
    homes: dict[str, Path] = {}

    def get(page: str) -> Path:
        if page not in homes:
            homes[page] = _clone(tmp_path_factory.mktemp(re.sub(r"\W", "-", page)))
        return homes[page]

    return get


def _link_or_copy(src: str, dst: str) -> None:
    """Weights and optimizer state hard-linked (ssmkit replaces files, never writes into them);
    small files (a lock, a pointer, JSON) copied, so a page's run cannot touch the shared one."""
    if os.path.getsize(src) > 1 << 20:
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


@pytest.mark.parametrize("page", list(BLOCKS))
def test_blocks_use_known_languages_and_markers(page):
    blocks = BLOCKS[page]
    for b in blocks:
        assert b.lang in LANGUAGES, (
            f"{page}:{b.line - 1}: language {b.lang!r}; use one of {LANGUAGES}"
        )
        if b.skip_lines:
            assert b.lang == "bash", f"{page}:{b.line - 1}: line markers are for bash blocks"
            for prefix in b.skip_lines:
                assert any(ln.startswith(prefix) for ln in b.code.splitlines()), (
                    f"{page}:{b.line - 1}: no line of the block starts with {prefix!r}"
                )
        for path in b.uses:
            assert path in USES, f"{page}:{b.line - 1}: uses {path!r}; known: {sorted(USES)}"


def test_the_readme_has_blocks_of_both_kinds():
    assert {b.lang for b in BLOCKS["README.md"]} >= {"python", "bash"}


def test_every_substitution_still_applies():
    for page, old, _, why in SMALL:
        assert page in BLOCKS, f"SMALL names {page}, which does not exist"
        text = (ROOT / page).read_text(encoding="utf-8")
        assert old in text, f"SMALL substitutes {old!r} ({why}) but {page} no longer holds it"


def test_the_readme_links_every_page_of_docs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [p for p in BLOCKS if p.startswith("docs/") and f"]({p})" not in readme]
    assert not missing, f"README.md does not link {missing}: add them to its Documentation table"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", heading.strip().lower()))


@pytest.mark.parametrize("page", list(BLOCKS))
def test_relative_links_resolve(page):
    """Links to files of the checkout name files that exist, and headings that exist in them."""
    source = ROOT / page
    for target in LINK.findall(source.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked (offline)
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        assert file.exists(), f"{page}: link to {target!r}: {file} does not exist"
        if anchor:
            prose = re.sub(r"^```.*?^```", "", file.read_text(encoding="utf-8"), flags=re.M | re.S)
            headings = [_anchor(h) for h in re.findall(r"^#+ (.+)$", prose, flags=re.M)]
            assert anchor in headings, f"{page}: link to {target!r}: no such heading; {headings}"


DRIVER = r"""
import json, sys

ns = {"__name__": "__main__"}
for b in json.load(open(sys.argv[1])):
    print(f"--- {b['page']}:{b['line']}", flush=True)
    exec(compile("\n" * (b["line"] - 1) + b["code"], b["page"], "exec"), ns)
"""


@pytest.mark.parametrize("steps", units())
def test_page_runs(steps, workspaces, shared_runs, session_home):
    for blocks in steps:
        _run_blocks(blocks, workspaces, shared_runs, session_home)


def _run_blocks(blocks, workspaces, shared_runs, session_home):
    first = blocks[0]
    where = f"{first.page}:{first.line - 1}"
    if first.skip is not None:
        pytest.skip(f"{where}: {first.skip}")
    home = workspaces(first.page)
    for b in blocks:
        for path in b.uses:
            if not (home / path).exists():
                (home / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copytree(
                    shared_runs(path), home / path, copy_function=_link_or_copy, symlinks=True
                )
    if first.lang == "python":
        spec = home / f".blocks-{first.line}.json"
        spec.write_text(
            json.dumps(
                [{"page": b.page, "line": b.line, "code": small(b.page, b.code)} for b in blocks]
            )
        )
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, str(spec)],
            cwd=home,
            env=session_home,
            text=True,
            capture_output=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{first.page}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        return
    ran = 0
    for offset, line in enumerate(first.code.splitlines()):
        command = line.strip()
        if not command or command.startswith("#"):
            continue
        if any(command.startswith(p) for p in first.skip_lines):
            continue
        _run(
            small(first.page, command + " "),
            home,
            session_home,
            f"{first.page}:{first.line + offset}",
        )
        ran += 1
    assert ran or first.skip_lines, f"{first.page}:{first.line}: a bash block without commands"
