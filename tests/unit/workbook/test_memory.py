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


def test_held_is_the_last_sample(holder):
    sampler = memory.PeakRSS(holder.pid, interval=0.05).start()
    time.sleep(0.1)
    assert sampler.stop() >= sampler.held > 100 * MIB  # still held when sampling stopped


FREE = """
import json, sys, types, torch
from ssmkit.workbook import memory
class Run:  # a trainer-like object: a module among its attributes
    def __init__(self):
        self.model = torch.nn.Linear(2048, 2048)
ns = {"model": torch.nn.Linear(4096, 4096), "acts": [torch.randn(50 * 2**20 // 4 * 4)],
      "trainer": Run(), "results": {"loss": 1.0, "rows": [{"a": 1}]}, "name": "x",
      "_hidden": torch.zeros(10), "keep_me": torch.zeros(10), "chapter": types.ModuleType("c"),
      "fn": print}
out = memory.free_memory(ns, keep=("keep_me",))
print(json.dumps({**out, "left": sorted(ns)}))
"""


def test_free_memory_drops_models_tensors_and_trainers_and_returns_the_memory():
    """A notebook's namespace holding ~270 MiB of tensors (a 64 MiB Linear, 200 MiB of activations
    in a list, a trainer-like object with a 16 MiB module): free_memory deletes exactly those
    three names, keeps plain results, private names, `keep`, modules and functions, and the
    process's resident set shrinks by at least 200 MiB."""
    import json

    run = subprocess.run(
        [sys.executable, "-c", FREE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(memory.__file__).parents[2])},
    )
    assert run.returncode == 0, run.stderr
    line, data = run.stdout.splitlines()[-2], json.loads(run.stdout.splitlines()[-1])
    assert data["deleted"] == ["model", "acts", "trainer"], data
    assert data["left"] == ["_hidden", "chapter", "fn", "keep_me", "name", "results"], data
    if data["before_mib"] is not None:
        assert data["before_mib"] - data["after_mib"] > 200, data
        assert "MiB freed" in line and "this kernel now holds" in line, line
    assert line.startswith("free_memory: model, acts, trainer"), line


def test_free_memory_wants_the_namespace():
    with pytest.raises(ValueError, match=r"globals\(\); got list"):
        memory.free_memory([])
