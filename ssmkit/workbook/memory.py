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
``/proc`` does on Linux; elsewhere the peak is None. The last sample (``held``, at the kernel's
shutdown) is what the kernel still holds after its last cell: what a JupyterLab kernel left open
keeps out of a Binder session's 2 GB while the learner moves on to the next notebook.

Inside the kernel, :func:`free_memory` (a training notebook's last cell) drops the notebook's
models, tensors and trainers and hands the memory back to the OS.
"""

from __future__ import annotations

import threading
import types
from pathlib import Path

__all__ = ["BINDER_MIB", "PeakRSS", "free_memory", "tree_rss"]

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
    is larger; ``held`` (bytes or None): the last sample, taken by :meth:`stop`."""

    def __init__(self, pid: int, interval: float = INTERVAL):
        self.pid, self.interval, self.peak, self.held = pid, interval, None, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"peak-rss-{pid}", daemon=True)

    def start(self) -> PeakRSS:
        self._thread.start()
        return self

    def sample(self) -> None:
        """One sample now (also the last one, in :meth:`stop`)."""
        now = tree_rss(self.pid)
        self.held = now if now is not None else self.held
        for value in (now, _status_kib(self.pid, "VmHWM")):
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


def _heavy(value, depth: int = 2) -> bool:
    """Whether ``value`` holds tensors: a tensor, a module, an optimizer, an object with a module
    or an optimizer among its attributes (a Trainer, a run's handle), or a list / tuple / dict of
    such, ``depth`` levels down."""
    import torch

    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return True
    if depth == 0 or isinstance(value, (str, bytes, type, types.ModuleType, types.FunctionType)):
        return False
    if isinstance(value, dict):
        return any(_heavy(v, depth - 1) for v in list(value.values())[:1000])
    if isinstance(value, (list, tuple, set)):
        return any(_heavy(v, depth - 1) for v in list(value)[:1000])
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        return any(
            isinstance(v, (torch.nn.Module, torch.optim.Optimizer)) for v in list(attrs.values())
        )
    return False


def free_memory(namespace: dict, keep: tuple[str, ...] = ()) -> dict:
    """Hand a finished notebook's memory back: delete from ``namespace`` (the notebook's
    ``globals()``) every name bound to a model, tensor, optimizer or trainer (or a list / dict of
    them), except the names in ``keep`` and private ones (``_x``); clear IPython's output history
    and the last traceback (both keep objects alive); collect, and return the freed memory to the
    OS (:func:`ssmkit.env.release_freed_memory`). Prints one line: what was deleted and what this
    process holds now. Plain results (dicts of numbers, tables, paths) stay. Returns
    ``{"deleted": [names], "before_mib": float | None, "after_mib": float | None}``.

    Why: a JupyterLab kernel lives on after its last cell; a workshop's learner who opens the next
    notebook leaves this one's models resident, and two training kernels overrun a free Binder
    session's 2 GB. Rerunning a cell that used a deleted name needs the cells before it again."""
    import gc
    import sys

    from .. import env

    if not isinstance(namespace, dict):
        raise ValueError(
            f"free_memory takes the notebook's namespace, globals(); got {type(namespace).__name__}"
        )
    before = env.rss_mb()
    deleted = [
        name
        for name, value in list(namespace.items())
        if not name.startswith("_") and name not in keep and _heavy(value)
    ]
    for name in deleted:
        del namespace[name]
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None:
        shell.displayhook.flush()  # Out[n], _, __, ___
    for name in ("last_exc", "last_value", "last_traceback", "last_type"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    env.release_freed_memory()
    after = env.rss_mb()
    held = "" if after is None else f"; this kernel now holds {after:,.0f} MiB"
    shrank = "" if None in (before, after) else f" ({before - after:,.0f} MiB freed)"
    names = ", ".join(deleted) if deleted else "nothing to delete"
    print(
        f"free_memory: {names}{shrank}{held}. Kernel > Shut Down Kernel returns the rest; "
        "rerun the notebook from the top to use these names again."
    )
    return {"deleted": deleted, "before_mib": before, "after_mib": after}
