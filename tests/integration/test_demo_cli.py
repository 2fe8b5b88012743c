"""The `make run` demo and the `ssmkit` command, run as a user would (subprocesses)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ENV = dict(
    os.environ
)  # offline: tests/conftest.py sets HF_HUB_OFFLINE=1 for every test and subprocess


def run(*args, check=True):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=ENV, check=check, timeout=600
    )


def test_demo_loss_falls_and_samples():
    out = run("-m", "ssmkit.demo", "--steps", "40", "--batch-size", "8", "--seq-len", "64").stdout
    first, last = map(float, re.search(r"val loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 1.0, out  # 40 steps already beat the uniform guess by far
    assert "sample:\nThe for statement " in out


@pytest.mark.parametrize("mixer", ["mamba2", "hybrid"])
def test_demo_other_mixers(mixer):
    out = run(
        "-m",
        "ssmkit.demo",
        "--mixer",
        mixer,
        "--steps",
        "20",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
    ).stdout
    first, last = map(float, re.search(r"val loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first


def test_cli_demo_trains_mamba3():
    """``ssmkit demo --mixer mamba3`` trains the tiny-mamba3 preset (its size, built here, is the
    one printed) and samples; the choices are listed in the help and in the error for an unknown
    mixer."""
    import ssmkit

    out = run(
        "-m",
        "ssmkit.cli",
        "demo",
        "--mixer",
        "mamba3",
        "--steps",
        "20",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
    ).stdout
    params = ssmkit.build_model(ssmkit.ModelConfig.preset("tiny-mamba3")).num_parameters()
    assert out.startswith(f"model: mamba3, d_model 64, 4 layers, {params / 1e3:.0f}K parameters"), (
        out
    )
    first, last = map(float, re.search(r"val loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first and "sample:\nThe for statement " in out
    words = lambda *args: " ".join(run(*args).stdout.split())  # noqa: E731 (argparse wraps its help)
    assert "--mixer mamba1, mamba2, mamba3 or hybrid" in words("-m", "ssmkit.cli", "--help")
    assert "mamba3 (exponential-trapezoidal scan" in words("-m", "ssmkit.cli", "demo", "--help")
    bad = run("-m", "ssmkit.cli", "demo", "--mixer", "mamba4", check=False)
    assert bad.returncode == 2 and "'mamba1', 'mamba2', 'mamba3', 'hybrid'" in bad.stderr, (
        bad.stderr
    )


def test_cli_env_and_errors():
    out = run("-m", "ssmkit.cli", "env").stdout
    assert "torch" in out and "selective_scan" in out and "ssd_scan" in out
    bad = run("-m", "ssmkit.cli", "env", "--bogus", check=False)
    assert bad.returncode == 2 and "--bogus" in bad.stderr
    forced = subprocess.run(
        [sys.executable, "-m", "ssmkit.cli", "env"],
        capture_output=True,
        text=True,
        env={**ENV, "SSMKIT_BACKEND": "cuda"},
    )
    assert "cuda forced but unavailable" in forced.stdout
