"""Every code block of README.md runs as a reader would run it: offline, on a CPU, from a fresh directory.

A block is ```python, ```bash or ```text (not code; any other language is an error). A block that cannot
run here carries markers on the lines right above it (the reason is required):

    <!-- readme-test: skip: REASON -->                   the whole block is not run
    <!-- readme-test: skip "COMMAND PREFIX": REASON -->  (bash) the lines starting with that prefix

Everything else must run and succeed:

* python blocks run in order in one interpreter per README section (``## ...``): the snippets of a
  section chain as a reader would chain them; a traceback names the README line.
* bash blocks run line by line with ``bash -c`` (comments are bash's), this interpreter's ``bin`` first
  on PATH (``ssmkit``, ``python``, ``papermill`` are this venv's).

All of it runs in one scratch directory holding copies of configs/, notebooks/ and params/ (a fresh
clone, minus the code, which is installed), with a private SSMKIT_CACHE, HF_HUB_OFFLINE=1 and
MPLBACKEND=Agg. To keep the time small the test substitutes small sizes in a few commands; each
substitution is listed in SMALL with the reason, and the test fails when its text is no longer in the
README, so an edited README cannot slip past it. Units that run notebooks or the make targets are
marked slow (they still run in `make test`).
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

README = ROOT / "README.md"
VENV = Path(sys.prefix)
RUN = f"readme-test-{os.getpid()}"              # `make run` writes runs/$(RUN) in the checkout: removed after
FENCE = re.compile(r"```(\w*)\s*")
MARKER = re.compile(r'<!--\s*readme-test:\s*skip(?:\s+"([^"]+)")?:\s*(\S.*?)\s*-->')
LANGUAGES = ("python", "bash", "text")

# (README text, what the test runs instead, why): plain text replacements inside a block
SMALL = [
    ("make run ",
     f"make -C {ROOT} -o {VENV}/.ssmkit-installed run VENV={VENV} PARAMS=params/ci.yaml RUN={RUN} ",
     "the CI parameters (seconds per notebook) instead of the CPU defaults (minutes), with this venv; "
     "-C: make runs in the checkout, as the README's reader does"),
    ("ssmkit workbook run                                          #",
     "ssmkit workbook run -f params/ci.yaml                        #",
     "every notebook with the CI parameters instead of the CPU defaults"),
    ("ssmkit train --config configs/cpu-tiny.yaml                       #",
     "ssmkit train --config configs/cpu-tiny.yaml --set max_steps=2 #",
     "2 steps instead of 120"),
    ("ssmkit train --config configs/cpu-tiny.yaml --set max_steps=240 --resume",
     "ssmkit train --config configs/cpu-tiny.yaml --set max_steps=4 --resume",
     "resumes the 2-step run above and stops at step 4"),
    ('overrides=["max_steps=50", "out_dir=runs/try"]',
     'overrides=["max_steps=2", "out_dir=runs/try"]',
     "2 steps instead of 50"),
    ("ssmkit train --config configs/cpu-tiny-lora.yaml          #",
     "ssmkit train --config configs/cpu-tiny-lora.yaml --set max_steps=2 #",
     "2 LoRA steps instead of 60 (on the 4-step cpu-tiny run of the Training section)"),
]
SLOW_SECTIONS = ("Two commands", "The workbook")   # notebooks under papermill, `make run`


@dataclass
class Block:
    section: str
    lang: str
    line: int                   # README line of the block's first code line
    code: str
    skip: str | None = None     # the reason the whole block is not run
    skip_lines: dict[str, str] = field(default_factory=dict)     # command prefix -> reason


def parse(text: str) -> list[Block]:
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
        assert end is not None, f"README.md:{i + 1}: a code block that is never closed"
        block = Block(section, fence.group(1), i + 2, "\n".join(lines[i + 1:end]))
        j = i - 1
        while j >= 0 and "readme-test" in lines[j]:
            marker = MARKER.fullmatch(lines[j].strip())
            assert marker, f"README.md:{j + 1}: malformed marker {lines[j]!r}; expected {MARKER.pattern}"
            prefix, reason = marker.groups()
            if prefix is None:
                block.skip = reason
            else:
                block.skip_lines[prefix] = reason
            j -= 1
        blocks.append(block)
        i = end + 1
    return blocks


BLOCKS = parse(README.read_text(encoding="utf-8"))


def small(text: str) -> str:
    for old, new, _ in SMALL:
        text = text.replace(old, new)
    return text


def units() -> list:
    """What runs: one unit per section's python blocks (together, in order), one per bash block."""
    out, python = [], {}
    for b in BLOCKS:
        if b.lang == "text":                          # not code (a directory tree): nothing to run
            continue
        if b.lang == "python" and b.skip is None:
            python.setdefault(b.section, []).append(b)
        else:
            out.append((f"{b.lang}:{b.line}", [b]))
        if b.lang == "python" and b.skip is None and len(python[b.section]) == 1:
            out.append((f"python:{b.section}", python[b.section]))
    return [pytest.param(blocks, id=name, marks=[pytest.mark.slow] if blocks[0].section in SLOW_SECTIONS
                         else []) for name, blocks in out]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A fresh directory as a reader's clone: configs/, notebooks/, params/; a private cache."""
    home = tmp_path_factory.mktemp("readme")
    for name in ("configs", "notebooks", "params"):
        shutil.copytree(ROOT / name, home / name)
    env = {**os.environ, "SSMKIT_CACHE": str(home / ".cache"), "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    yield home, env
    shutil.rmtree(ROOT / "runs" / RUN, ignore_errors=True)


def test_the_readme_has_blocks_and_only_known_languages():
    assert {b.lang for b in BLOCKS} >= {"python", "bash"}
    for b in BLOCKS:
        assert b.lang in LANGUAGES, f"README.md:{b.line - 1}: language {b.lang!r}; use one of {LANGUAGES}"
        if b.skip_lines:
            assert b.lang == "bash", f"README.md:{b.line - 1}: line markers are for bash blocks"
            for prefix in b.skip_lines:
                assert any(ln.startswith(prefix) for ln in b.code.splitlines()), \
                    f"README.md:{b.line - 1}: no line of the block starts with {prefix!r}"


def test_every_substitution_still_applies():
    text = README.read_text(encoding="utf-8")
    for old, _, why in SMALL:
        assert old in text, f"SMALL substitutes {old!r} ({why}) but the README no longer holds it"


DRIVER = r"""
import json, sys

ns = {"__name__": "__main__"}
for b in json.load(open(sys.argv[1])):
    print(f"--- README.md:{b['line']}", flush=True)
    exec(compile("\n" * (b["line"] - 1) + b["code"], "README.md", "exec"), ns)
"""


@pytest.mark.parametrize("blocks", units())
def test_block_runs(blocks, workspace):
    home, env = workspace
    first = blocks[0]
    if first.skip is not None:
        pytest.skip(f"README.md:{first.line - 1}: {first.skip}")
    if first.lang == "python":
        spec = home / f".blocks-{first.line}.json"
        spec.write_text(json.dumps([{"line": b.line, "code": small(b.code)} for b in blocks]))
        done = subprocess.run([sys.executable, "-c", DRIVER, str(spec)], cwd=home, env=env, text=True,
                              capture_output=True, timeout=600)
        assert done.returncode == 0, \
            f"section {first.section!r}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        return
    ran = 0
    for offset, line in enumerate(first.code.splitlines()):
        command = line.strip()
        if not command or command.startswith("#"):
            continue
        skipped = [p for p in first.skip_lines if command.startswith(p)]
        if skipped:
            continue
        done = subprocess.run(["bash", "-c", small(command + " ")], cwd=home, env=env, text=True,
                              capture_output=True, timeout=600)
        assert done.returncode == 0, (f"README.md:{first.line + offset}: {command}\n"
                                      f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        ran += 1
    assert ran or first.skip_lines, f"README.md:{first.line}: a bash block without commands"
