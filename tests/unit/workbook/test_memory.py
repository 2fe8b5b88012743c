"""ssmkit.workbook.memory: a process tree's RSS, with psutil and from /proc alone (the two agree),
and the sampler's peak against a known allocation in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ssmkit.workbook import memory

MIB = 2**20
HOLD = (
    "import sys, time; b = bytes(1) * (100 * 2**20); print('ready', flush=True); "
    "sys.stdin.read(); del b"
)
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc only")


@pytest.fixture
def holder():
    """A child process holding 100 MiB until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_tree_rss_counts_children_with_and_without_psutil(holder, monkeypatch):
    pytest.importorskip("psutil")
    with_psutil = memory.tree_rss(os.getpid())
    child = memory.tree_rss(holder.pid)
    assert 100 * MIB < child < 140 * MIB, child / MIB
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` raises ImportError
    from_proc = memory.tree_rss(os.getpid())
    assert abs(from_proc - with_psutil) < 20 * MIB, (from_proc / MIB, with_psutil / MIB)
    assert with_psutil > child  # this process and the child it holds
    assert memory.tree_rss(holder.pid) == pytest.approx(child, abs=5 * MIB)


def test_peak_outlives_the_allocation(holder):
    sampler = memory.PeakRSS(holder.pid, interval=0.05).start()
    time.sleep(0.2)
    holder.stdin.close()  # the child frees its 100 MiB and exits
    holder.wait(timeout=30)
    peak = sampler.stop()
    assert 100 * MIB < peak < 140 * MIB, peak / MIB
    assert memory.tree_rss(holder.pid) is None  # gone: nothing to read


def test_gone_process_has_no_rss():
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    pid = int(proc.stdout)
    assert memory.tree_rss(pid) is None
    assert memory.PeakRSS(pid).start().stop() is None
