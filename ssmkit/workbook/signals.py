"""Stopping a run: SIGINT (Ctrl-C) and SIGTERM (Slurm's scancel, preemption, a time limit) become
:class:`Interrupted`, raised wherever the run is, once.

    with StopOnSignals() as signals:
        try:
            ...                                 # run the notebooks
        except Interrupted:
            signals.settle()                    # end the event-loop tasks the exception cut off
        finally:
            signals.disarm()                    # later signals are ignored: the run is stopping

:func:`ssmkit.workbook.run_workbook` then shuts the kernel down, writes the summary (that notebook
"interrupted", the later ones "not run") and re-raises; ``ssmkit workbook run`` exits 128 + the
signal's number (130, 143).
"""

from __future__ import annotations

import asyncio
import signal
import threading

__all__ = ["Interrupted", "StopOnSignals"]


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped :func:`run_workbook`; raised after the summary was written
    (``summary``). ``signum`` says which signal: the command exits 128 + signum (130, 143)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.summary = signum, None


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class StopOnSignals:
    """While active (main thread only), the first SIGINT or SIGTERM raises :class:`Interrupted`
    wherever the run is; later ones, and any after :meth:`disarm`, are ignored: the run is already
    stopping (kernel shutdown, summary). A signal the process ignores (SIGINT of a background job,
    ``cmd &`` in a script) stays ignored.

    The exception leaves nbclient's event-loop tasks for the running cell behind; :meth:`settle`
    ends them once the kernel is gone, so asyncio does not print them at exit ("Task exception was
    never retrieved")."""

    def __enter__(self):
        self.armed, self.previous, self.cut_off = True, {}, None
        # e.g. Jupyter's own loop when run from a notebook: not ours
        self.outer = _running_loop()
        if threading.current_thread() is threading.main_thread():
            self.previous = {
                s: signal.signal(s, self._handle)
                for s in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(s) != signal.SIG_IGN
            }
        return self

    def _handle(self, signum, frame):
        if self.armed:
            self.armed = False
            loop = _running_loop()
            if loop is not None and loop is not self.outer:
                self.cut_off = loop, asyncio.all_tasks(loop)
            raise Interrupted(signum)

    def disarm(self):
        self.armed = False

    def settle(self):
        if self.cut_off:
            loop, tasks = self.cut_off
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.wait(tasks, timeout=5))
            for task in tasks:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: not printed at exit

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
