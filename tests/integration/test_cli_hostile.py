"""Every ``ssmkit`` command against hostile inputs: a missing path, a directory where a file is
expected, an empty file, a corrupt config.json, a bad ``--set``. The rule: exit status != 0, the
error in one line on stderr (argparse's usage lines aside), never a Python traceback; ``--debug``
brings the traceback back.

The commands run in this process through :func:`ssmkit.cli.main` (fast); two also run as real
subprocesses, the way a user starts them. Each input fails in its checks, before any training or
notebook starts, so the whole file takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ssmkit
from ssmkit.cli import COMMANDS, main

REPO = Path(ssmkit.__file__).parents[1]


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """A folder of hostile inputs."""
    root = tmp_path_factory.mktemp("hostile")
    (root / "dir").mkdir()
    (root / "empty.yaml").touch()
    (root / "empty.ipynb").touch()
    (root / "bad.yaml").write_text("{: [\n")
    (root / "good.yaml").write_text("model: tiny\nmax_steps: 1\n")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "config.json").write_text('{"model_type": "mamba", "hidden_size": ')
    (root / "emptyw").mkdir()  # a sane config, an empty weight file
    (root / "emptyw" / "model.safetensors").touch()
    config = {"model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 2, "vocab_size": 50}
    (root / "emptyw" / "config.json").write_text(json.dumps(config))
    (root / "huge").mkdir()  # the red-team's H31: 1e9 layers over an empty weight file
    (root / "huge" / "model.safetensors").touch()
    huge = {"model_type": "jamba", "hidden_size": 32, "num_hidden_layers": 10**9}
    (root / "huge" / "config.json").write_text(json.dumps({**huge, "vocab_size": 300}))
    (root / "runs").mkdir()
    return root


# command -> hostile argument lists ({b}: the folder of hostile inputs)
CASES = {
    "env": [["--bogus"]],
    "demo": [["--mixer", "nope"], ["--steps", "x"]],
    "data prepare": [
        ["--source", "{b}/missing", "--out", "{b}/o1"],
        ["--source", "{b}/empty.yaml", "--tokenizer", "byte", "--out", "{b}/o2"],
        ["--source", "{b}/dir", "--tokenizer", "byte", "--out", "{b}/o3"],
    ],
    "train": [
        ["--config", "{b}/missing.yaml"],
        ["--config", "{b}/dir"],
        ["--config", "{b}/empty.yaml"],
        ["--config", "{b}/bad.yaml"],
        ["--config", "{b}/good.yaml", "--set", "max_step=5"],
        ["--config", "{b}/good.yaml", "--set", "nonsense"],
    ],
    "plan": [
        ["--model", "{b}/missing.yaml"],
        ["--model", "{b}/dir"],
        ["--model", "{b}/bad.yaml"],
        ["--model", "nope-preset", "--seq-len", "8"],
    ],
    "generate": [
        ["{b}/missing", "--prompt", "hi"],
        ["{b}/runs/nope", "--prompt", "hi"],
        ["{b}/corrupt", "--prompt", "hi"],
        ["{b}/emptyw", "--prompt", "hi"],
        ["{b}/huge", "--prompt", "hi"],
        ["{b}/empty.yaml", "--prompt", "hi"],
        ["{b}/dir", "--prompt", "hi"],
        ["{b}/emptyw", "--prompt", "hi", "--top-p", "x"],
    ],
    "eval": [
        ["--model", "{b}/missing", "--tasks", "x"],
        ["--model", "{b}/corrupt", "--tasks", "ssmkit_lastword"],
        ["--model", "{b}/dir", "--tasks", "ssmkit_lastword"],
    ],
    "convert": [
        ["{b}/missing", "{b}/c1", "--to", "hf"],
        ["{b}/corrupt", "{b}/c2", "--to", "hf"],
        ["{b}/emptyw", "{b}/c3", "--to", "hf"],
        ["{b}/dir", "{b}/c4", "--to", "hf"],
        ["{b}/emptyw", "{b}/c5", "--to", "nope"],
    ],
    "workbook run": [
        ["{b}/missing.ipynb", "--out", "{b}/w1"],
        ["{b}/empty.ipynb", "--out", "{b}/w2"],
        ["-f", "{b}/bad.yaml", "--out", "{b}/w3"],
        ["-f", "{b}/dir", "--out", "{b}/w4"],
        ["-f", "{b}/empty.yaml", "-p", "no_such_parameter", "1", "--out", "{b}/w5"],
    ],
    "workbook strip": [["{b}/missing.ipynb"], ["{b}/empty.ipynb"], ["{b}/dir"]],
    "workbook build": [
        ["--for", "student", "{b}/b1", "{b}/missing.ipynb"],
        ["--for", "nobody", "{b}/b2"],
    ],
}


def test_every_command_has_hostile_cases():
    assert set(CASES) == set(COMMANDS)


def run(argv: list[str], capsys) -> tuple[int, str]:
    """``ssmkit ARGV`` in this process: (exit status, stderr)."""
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def assert_one_clear_line(code, err: str, what: str):
    assert code not in (0, None), f"{what}: exit status 0; stderr: {err}"
    assert "Traceback" not in err, f"{what}: a traceback:\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, f"{what}: nothing on stderr"
    if code == 2 and any(line.startswith("usage:") for line in lines):  # argparse's own
        lines = [line for line in lines if ": error: " in line]
    else:  # ssmkit's: "ssmkit CMD: what was wrong" (a workbook command: "ssmkit workbook: ...")
        lines = [line for line in lines if line.startswith("ssmkit ")]
    assert len(lines) == 1, f"{what}: not one error line:\n{err}"
    assert "unexpected" not in lines[0], f"{what}: an error no check caught: {lines[0]}"


@pytest.mark.parametrize(
    "name,args",
    [(name, args) for name, cases in CASES.items() for args in cases],
    ids=lambda v: v if isinstance(v, str) else " ".join(v).replace("{b}/", ""),
)
def test_a_hostile_input_is_one_line_never_a_traceback(bad, capsys, monkeypatch, name, args):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(bad)
    argv = [*name.split(), *(a.format(b=bad) for a in args)]
    code, err = run(argv, capsys)
    assert_one_clear_line(code, err, " ".join(argv))


def test_an_uncaught_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    """An error no command catches (here a bug injected into generate): one line naming it and
    --debug; ``ssmkit --debug`` lets it raise."""

    def broken(args):
        raise KeyError("boom")

    monkeypatch.setattr("ssmkit.cli.generate_text", broken)
    code, err = run(["generate", "x", "--prompt", "hi"], capsys)
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("ssmkit generate: KeyError: 'boom' (unexpected") and "--debug" in err
    with pytest.raises(KeyError, match="boom"):
        main(["--debug", "generate", "x", "--prompt", "hi"])

    def allocator(args):  # what a 64 TB allocation raised before the shape checks (H29)
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory:\nyou tried 64 TB")

    monkeypatch.setattr("ssmkit.cli.generate_text", allocator)
    code, err = run(["generate", "x", "--prompt", "hi"], capsys)
    assert code == 1 and err == (
        "ssmkit generate: DefaultCPUAllocator: can't allocate memory: you tried 64 TB\n"
    )


def test_debug_is_listed_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--debug" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,expected",
    [
        (["generate", "{b}/runs/nope", "--prompt", "hi"], "runs/nope: no such directory"),
        (["train", "--config", "{b}/good.yaml", "--set", "max_step=5"], "did you mean 'max_steps'"),
    ],
)
def test_as_a_user_runs_it_in_a_subprocess(bad, args, expected):
    argv = [a.format(b=bad) for a in args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "ssmkit", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=bad,
        timeout=120,
    )
    assert_one_clear_line(done.returncode, done.stderr, " ".join(argv))
    assert expected in done.stderr
