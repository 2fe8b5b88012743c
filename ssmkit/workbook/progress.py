"""What a headless run tells a person while it runs: a line per code cell, and a warning when a
notebook took far longer than its stated CPU time.

    01_prototype_130m [5/12] cell 'train_dir, val_dir = ssmkit.train.prepare_dat...' 3.2 s
    01_prototype_130m [8/12] cell 'torch.manual_seed(cfg.seed)' running for 1 min ...
    01_prototype_130m [8/12] cell 'torch.manual_seed(cfg.seed)' 212.5 s

A cell still running after :data:`FIRST_NOTICE` seconds says so, then every :data:`NOTICE_EVERY`
seconds, so a log never goes quiet for long. A notebook states its CPU time in its metadata
(``metadata.ssmkit.cpu_seconds``: measured on a 2-core machine with ``params/cpu.yaml``);
:func:`slow_warning` flags a CPU run that took more than :data:`SLOW_FACTOR` times that.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from .cells import format_duration

__all__ = [
    "FIRST_NOTICE",
    "NOTICE_EVERY",
    "SLOW_FACTOR",
    "CellLines",
    "cell_label",
    "slow_warning",
    "step_line",
]

FIRST_NOTICE = 60.0  # s: a cell running this long gets a "running for" line
NOTICE_EVERY = 300.0  # s: and another one this often
SLOW_FACTOR = 3.0  # a CPU run this many times slower than the stated CPU time is flagged


def step_line(i: int, n: int, text: str) -> None:
    """``[i/n] text``, printed at once: each model a chapter function trains or measures in turn
    says so as it starts, so a cell that runs several of them (04's LoRA-vs-full comparison:
    minutes on a CPU) never sits silent."""
    print(f"[{i}/{n}] {text}", flush=True)


def cell_label(source: str, tags=(), width: int = 48) -> str:
    """A cell as one short line: "parameters", "parameters (injected)" (papermill's cell), else its
    first line of code after the imports, cut to ``width`` characters."""
    if "injected-parameters" in tags or source.startswith("# Parameters"):
        return "parameters (injected)"
    if "parameters" in tags:
        return "parameters"
    lines = [
        ln.strip() for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#")
    ]
    code = [ln for ln in lines if not ln.startswith(("import ", "from "))] or lines
    line = code[0] if code else ""
    return line if len(line) <= width else line[: width - 3] + "..."


class CellLines:
    """nbclient hooks (:meth:`hooks`) that print one line per code cell of notebook ``name`` when it
    ends, with its time, and "running for ..." lines for a long one. Call :meth:`stop` when the
    notebook ends, however it ends (a timeout or a signal skips the last hook)."""

    def __init__(
        self,
        name: str,
        stream=None,
        first_notice: float = FIRST_NOTICE,
        notice_every: float = NOTICE_EVERY,
    ):
        self.name, self.stream = name, stream
        self.first_notice, self.notice_every = first_notice, notice_every
        self.total = self.index = 0
        self.started, self.label, self.timer = None, "", None
        self.lock = threading.Lock()

    def hooks(self) -> dict:
        return {
            "on_notebook_start": self._notebook,
            "on_cell_execute": self._start,
            "on_cell_executed": self._done,
        }

    def _print(self, text: str) -> None:
        print(
            f"  {self.name} [{self.index}/{self.total}] cell {self.label!r} {text}",
            file=self.stream or sys.stdout,
            flush=True,
        )

    def _notebook(self, notebook, **_):
        self.total = sum(c.cell_type == "code" and bool(c.source.strip()) for c in notebook.cells)

    def _start(self, cell, **_):
        with self.lock:
            self.index += 1
            self.started = time.perf_counter()
            self.label = cell_label(cell.source, cell.get("metadata", {}).get("tags", []))
            self._arm(self.first_notice)

    def _arm(self, delay: float) -> None:
        self.timer = threading.Timer(delay, self._notice, args=(self.index,))
        self.timer.daemon = True
        self.timer.start()

    def _notice(self, index: int) -> None:
        with self.lock:
            if index != self.index or self.started is None:  # that cell has ended
                return
            self._print(f"running for {format_duration(time.perf_counter() - self.started)} ...")
            self._arm(self.notice_every)

    def _done(self, cell, execute_reply=None, **_):
        with self.lock:
            self._cancel()
            failed = ((execute_reply or {}).get("content") or {}).get("status") == "error"
            self._print(f"{time.perf_counter() - self.started:.1f} s{' (error)' if failed else ''}")
            self.started = None

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def stop(self) -> None:
        with self.lock:
            self._cancel()
            self.started = None


def slow_warning(
    name: str, seconds: float | None, stated: float | None, device: str | None
) -> str | None:
    """A line when a CPU run of notebook ``name`` took more than :data:`SLOW_FACTOR` x its stated
    CPU time; None otherwise (also on a GPU, or when either time is unknown)."""
    if device != "cpu" or not seconds or not stated or seconds <= SLOW_FACTOR * stated:
        return None
    return (
        f"{name} ran {format_duration(seconds)} on CPU, "
        f"{seconds / stated:.1f}x its stated CPU time "
        f"(~{format_duration(stated)}, measured on 2 cores with params/cpu.yaml): "
        f"the machine was busy or slower ({os.cpu_count()} CPUs here), "
        "or the parameters ask for more than the CPU defaults"
    )
