"""Launching a distributed training run from a notebook cell: ``ssmkit train --nproc N`` as a
subprocess.

    run = launch_train(cfg, nproc=2, overrides={"strategy": "fsdp"})  # cfg: TrainConfig or YAML
    run["history"], run["final_loss"], run["val_loss"], run["train_tok_s"], run["rank_peak_mem_mb"]

The run is ``python -m ssmkit.cli train --config FILE --nproc N --set key=value ...`` (torchrun's
launcher in that process, one worker process per rank; :mod:`ssmkit.train.cli`). It starts in a
process group of its own, so the notebook's kernel is never part of it. While it runs, every line it
prints (its text progress bar included, ``SSMKIT_PROGRESS=text``) and a line per record it adds to
``out_dir/metrics.jsonl`` (loss, tokens/s; validation loss) appear in the cell as they come.

Stopping: interrupting the cell (Jupyter's stop button, Ctrl-C: KeyboardInterrupt in the kernel)
stops every rank: SIGINT to the launcher's process group (torchrun passes it on to its workers,
which run in sessions of their own), then, after ``grace`` seconds, SIGTERM to the launcher's group
and to every process descended from it, then SIGKILL to what is left; then
:class:`~ssmkit.io.Stopped` (a KeyboardInterrupt) says in one line where the run stopped and its
last checkpoint. A run that fails raises :class:`LaunchError` holding its last error lines (each
rank's one-line message, collected by the launcher). A config that cannot load fails before
anything starts (ValueError).
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import checks
from ..eval import summarize_run
from ..io import Stopped, write_atomically

__all__ = ["LaunchError", "Launch", "launch_train", "process_tree", "train_command"]

TAIL_LINES = 200  # output lines kept for the error message of a failed run
ERROR_LINES = 20  # lines of it the error shows when no rank left its own message
LAUNCH_CONFIG = (
    "launch.yaml"  # a TrainConfig given to launch_train is written here, in the run's out_dir
)


class LaunchError(RuntimeError):
    """A launched run exited with an error; ``returncode``, ``lines`` (its last error lines) and
    ``command`` say which and why."""

    def __init__(self, message: str, returncode: int, lines: list[str], command: list[str]):
        super().__init__(message)
        self.returncode, self.lines, self.command = returncode, lines, command


def _value(value) -> str:
    """``value`` as ``--set`` reads it back (:func:`ssmkit.checks.parse_value`: YAML, of which JSON
    is a subset: 3e-3, true, null, [0.9, 0.95], "text")."""
    return value if isinstance(value, str) else json.dumps(value)


def _set_items(overrides) -> list[str]:
    """``{"lr": 1e-3, "model_overrides": {"d_model": 64}}`` or ``["lr=1e-3"]`` -> ``--set``
    arguments (a nested mapping becomes dotted keys: ``model_overrides.d_model=64``)."""
    if isinstance(overrides, dict):
        items = []
        for key, value in overrides.items():
            if isinstance(value, dict) and key == "model_overrides":
                items += [f"{key}.{k}={_value(v)}" for k, v in value.items()]
            else:
                items.append(f"{key}={_value(value)}")
        return items
    if isinstance(overrides, str):
        raise ValueError(f"overrides must be a mapping or a list of 'key=value'; got {overrides!r}")
    return [str(item) for item in overrides]


def train_command(config_path, nproc: int = 1, sets=(), resume: bool = False) -> list[str]:
    """The command line :func:`launch_train` runs (this Python):
    ``python -m ssmkit.cli train --config PATH [--nproc N] [--set key=value ...] [--resume]``."""
    cmd = [sys.executable, "-m", "ssmkit.cli", "train", "--config", str(config_path)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    for item in sets:
        cmd += ["--set", item]
    return cmd + (["--resume"] if resume else [])


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live process descended from it (children, theirs, ...), parents first.
    Linux reads /proc; elsewhere ``ps``. Processes that are gone are left out."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    if Path("/proc").is_dir():
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
            if fields[0] != "Z":  # a zombie is gone already
                parents[int(fields[1])].append(int(entry.name))
    else:
        out = subprocess.run(
            ["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True
        ).stdout
        for line in out.splitlines():
            child, parent = (int(v) for v in line.split())
            parents[parent].append(child)
    tree, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p == pid and not _alive(p):
            continue
        tree.append(p)
        todo += parents.get(p, [])
    return tree


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Launch:
    """One launched run: :meth:`start`, then :meth:`wait` (streams its output; returns the exit
    status) or :meth:`stop`. :func:`launch_train` is the one-call form. ``show``: print the run's
    lines (and its metrics records) as they come; ``poll``: seconds between looks at
    metrics.jsonl."""

    def __init__(
        self,
        command: list[str],
        out_dir,
        *,
        show: bool = True,
        env: dict | None = None,
        grace: float = 10.0,
        poll: float = 0.5,
    ):
        self.command, self.out_dir, self.show = list(command), Path(out_dir), show
        self.grace = checks.number(grace, "grace", low=0)
        self.poll = checks.number(poll, "poll", low=0, low_open=True)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.seen: set[int] = set()  # every pid of the run seen so far
        self._metrics = (None, 0)  # (inode, offset) of metrics.jsonl read
        self.started = self.seconds = None

    # --- starting and watching --------------------------------------------------------------------
    def start(self) -> Launch:
        metrics = self.out_dir / "metrics.jsonl"
        if metrics.exists():  # an earlier run's lines are not this one's
            st = metrics.stat()
            self._metrics = (st.st_ino, st.st_size)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        if self.show:
            shown = (
                ["python", *self.command[1:]] if self.command[0] == sys.executable else self.command
            )
            print("$ " + " ".join(shown), flush=True)
        return self

    def pids(self) -> list[int]:
        """The run's live processes now (launcher first, then its workers); remembered for
        :meth:`stop`."""
        tree = process_tree(self.proc.pid) if self.proc is not None else []
        self.seen.update(tree)
        return tree

    def _line(self, text: str) -> None:
        text = text.rstrip()
        if text:
            self.tail.append(text)
            if self.show:
                print(text, flush=True)

    def _read_metrics(self) -> None:
        """Show the records added to metrics.jsonl since the last look (whole lines only)."""
        path = self.out_dir / "metrics.jsonl"
        try:
            st = path.stat()
        except OSError:
            return
        inode, offset = self._metrics
        if st.st_ino != inode or st.st_size < offset:  # a new file (an overwritten run): from 0
            offset = 0
        if st.st_size == offset:
            self._metrics = (st.st_ino, offset)
            return
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._metrics = (st.st_ino, offset + len(complete))
        if not self.show:
            return
        for line in complete.decode(errors="replace").splitlines():
            try:
                print(_record_line(json.loads(line)), flush=True)
            except (ValueError, TypeError, KeyError):
                pass

    def wait(self) -> int:
        """Stream the run's output until it exits; its exit status. Any exception while waiting (a
        KeyboardInterrupt from the cell's stop button) stops the run first (:meth:`stop`), then goes
        on."""
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.proc.stdout, selectors.EVENT_READ)
                pending = b""
                while True:
                    ready = sel.select(self.poll)
                    self.pids()
                    self._read_metrics()
                    if not ready:
                        continue
                    data = os.read(self.proc.stdout.fileno(), 65536)
                    if not data:
                        break
                    pending += data
                    *lines, pending = pending.replace(b"\r", b"\n").split(b"\n")
                    for line in lines:
                        self._line(line.decode(errors="replace"))
                self._line(pending.decode(errors="replace"))
            code = self.proc.wait()
            self._read_metrics()
            return code
        except BaseException:
            self.stop()
            raise
        finally:
            self.seconds = time.perf_counter() - self.started
            if self.proc.stdout:
                self.proc.stdout.close()

    # --- stopping ---------------------------------------------------------------------------------
    def stop(self) -> list[int]:
        """Stop every process of the run: SIGINT to the launcher's group (torchrun passes it to the
        ranks), ``grace`` seconds, SIGTERM to all, 5 s, SIGKILL to what is left. Returns the pids it
        found alive (all gone when it returns)."""
        if self.proc is None:
            return []
        found = sorted(set(self.pids()) | {p for p in self.seen if _alive(p)})
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
            except (ProcessLookupError, PermissionError):
                pass
        for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 5.0), (None, 5.0)):
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the launcher when it exits
                self.pids()
                if not any(_alive(p) for p in self.seen):
                    break
                time.sleep(0.05)
            live = [p for p in self.seen if _alive(p)]
            if not live or sig is None:
                break
            if self.show:
                print(
                    f"{len(live)} process(es) of the run still alive after SIGINT: {sig.name}",
                    flush=True,
                )
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            _signal(live, sig)
        self.proc.poll()
        return found

    def error_lines(self) -> list[str]:
        """What the run said about its failure: the launcher's per-rank lines ("rank N: ...") and
        each process's one-line error ("ssmkit train: ..."), else the last lines of its output."""
        lines = list(self.tail)
        start = next((i for i, ln in enumerate(lines) if "processes failed:" in ln), None)
        if start is not None:
            return lines[start : start + 1] + [
                ln for ln in lines[start + 1 :] if ln.startswith("  rank ")
            ]
        own = [ln for ln in lines if ln.startswith("ssmkit train")]
        if own:
            return own[-ERROR_LINES:]
        errors = [i for i, ln in enumerate(lines) if "Error" in ln or "error:" in ln]
        return (
            lines[max(0, errors[-1] - ERROR_LINES + 1) : errors[-1] + 1]
            if errors
            else lines[-ERROR_LINES:]
        )


def _record_line(r: dict) -> str:
    """One metrics.jsonl record as a short progress line."""
    if r["kind"] == "eval":
        return f"  step {r['step']}: validation loss {r['val_loss']:.4f}"
    if r["kind"] == "skip":
        return f"  step {r['step']}: loss {r['loss']}, step skipped"
    extra = f", grad scale {r['grad_scale']:g}" if r.get("grad_scale") is not None else ""
    return (
        f"  step {r['step']}: loss {r['loss']:.4f}, {r['tokens_per_s']:,.0f} tokens/s, "
        f"lr {r['lr']:.2e}{extra}"
    )


def read_history(out_dir) -> list[dict]:
    """The records of ``out_dir/metrics.jsonl`` (a torn last line skipped)."""
    path = Path(out_dir) / "metrics.jsonl"
    records = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def _stopped_line(run_dir: Path, launch: Launch) -> str:
    """Where a launched run stopped by hand was: its last logged step and last checkpoint."""
    from ..train.checkpoint import latest

    steps = [r["step"] for r in read_history(run_dir) if r.get("kind") == "train"]
    where = f"at step {steps[-1]}" if steps else "before its first logged step"
    ckpt = latest(run_dir / "checkpoints")
    kept = (
        f"last checkpoint {ckpt} (resume=True goes on from it)"
        if ckpt is not None
        else "no checkpoint yet"
    )
    return f"stopped the run {where} ({len(launch.seen)} processes, all ended); {kept}"


def launch_train(
    config,
    *,
    nproc: int = 2,
    overrides=(),
    out_dir=None,
    show: bool = True,
    resume: bool = False,
    grace: float = 10.0,
    env: dict | None = None,
) -> dict:
    """Run ``ssmkit train --config ... --nproc nproc`` in a subprocess, show its output live, return
    its metrics.

    config: a :class:`~ssmkit.train.TrainConfig` (written to ``out_dir/launch.yaml`` for the run) or
    the path of a YAML config; overrides: TrainConfig keys (a mapping, or ``"key=value"`` strings)
    passed as ``--set``; out_dir: the run's directory (default: the config's); nproc: processes on
    this machine (1: no torchrun); resume: ``--resume``; grace: seconds the ranks get to stop after
    SIGINT before SIGTERM; env: more environment variables for the run (``SSMKIT_PROGRESS`` defaults
    to "text").

    Returns :func:`ssmkit.eval.summarize_run` of the run's records plus ``history`` (the records of
    metrics.jsonl), ``out_dir``, ``nproc``, ``seconds`` (wall time, launch included) and
    ``command``. Raises ValueError for a config that does not load (nothing is started),
    :class:`LaunchError` when the run fails, and :class:`~ssmkit.io.Stopped` (a KeyboardInterrupt,
    one line: the last step and checkpoint) after stopping every rank when the cell is
    interrupted."""
    from ..train import TrainConfig

    nproc = checks.integer(nproc, "nproc", minimum=1)
    sets = _set_items(overrides)
    if out_dir is not None:
        sets.append(f"out_dir={_value(str(Path(out_dir).resolve()))}")
    if isinstance(config, TrainConfig):
        cfg = TrainConfig.from_dict(config.to_dict(), overrides=sets)
    elif isinstance(config, (str, os.PathLike)):
        cfg = TrainConfig.from_yaml(
            config, overrides=sets
        )  # a bad file or key: here, not in N ranks
    else:
        raise ValueError(
            "config must be a TrainConfig or the path of a YAML config; "
            f"got {type(config).__name__}"
        )
    if nproc > 1 and cfg.strategy == "single":
        raise ValueError(
            f"nproc={nproc} needs strategy ddp or fsdp (overrides={{'strategy': 'ddp'}}); "
            "the config has strategy=single"
        )
    cfg.grad_accum(nproc)  # the batch must divide over the ranks
    run_dir = Path(cfg.out_dir).resolve()
    if isinstance(config, TrainConfig):  # its file, kept beside the run's results
        run_dir.mkdir(parents=True, exist_ok=True)
        path = write_atomically(run_dir / LAUNCH_CONFIG, config.to_yaml())
    else:
        path = Path(config).resolve()
    launch = Launch(
        train_command(path, nproc, sets, resume),
        run_dir,
        show=show,
        grace=grace,
        env={
            "SSMKIT_PROGRESS": os.environ.get("SSMKIT_PROGRESS") or "text",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        },
    )
    try:
        code = launch.start().wait()
    except KeyboardInterrupt as exc:  # every process of the run is gone: say where it stopped
        if isinstance(exc, Stopped):
            raise
        raise Stopped(_stopped_line(run_dir, launch), getattr(exc, "signum", 2)) from None
    if code != 0:
        lines = launch.error_lines()
        raise LaunchError(
            f"the run failed (exit status {code}):\n" + "\n".join(lines),
            code,
            lines,
            launch.command,
        )
    history = read_history(run_dir)
    return {
        **summarize_run(history),
        "history": history,
        "out_dir": run_dir,
        "nproc": nproc,
        "seconds": round(launch.seconds, 1),
        "command": launch.command,
    }
