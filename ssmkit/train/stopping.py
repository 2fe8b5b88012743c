"""Stopping a training run by hand (Ctrl-C, Jupyter's stop button) says one line and leaves the
Trainer whole.

In one process (main thread, where SIGINT is Python's own KeyboardInterrupt, as in a Jupyter
kernel's cell or ``ssmkit train``), the first Ctrl-C asks the loop to stop at the end of the step
it is in: :meth:`Trainer.fit` then raises :class:`~ssmkit.io.Stopped`,

    train cpu-tiny: stopped at step 40 of 200; last checkpoint runs/x/checkpoints/step_00000030;
    fit() goes on from step 40

with the model, optimizer and counters as after step 40 (a next ``fit()`` continues in memory, a
new Trainer's ``resume()`` from the checkpoint). A second Ctrl-C stops at once, mid-step. Under
torchrun (several ranks) every Ctrl-C stops at once: ranks that stopped at different step ends
would wait for each other forever.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from ..io import Stopped
from . import checkpoint

__all__ = ["StopAtStepEnd", "stopped"]


class StopAtStepEnd:
    """For the block, the first SIGINT sets :attr:`requested` (the loop checks it at each step's
    end) and a second raises KeyboardInterrupt at once. Active only when ``enabled``, in the main
    thread, and where SIGINT is Python's default handler (someone else's handler stays theirs)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.requested = False
        self.previous = None

    def __enter__(self):
        self.requested = False
        if (
            self.enabled
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # the second Ctrl-C: now
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None


def stopped(trainer, total: int, at_step_end: bool, signum: int = signal.SIGINT) -> Stopped:
    """The one-line :class:`~ssmkit.io.Stopped` for ``trainer`` stopped by hand: where, the last
    checkpoint of this run (or that there is none yet) and how to go on."""
    path = checkpoint.latest(trainer.ckpt_dir) if trainer._committed else None
    if path is None:
        every = trainer.config.ckpt_every
        kept = "no checkpoint yet" + (
            f" (one every {every} steps)" if every else " (ckpt_every=0: only at the end)"
        )
    else:
        kept = f"last checkpoint {_short(path)}"
    if at_step_end:
        where = f"stopped at step {trainer.step} of {total}"
        then = f"fit() goes on from step {trainer.step}"
    else:
        where = f"stopped at once near step {trainer.step} of {total}"
        then = "this Trainer may be mid-step: resume() a new one from the checkpoint"
    exc = Stopped(f"train {trainer.name}: {where}; {kept}; {then}", signum)
    exc.where, exc.checkpoint = where, path  # for a command line's own wording
    return exc


def _short(path: Path) -> str:
    """``path`` relative to the working directory when it is inside it (shorter in a notebook)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
