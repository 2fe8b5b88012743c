"""Stopping data preparation by hand (Ctrl-C, Jupyter's stop button, SIGTERM) says one line, from
the parent alone (the workers print nothing), and what was kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT

import ssmkit.data as D
from ssmkit.io import Stopped


def test_data_prepare_stopped_says_what_it_kept(tmp_path):
    def docs():
        for i in range(200):
            if i == 150:
                raise KeyboardInterrupt  # Ctrl-C while reading the 151st document (batches of 64)
            yield D.Document(str(i), f"document {i}: " + "lorem ipsum " * 20)

    with pytest.raises(Stopped, match=r"stopped while preparing data; \d+ shard\(s\) \([\d,]+ tok"):
        D.prepare(docs(), "byte", tmp_path / "out", shard_tokens=1000, progress=False)
    with pytest.raises(Stopped, match=r"stopped while preparing data; nothing written$"):
        D.prepare(docs(), "byte", tmp_path / "none", shard_tokens=10**6, progress=False)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signals_during_prepare_with_workers_print_one_line(tmp_path, sig):
    """The signal goes to the whole process group (Ctrl-C in a terminal, Jupyter's stop button on a
    kernel), while the workers are still importing: before, each worker printed its traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssmkit.cli", "data", "prepare", "--source", "stdlib-docs",
         "--tokenizer", "byte", "--out", str(tmp_path / "out"), "--workers", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
        env={**os.environ, "SSMKIT_PROGRESS": "off", "SSMKIT_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:  # until the pool's workers exist
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        if len(children) >= 2:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err
    assert err.splitlines() == [err.splitlines()[0]]
    assert err.startswith("ssmkit data prepare: stopped while preparing data; ")
    assert proc.returncode == 128 + sig
