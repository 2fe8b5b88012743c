"""The peak memory of a notebook's kernel: its resident set size (RSS) and its children's, sampled.

    sampler = PeakRSS(pid).start()  # a daemon thread, one sample every `interval` s
    ...
    peak = sampler.stop()            # bytes, or None where nothing could be read

The peak is the largest sum, over the samples, of the RSS of the kernel process and of every
process below it (the 2-process DDP of notebook 02, a ``ssmkit train`` a cell launched), and at
least the kernel's own high-water mark (``VmHWM`` in ``/proc/<pid>/status``, read at each sample),
so the kernel's peak is never missed between two samples; a child's short spike can be. Summing
RSS counts a page that two processes share (torch's libraries) once per process: for a tree, the
figure is an upper bound of what a container's memory limit (Binder's ~2 GB) counts.

psutil (installed with ipykernel's IPython on Linux and macOS) finds the children; without it,
``/proc`` does on Linux; elsewhere the peak is None.
"""

from __future__ import annotations

import threading
from pathlib import Path

__all__ = ["BINDER_MIB", "PeakRSS", "tree_rss"]

BINDER_MIB = (
    2048  # a free Binder session's memory: params/workshop.yaml keeps every notebook under it
)

INTERVAL = 0.2  # s between samples: ~1% of a core (a /proc scan), and a 200 MB step lasts longer


def _status_kib(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) in bytes; None if unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _proc_tree(pid: int) -> list[int]:
    """``pid`` and its descendants from ``/proc/*/stat`` (Linux without psutil)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += parents.get(p, [])
    return tree


def tree_rss(pid: int) -> int | None:
    """The summed RSS in bytes of ``pid`` and its descendants now; None if ``pid`` is gone or
    nothing can be read on this system."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:  # ended between the listing and the read
                pass
        return total
    if not Path(f"/proc/{pid}").exists():
        return None
    sizes = [_status_kib(p, "VmRSS") for p in _proc_tree(pid)]
    return sum(s for s in sizes if s) if any(s is not None for s in sizes) else None


class PeakRSS:
    """Samples :func:`tree_rss` of ``pid`` every ``interval`` seconds on a daemon thread until
    :meth:`stop`; ``peak`` (bytes or None): the largest sample or the process's ``VmHWM``, whichever
    is larger."""

    def __init__(self, pid: int, interval: float = INTERVAL):
        self.pid, self.interval, self.peak = pid, interval, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"peak-rss-{pid}", daemon=True)

    def start(self) -> PeakRSS:
        self._thread.start()
        return self

    def sample(self) -> None:
        """One sample now (also the last one, in :meth:`stop`)."""
        for value in (tree_rss(self.pid), _status_kib(self.pid, "VmHWM")):
            if value is not None and (self.peak is None or value > self.peak):
                self.peak = value

    def _loop(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval)

    def stop(self) -> int | None:
        """End the sampling (one last sample first) and return the peak in bytes."""
        if not self._done.is_set():
            self._done.set()
            if self._thread.is_alive():
                self._thread.join(timeout=5)
            self.sample()
        return self.peak
