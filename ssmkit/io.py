"""The base layer: files written whole or not at all, checksums, the cache directory, locks, path
checks.

Every other layer may import this module; it imports nothing of ssmkit. The rules it keeps (each
one has a test that injects the fault):

* a file is written to a temporary sibling, fsynced, then renamed over its name: a reader sees the
  old file or the new one, never half of one (:func:`write_atomically`);
* a directory is built under a temporary name and renamed into place (:func:`build_dir_atomically`);
  new files and directories follow the user's umask (``tempfile.mkdtemp`` alone makes them 0700);
  a temporary directory held by a live process is locked (:class:`TempDir`), so the leftover of a
  killed one is told apart and removed by the next writer (:func:`remove_stale_temp_dirs`);
* a name read from a file ssmkit did not just write (a shard in ``index.json``, the ``latest``
  pointer of a checkpoint, a weight file in a hub index) is a plain file name, never a path
  (:func:`plain_name`); a source and a target of a copy never overlap (:func:`overlapping`);
* two processes never write into one directory at once (:class:`DirLock`: an exclusive lock that the
  operating system drops when its holder dies, so a stale lock is taken over by itself).

Stopping (Ctrl-C, Jupyter's stop button, SIGTERM) says one line: :class:`Stopped` (a
KeyboardInterrupt whose traceback IPython shows as that line); :func:`sigterm_interrupts` makes
SIGTERM stop a block as Ctrl-C does.

Progress bars of every layer (:func:`tqdm_bar`) take the form ``$SSMKIT_PROGRESS`` asks for: the
widget in JupyterLab, plain text lines in a log or a headless notebook, or none.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

LOCK_FILE = ".ssmkit.lock"


# --- where ssmkit keeps its caches ----------------------------------------------------------------


def cache_dir() -> Path:
    """``$SSMKIT_CACHE``, default ``~/.cache/ssmkit`` (tokenizers, prepared shards, verified
    checksums)."""
    return Path(os.environ.get("SSMKIT_CACHE", Path.home() / ".cache" / "ssmkit"))


# --- files and directories written whole ----------------------------------------------------------


def write_atomically(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (str: UTF-8) to a temporary sibling, fsync, then rename over ``path``: readers
    see the old file or the new one, never half of one. The temporary file is removed if writing
    fails (disk full)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | os.PathLike, obj, indent: int | None = 2) -> Path:
    """``obj`` as JSON (plus a newline), written atomically."""
    return write_atomically(path, json.dumps(obj, indent=indent) + "\n")


def read_json(path: str | os.PathLike, what: str = "file"):
    """A JSON file, or ValueError naming it (missing, unreadable, truncated or not JSON)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(
            f"{what} {path} cannot be read ({type(exc).__name__}: {exc}); it is corrupt or "
            "truncated"
        ) from None


def umask() -> int:
    """The process's umask, read without changing it where Linux allows (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def make_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new empty directory under ``parent`` with a unique name starting with ``prefix``, with the
    permissions ``mkdir`` gives under the user's umask (``mkdtemp`` alone would give 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, 0o777 & ~umask())
    return tmp


class TempDir:
    """A temporary directory under ``parent`` named ``{prefix}{pid}-{8 random characters}``, held
    under an exclusive ``flock`` on the directory itself for as long as this object lives (it
    follows the directory through renames; the operating system drops it when the process dies).

    So a later writer tells a leftover of a killed process from one still being written:
    :func:`remove_stale_temp_dirs` removes only directories of exactly this name pattern whose lock
    it can take. ``close()`` drops the lock (the directory, wherever it now is, stays)."""

    def __init__(self, parent: str | os.PathLike, prefix: str):
        self.path = make_temp_dir(parent, f"{prefix}{os.getpid()}-")
        self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def close(self):
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __del__(self):
        self.close()


STALE_AFTER = 60.0  # seconds: younger temp dirs are never removed (their creator may not hold the
# lock yet: mkdtemp and flock are two steps)


def remove_stale_temp_dirs(parent: str | os.PathLike, prefix: str) -> list[Path]:
    """Remove the leftovers of :class:`TempDir` s ``(parent, prefix)`` whose process was killed: the
    directories of exactly that name pattern (``prefix``, a pid, ``-``, 8 random characters), not
    links, owned by this user, older than :data:`STALE_AFTER` seconds, whose lock nobody holds.
    Anything else (another name, a live writer's directory, a directory of ssmkit versions that did
    not lock) is left alone. Returns what was removed; errors removing one are ignored."""
    pattern = re.compile(re.escape(prefix) + r"\d+-[a-z0-9_]{8}")
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if not pattern.fullmatch(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if (
                not entry.is_dir(follow_symlinks=False)
                or st.st_uid != os.getuid()
                or time.time() - st.st_mtime < STALE_AFTER
            ):
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its writer is alive
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def build_dir_atomically(target: str | os.PathLike, write) -> Path:
    """Call ``write(tmp_dir)`` and rename the result to ``target`` (a cache entry): if another
    process finished the same entry first, its copy is kept and ours is dropped. An existing
    ``target`` is returned as is."""
    target = Path(target)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(target.parent, f".{target.name}.tmp-")
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # a concurrent writer finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# --- checksums ------------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> list[str]:
    """:func:`sha256_file` of each path, in order, several at a time: hashlib releases the GIL, so
    threads use every core (up to 8)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_file, paths))


# --- names and paths ------------------------------------------------------------------------------


def plain_name(name, what: str, pattern: str | None = None) -> str:
    """``name`` if it is a plain file name (no directory part, not ``.``/``..``, no NUL) and, with
    ``pattern``, matches that regular expression; else ValueError naming ``what`` held it."""
    ok = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and (pattern is None or re.fullmatch(pattern, name) is not None)
    )
    if not ok:
        expected = f"a name matching {pattern}" if pattern else "a plain file name"
        raise ValueError(
            f"{what} holds {name!r}; expected {expected} (no directories, no '..'): "
            "refusing to read outside its folder"
        )
    return name


def overlapping(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True if ``a`` and ``b`` are the same path or one lies inside the other (symlinks
    resolved)."""
    a, b = Path(a).resolve(), Path(b).resolve()
    return a == b or a in b.parents or b in a.parents


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError a user can act on: which file, and what to do about it (an OSError
    raised with a message only, e.g. :class:`ssmkit.train.checkpoint.CheckpointWriteError`: that
    message)."""
    if exc.errno is None and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return " ".join(exc.args[0].split())
    where = f" {exc.filename}" if exc.filename else ""
    hint = {
        errno.ENOSPC: "the disk is full: free space or choose another directory",
        errno.EDQUOT: "the disk quota is exceeded: free space or choose another directory",
        errno.EROFS: "the file system is read-only: choose a writable directory",
        errno.EACCES: "permission denied: choose a directory you can write to",
        errno.EPERM: "operation not permitted: choose a directory you can write to",
        errno.ENOENT: "no such file or directory",
    }.get(exc.errno, exc.strerror or type(exc).__name__)
    return f"cannot write or read{where}: {hint}"


# --- locks between processes ----------------------------------------------------------------------


class LockError(ValueError):
    """Another process (or another object of this one) holds the directory."""


class DirLock:
    """An exclusive lock on a directory for one ``purpose`` ("training", "data prepare", ...).

        with DirLock(out_dir, "training"):
            ...                                 # no other ssmkit process writes into out_dir now

    The lock is ``flock`` on ``<dir>/.ssmkit.lock``, which records the holder (pid, host, command,
    start time) for the error message. The operating system releases it when the holder exits or is
    killed, so a lock left by a crashed run never blocks the next one. ``wait`` seconds > 0: wait
    for the holder to finish (a cache entry another process is preparing) instead of failing at
    once.
    """

    def __init__(self, directory: str | os.PathLike, purpose: str, wait: float = 0.0):
        self.dir, self.purpose, self.wait = Path(directory), purpose, wait
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _holder(self) -> str:
        try:
            info = json.loads((self.dir / LOCK_FILE).read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        if not info:
            return "another process"
        same = info.get("pid") == os.getpid() and info.get("host") == socket.gethostname()
        who = (
            "this process (another object still holds it: let it finish or delete it)"
            if same
            else f"pid {info.get('pid')} on {info.get('host')}"
        )
        return (
            f"{who}, {info.get('purpose', '?')} since {info.get('started', '?')}: "
            f"{info.get('command', '?')}"
        )

    def acquire(self) -> DirLock:
        if self._fd is not None:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        deadline, told = time.monotonic() + self.wait, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self._holder()
                    os.close(fd)
                    raise LockError(
                        f"{self.dir} is in use by {holder}. "
                        "Two runs must not write into one directory: "
                        "wait for it, stop it, or choose another directory"
                    ) from None
                if not told:
                    print(
                        f"waiting for {self.dir}: in use by {self._holder()}",
                        file=sys.stderr,
                        flush=True,
                    )
                    told = True
                time.sleep(0.2)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "purpose": self.purpose,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self):
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # the file stays (removing it races with a new holder)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            try:
                os.close(self._fd)  # closing the last descriptor drops the lock
            except OSError:
                pass


# --- stopping -------------------------------------------------------------------------------------


class Stopped(KeyboardInterrupt):
    """The user stopped the work (Ctrl-C, Jupyter's stop button, SIGTERM); ``str(exc)`` says in one
    line where it stopped and what was kept ("stopped at step 40; last checkpoint ..."). Still a
    KeyboardInterrupt, so whatever stops on Ctrl-C stops on it; IPython and Jupyter show that line
    alone instead of a traceback (``_render_traceback_``). ``signum``: the signal (a command exits
    128 + signum: 130, 143)."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.signum = int(signum)

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised by :func:`sigterm_interrupts`'s handler."""

    signum = int(signal.SIGTERM)


def _raise_terminated(signum, frame):
    raise _Terminated("SIGTERM")


class sigterm_interrupts:
    """For the block, SIGTERM raises a KeyboardInterrupt (``signum`` 15) as Ctrl-C does, so the
    block cleans up and says one line instead of dying mid-write. Only in the main thread and where
    SIGTERM has its default action (a handler someone installed stays theirs)."""

    def __enter__(self):
        self.previous = None
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        ):
            self.previous = signal.signal(signal.SIGTERM, _raise_terminated)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


class children_ignore_sigint:
    """Processes started in the block ignore SIGINT from their first instruction (an ignored
    signal stays ignored across exec, and Python keeps it so): Ctrl-C, and Jupyter's stop button,
    which signals the kernel's whole process group, are the parent's to handle; it ends its workers,
    which print nothing (not even while they import). Main thread only; elsewhere a no-op, and
    :func:`ignore_sigint` as the workers' initializer does it a little later."""

    def __enter__(self):
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def ignore_sigint() -> None:
    """A worker process's initializer: SIGINT is the parent's to handle (see
    :class:`children_ignore_sigint`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# --- progress bars --------------------------------------------------------------------------------

PROGRESS_ENV = "SSMKIT_PROGRESS"
PROGRESS_MODES = ("auto", "text", "off")
TEXT_INTERVAL = 10.0  # seconds between two lines of a text bar


def progress_mode() -> str:
    """``$SSMKIT_PROGRESS``: "auto" (unset: tqdm.auto, the widget in Jupyter, a redrawn line in a
    terminal), "text" (plain lines on stderr, for logs and headless notebooks) or "off"."""
    value = os.environ.get(PROGRESS_ENV, "").strip().lower() or "auto"
    if value not in PROGRESS_MODES:
        raise ValueError(
            f"{PROGRESS_ENV}={os.environ[PROGRESS_ENV]!r} is not a progress mode; valid: auto "
            "(the default: a widget in Jupyter), text (plain lines: logs, papermill), off"
        )
    return value


class _Lines:
    """The file of a text bar: each redraw becomes a line of its own on the current ``sys.stderr``
    (tqdm redraws one line with carriage returns, which a log file and papermill's log keep as one
    long line)."""

    encoding = "utf-8"

    def write(self, text: str) -> None:
        line = text.replace("\r", "").replace("\n", "").replace("\x1b[A", "").rstrip()
        if line:
            sys.stderr.write(line + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def tqdm_bar(**kw):
    """A tqdm progress bar (``kw``: tqdm's arguments) in the form :func:`progress_mode` chooses:
    "text" is ``tqdm.std`` drawn in ASCII, one line per redraw at most every :data:`TEXT_INTERVAL`
    seconds."""
    mode = progress_mode()
    if mode == "auto":
        from tqdm.auto import tqdm

        return tqdm(**kw)
    from tqdm.std import tqdm

    if mode == "off":
        return tqdm(**{**kw, "disable": True})
    interval = max(TEXT_INTERVAL, kw.get("mininterval", 0))
    return tqdm(
        **{
            **kw,
            "file": _Lines(),
            "ascii": True,
            "ncols": 120,
            "dynamic_ncols": False,
            "mininterval": interval,
            "maxinterval": max(interval, kw.get("maxinterval", 10)),
        }
    )
