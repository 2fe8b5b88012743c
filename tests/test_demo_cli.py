"""The `make run` demo and the `ssmkit` command, run as a user would (subprocesses)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ENV = dict(os.environ)   # offline: tests/conftest.py sets HF_HUB_OFFLINE=1 for every test and subprocess


def run(*args, check=True):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, check=check,
                          timeout=600)


def test_demo_loss_falls_and_samples():
    out = run("-m", "ssmkit.demo", "--steps", "40", "--batch-size", "8", "--seq-len", "64").stdout
    first, last = map(float, re.search(r"val loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 1.0, out                       # 40 steps already beat the uniform guess by far
    assert "sample:\nThe for statement " in out


@pytest.mark.parametrize("mixer", ["mamba2", "hybrid"])
def test_demo_other_mixers(mixer):
    out = run("-m", "ssmkit.demo", "--mixer", mixer, "--steps", "20", "--batch-size", "4",
              "--seq-len", "64").stdout
    first, last = map(float, re.search(r"val loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first


def test_cli_env_and_errors():
    out = run("-m", "ssmkit.cli", "env").stdout
    assert "torch" in out and "selective_scan" in out and "ssd_scan" in out
    bad = run("-m", "ssmkit.cli", "env", "--bogus", check=False)
    assert bad.returncode == 2 and "--bogus" in bad.stderr
    forced = subprocess.run([sys.executable, "-m", "ssmkit.cli", "env"], capture_output=True, text=True,
                            env={**ENV, "SSMKIT_BACKEND": "cuda"})
    assert "cuda forced but unavailable" in forced.stdout
