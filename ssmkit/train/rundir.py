"""The run directory (``out_dir``): one writer at a time, one run at a time, and nothing lost on
overwrite.

    out_dir/
        config.yaml         the run's TrainConfig (written once the run has started or resumed)
        metrics.jsonl       one JSON record per log / eval / skipped step
        checkpoints/        see ssmkit.train.checkpoint
        .ssmkit.lock        held by the process writing here (ssmkit.io.DirLock)
        .ssmkit-run.json    which Trainer object owns the directory now
        .previous-run/      an overwritten run, kept until the new run commits its first checkpoint

Rules, each with a test that injects the fault:

* Two trainers never write one ``out_dir``: rank 0 holds an exclusive lock while it claims it
  (``trainer.resume()`` or the first ``fit()``), fits or checkpoints; the second fails at once,
  naming the first (pid, host, command).
* A new run never mixes with an old one: an ``out_dir`` holding a run is resumed
  (``trainer.resume()``), replaced (``overwrite=True``) or refused.
* ``overwrite=True`` moves the old run aside into ``.previous-run/`` and deletes it only after the
  new run's first checkpoint is committed. If the new run fails before that, the old run is put
  back (at once for an exception; at the next start after a kill).
* A commit sequence that a crash interrupted is finished or undone first (checkpoint.recover).
* Every rank sees one ``out_dir``: each writes its part of every checkpoint there, so a directory
  that another machine cannot see (its own disk, a relative path from elsewhere) is refused when
  the run starts, naming the ranks and hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
import warnings
from pathlib import Path

from ..io import DirLock, LockError, write_atomically, write_json
from . import checkpoint
from .distributed import Dist

PREVIOUS, OWNER = ".previous-run", ".ssmkit-run.json"
SHARED_WAIT = 10.0  # seconds a rank waits to see the owner file rank 0 wrote (NFS attribute caches)
RUN_FILES = (
    "checkpoints",
    "metrics.jsonl",
    "config.yaml",
)  # what a run writes (and overwrite moves)


class RunDir:
    def __init__(self, out_dir: str | os.PathLike, d: Dist):
        self.path, self.d = Path(out_dir), d
        self.ckpt_dir = self.path / "checkpoints"
        self.lock = DirLock(self.path, "training")
        self.run_id = uuid.uuid4().hex[:12]

    def _agree(self, error: Exception | None, what: str):
        """Raise on every rank when rank 0 hit ``error`` (a collective)."""
        if self.d.any(error is not None):
            raise error or ValueError(f"rank 0 stopped: {what} (see its message)")

    @contextlib.contextmanager
    def hold(self):
        """Rank 0 holds the directory's lock inside this block (re-entrant)."""
        mine, error = False, None
        if self.d.is_main and not self.lock.held:
            try:
                self.lock.acquire()
                mine = True
            except (LockError, OSError) as exc:
                error = exc
        self._agree(error, f"{self.path} is in use")
        try:
            yield
        finally:
            if mine:
                self.lock.release()

    # --- starting a run ---------------------------------------------------------------------------
    def claim(self, resume: bool, overwrite: bool):
        """Make ``out_dir`` this run's: recover what a crash left, then resume, replace or refuse an
        old run."""
        error = None
        if self.d.is_main:
            try:
                self._claim(resume, overwrite)
            except (ValueError, OSError) as exc:
                error = exc
        self._agree(error, f"cannot use {self.path}")
        self._check_shared()

    def _check_shared(self, wait: float = SHARED_WAIT):
        """Refuse an ``out_dir`` that is not one directory for every rank: each rank writes its part
        of every checkpoint there (its DCP shard, its RNG state), so on several machines it must be
        on a filesystem they share (a relative path from another working directory, or a
        machine's own disk, would leave each checkpoint incomplete on rank 0's side). Every rank
        reads the owner file rank 0 has just written, allowing ``wait`` seconds for a network
        filesystem's caches (a collective)."""
        if self.d.world_size == 1:
            return
        expected, deadline = self.d.broadcast(self.run_id), time.monotonic() + wait
        while True:
            try:
                seen = json.loads((self.path / OWNER).read_text()).get("run_id")
            except (OSError, ValueError, AttributeError):
                seen = None
            if seen == expected or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        views = self.d.gather((seen == expected, socket.gethostname()))
        blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
        if blind:
            raise ValueError(
                f"out_dir {self.path} is not the same directory on every rank: "
                f"{', '.join(blind[:4])}{' ...' if len(blind) > 4 else ''} cannot see the run "
                f"rank 0 ({views[0][1]}) started there. Every rank writes its part of each "
                "checkpoint into out_dir, so with several machines it must be on a filesystem "
                "they all share (give an absolute path there)"
            )

    def _claim(self, resume: bool, overwrite: bool):
        for p in self.path.glob(".*.tmp-*"):  # write_atomically's leftovers after a kill
            if p.is_file() and p.name.split(".tmp-")[0].lstrip(".") in (
                "metrics.jsonl",
                "config.yaml",
                OWNER[1:],
            ):
                p.unlink()
        if (self.path / PREVIOUS).is_dir():
            if checkpoint.latest(self.ckpt_dir) is None:
                self.restore_previous(
                    "the run that replaced it stopped before its first checkpoint"
                )
            else:
                # the new run had committed: the old one goes
                shutil.rmtree(self.path / PREVIOUS)
        checkpoint.recover(self.ckpt_dir)
        old = len([p for p in self.ckpt_dir.glob("step_*") if p.is_dir()])
        metrics = self.path / "metrics.jsonl"
        replace = not resume and bool(old or metrics.exists())
        if replace and not overwrite:
            raise ValueError(
                f"{self.path} already holds a run ({old} checkpoints, "
                f"{'a' if metrics.exists() else 'no'} metrics.jsonl): resume it "
                "(--resume, trainer.resume()), replace it (--set overwrite=true) "
                "or pick another out_dir"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        # aside, not deleted: see restore_previous
        if replace:
            aside = self.path / PREVIOUS
            aside.mkdir()
            for name in RUN_FILES:
                if (self.path / name).exists():
                    os.replace(self.path / name, aside / name)
        elif resume and not old:  # resume with nothing to resume: fresh
            metrics.unlink(missing_ok=True)
        write_json(self.path / OWNER, {"run_id": self.run_id, "pid": os.getpid()})

    # --- while it runs ----------------------------------------------------------------------------
    def check_owner(self):
        """Refuse to go on when another Trainer claimed ``out_dir`` after this one (or this one's
        run was undone)."""
        error = None
        if self.d.is_main:
            try:
                owner = json.loads((self.path / OWNER).read_text()).get("run_id")
            except (OSError, ValueError):
                owner = None
            if owner != self.run_id:
                error = ValueError(
                    f"{self.path} no longer belongs to this Trainer: another run claimed it, "
                    "or this run failed before its first checkpoint and the previous run was "
                    "restored. Create a new Trainer"
                )
        self._agree(error, f"{self.path} changed hands")

    def truncate_metrics(self, step: int) -> list[dict]:
        """Drop the metrics lines a resumed run's interrupted predecessor wrote after its checkpoint
        ``step`` (and a line a kill tore in half, with a warning); returns the records kept (rank
        0)."""
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return []
        keep, torn = [], 0
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
                if record["step"] <= step:
                    keep.append(record)
            except (ValueError, KeyError, TypeError):
                torn += 1
        if torn:
            warnings.warn(
                f"{path}: dropped {torn} unreadable line(s) (a run killed while writing)",
                stacklevel=2,
            )
        write_atomically(path, "".join(json.dumps(r) + "\n" for r in keep))
        return keep

    def committed(self):
        """The run's first checkpoint is in: the run it replaced can go (rank 0)."""
        if self.d.is_main and (self.path / PREVIOUS).exists():
            shutil.rmtree(self.path / PREVIOUS)

    def restore_previous(self, why: str) -> bool:
        """Put the overwritten run back (rank 0): the failed run's files go, the previous run's come
        back."""
        aside = self.path / PREVIOUS
        if not self.d.is_main or not aside.is_dir():
            return False
        for name in RUN_FILES:
            target = self.path / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            if (aside / name).exists():
                os.replace(aside / name, target)
        aside.rmdir()
        (self.path / OWNER).unlink(missing_ok=True)
        print(f"{self.path}: restored the run it held before ({why})", flush=True)
        return True
