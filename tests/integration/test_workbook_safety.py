"""ssmkit.workbook's runner when things go wrong: a run directory that holds a run, a hanging cell,
SIGTERM and Ctrl-C, a full or read-only disk, bad inputs. Each test injects the fault and checks
what the user sees (one line, the exit status) and what is left on disk (nothing half-written, no
file of the user's replaced, no kernel left).
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")

from helpers import ROOT, make_notebook  # noqa: E402

from ssmkit import workbook  # noqa: E402
from ssmkit.io import DirLock  # noqa: E402

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # offline: tests/conftest.py sets HF_HUB_OFFLINE=1
REPORT = (
    "import json, pathlib\n"
    "(pathlib.Path(out_dir) / 'metrics.json').write_text(json.dumps({'x': x}))"
)


def sleeper(path: Path, pid_file: Path) -> Path:
    """A notebook whose cell 2 records the kernel's pid in ``pid_file``, then sleeps for 10
    minutes."""
    return make_notebook(
        path,
        "x = 0",
        "import os, pathlib, time\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
        "time.sleep(600)",
    )


def run_main(capsys, *args) -> tuple[int, str]:
    """``ssmkit workbook ARGS`` in this process: (exit status, stderr)."""
    try:
        workbook.main([*map(str, args)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def one_line(stderr: str) -> str:
    assert (
        stderr.startswith("ssmkit workbook: ")
        and stderr.count("\n") == 1
        and "Traceback" not in stderr
    ), stderr
    return stderr


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its bytes (files) and modification time: equal snapshots,
    nothing touched."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.lstat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def alive(pid: int) -> bool:
    """True if process ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_for(path: Path, seconds: float = 120) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.2)
    raise AssertionError(f"{path} was not written within {seconds} s")


# --- 1. a run directory that already holds a run --------------------------------------------------


def test_out_holding_a_run_is_refused_and_left_untouched(tmp_path, capsys):
    nb = make_notebook(tmp_path / "nb" / "01_a.ipynb", "x = 1", REPORT)
    out = tmp_path / "run"
    assert run_main(capsys, "run", nb, "--out", out)[0] == 0
    assert {"summary.json", "summary.md", "01_a.ipynb", "01_a"} <= {p.name for p in out.iterdir()}
    before = snapshot(out)
    code, err = run_main(capsys, "run", nb, "-p", "x", "2", "--out", out)
    assert code == 2 and re.search(
        f"--out {re.escape(str(out))} already holds a run .*--overwrite", one_line(err)
    )
    assert snapshot(out) == before  # a refused run touches nothing
    # any one trace of the run is enough: the summary, the executed copy, or the notebook's out dir
    for keep in ["summary.json", "01_a.ipynb", "01_a"]:
        partial = tmp_path / f"partial-{keep}"
        partial.mkdir()
        (partial / workbook.RECORD).write_bytes((out / workbook.RECORD).read_bytes())
        os.rename(out / keep, partial / keep)
        before = snapshot(partial)
        code, err = run_main(capsys, "run", nb, "--out", partial)
        assert code == 2 and re.search(
            f"already holds a run \\({keep}\\): pass --overwrite", one_line(err)
        ), err
        assert snapshot(partial) == before, keep
        os.rename(partial / keep, out / keep)


def test_overwrite_replaces_the_runs_files_only_and_never_reports_stale_metrics(tmp_path, capsys):
    nb = make_notebook(
        tmp_path / "nb" / "01_a.ipynb",
        "x = 1\nfail = False",
        "assert not fail, 'asked to fail'",
        REPORT,
    )
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")  # a folder holding other files is fine
    assert run_main(capsys, "run", nb, "--out", out)[0] == 0
    (out / "01_a" / "mine.txt").write_text("also the user's")
    first = json.loads((out / "summary.json").read_text())["notebooks"][0]
    assert first["metrics"] == {"x": 1}

    # the rerun fails before writing metrics.json: the summary must not show the first run's x=1
    code, err = run_main(capsys, "run", nb, "-p", "fail", "true", "--out", out, "--overwrite")
    assert code == 1, err
    (entry,) = json.loads((out / "summary.json").read_text())["notebooks"]
    assert entry["status"] == "failed" and "asked to fail" in entry["error"]
    assert entry["metrics"] == {} and entry["metrics_file"] is None
    assert "| x |" not in (out / "summary.md").read_text()  # no metrics table: none were written

    assert run_main(capsys, "run", nb, "-p", "x", "2", "--out", out, "--overwrite")[0] == 0
    (entry,) = json.loads((out / "summary.json").read_text())["notebooks"]
    assert entry["status"] == "ok" and entry["metrics"] == {"x": 2}
    assert "x = 2" in (out / "01_a.ipynb").read_text()  # the executed copy is this run's
    assert (out / "notes.txt").read_text() == "the user's"
    assert (out / "01_a" / "mine.txt").read_text() == "also the user's"


def test_files_no_run_wrote_are_never_replaced(tmp_path, capsys):
    nb = make_notebook(tmp_path / "nb" / "01_a.ipynb", "x = 1", REPORT)
    # --out is the notebook's own folder: the executed copy would overwrite the notebook itself
    before = snapshot(tmp_path / "nb")
    for extra in [[], ["--overwrite"]]:
        code, err = run_main(capsys, "run", nb, "--out", tmp_path / "nb", *extra)
        assert code == 2 and re.search(
            r"01_a.ipynb exists and was not written by `ssmkit workbook run`", one_line(err)
        ), err
        assert snapshot(tmp_path / "nb") == before
    # a user's summary.md, or folder named like a notebook's out dir, in an otherwise fresh
    # directory
    for name, make in [
        ("summary.md", lambda p: p.write_text("my summary")),
        ("01_a", lambda p: p.mkdir()),
    ]:
        out = tmp_path / f"out-{name}"
        out.mkdir()
        make(out / name)
        before = snapshot(out)
        code, err = run_main(capsys, "run", nb, "--out", out, "--overwrite")
        assert code == 2 and "not written by" in one_line(err) and snapshot(out) == before
    # an executed copy of a real run, replaced by a link to a user's file: not replaced through the
    # link
    out = tmp_path / "run"
    assert run_main(capsys, "run", nb, "--out", out)[0] == 0
    precious = tmp_path / "precious.ipynb"
    precious.write_text("{}")
    (out / "01_a.ipynb").unlink()
    (out / "01_a.ipynb").symlink_to(precious)
    code, err = run_main(capsys, "run", nb, "--out", out, "--overwrite")
    assert code == 2 and "not written by" in one_line(err) and precious.read_text() == "{}"


def test_a_directory_another_run_is_writing_is_refused(tmp_path, capsys):
    nb = make_notebook(tmp_path / "01_a.ipynb", "x = 1", REPORT)
    with DirLock(tmp_path / "run", "workbook run"):
        code, err = run_main(capsys, "run", nb, "--out", tmp_path / "run")
    assert code == 2 and "is in use by" in one_line(err)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".ssmkit.lock"]


# --- 2. a cell that never ends --------------------------------------------------------------------


def test_cell_timeout_default_env_and_cli(tmp_path, capsys, monkeypatch):
    """The timeout papermill gets: 3600 s by default, $SSMKIT_CELL_TIMEOUT,
    --cell-timeout (whole seconds, 0: none)."""
    import papermill

    seen = []
    monkeypatch.setattr(
        papermill, "execute_notebook", lambda *a, **kw: seen.append(kw["execution_timeout"])
    )
    nb = make_notebook(tmp_path / "01_a.ipynb", "x = 1", "pass")
    monkeypatch.delenv("SSMKIT_CELL_TIMEOUT", raising=False)
    cases = [
        ({}, [], 3600),
        ({"SSMKIT_CELL_TIMEOUT": "120"}, [], 120),
        ({"SSMKIT_CELL_TIMEOUT": "0"}, [], None),
        ({"SSMKIT_CELL_TIMEOUT": "120"}, ["--cell-timeout", "0"], None),
        ({}, ["--cell-timeout", "2.5"], 3),
    ]
    for i, (env, args, expected) in enumerate(cases):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        code, err = run_main(capsys, "run", nb, "--out", tmp_path / f"run{i}", *args)
        assert code == 0 and seen[-1] == expected, (env, args, seen, err)
        assert (
            json.loads((tmp_path / f"run{i}" / "summary.json").read_text())["cell_timeout"]
            == expected
        )
        monkeypatch.delenv("SSMKIT_CELL_TIMEOUT", raising=False)
    for env, args, what in [
        ({}, ["--cell-timeout", "soon"], "--cell-timeout"),
        ({}, ["--cell-timeout", "-1"], "--cell-timeout"),
        ({"SSMKIT_CELL_TIMEOUT": "an hour"}, [], "SSMKIT_CELL_TIMEOUT"),
    ]:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        code, err = run_main(capsys, "run", nb, "--out", tmp_path / "bad", *args)
        assert code == 2 and f"{what} must be a number of seconds >= 0 (0: no limit)" in one_line(
            err
        )
        assert not (tmp_path / "bad").exists()
        monkeypatch.delenv("SSMKIT_CELL_TIMEOUT", raising=False)


def test_timed_out_cell_is_reported_and_its_kernel_is_gone(tmp_path):
    pid_file = tmp_path / "kernel.pid"
    nb = sleeper(tmp_path / "01_hang.ipynb", pid_file)
    after = make_notebook(tmp_path / "02_after.ipynb", "x = 7", REPORT)
    summary = workbook.run_workbook([nb, after], out=tmp_path / "run", cell_timeout=3)
    hang, rest = summary["notebooks"]
    assert (
        hang["status"] == "failed"
        and hang["cell"] == 2
        and hang["error"].startswith("timeout after 3 s")
    )
    assert rest["status"] == "ok" and rest["metrics"] == {"x": 7}  # the run went on
    assert not alive(int(pid_file.read_text()))
    md = (tmp_path / "run" / "summary.md").read_text()
    assert "## 01_hang.ipynb failed" in md and "Cell 2 " in md and "time.sleep(600)" in md
    assert "timeout after 3 s" in md


def test_slurm_script_passes_an_explicit_cell_timeout(tmp_path):
    """scripts/slurm/workbook.sbatch run with stand-ins for conda, nvidia-smi, python and ssmkit."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ["conda", "nvidia-smi", "python"]:
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "ssmkit").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'args'}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_JOB_ID": "42",
    }
    env.pop("SSMKIT_CELL_TIMEOUT", None)

    def args(*extra, **more):
        res = subprocess.run(
            ["bash", str(ROOT / "scripts" / "slurm" / "workbook.sbatch"), *extra],
            env={**env, **more},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        return (tmp_path / "args").read_text().splitlines()

    got = args("nb.ipynb", "p.yaml", "-p", "seed", "1")
    assert got[got.index("--cell-timeout") + 1] == "0"  # a training cell may run for days
    assert got[got.index("--out") + 1] == "runs/slurm-42" and got[-3:] == ["-p", "seed", "1"]
    got = args(SSMKIT_CELL_TIMEOUT="7200", SLURM_RESTART_COUNT="1")
    assert got[got.index("--cell-timeout") + 1] == "7200"
    assert (
        got[got.index("--out") + 1] == "runs/slurm-42-restart1"
    )  # a requeued job keeps the first run


# --- 3. SIGTERM and SIGINT ------------------------------------------------------------------------


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_interrupts_the_kernel_and_writes_the_summary(tmp_path, signum, status):
    pid_file = tmp_path / "kernel.pid"
    nb = sleeper(tmp_path / "01_sleep.ipynb", pid_file)
    later = make_notebook(tmp_path / "02_later.ipynb", "x = 1", REPORT)
    out = tmp_path / "run"
    # under SIGTERM, also check that an ignored SIGINT (a background job of a script: `cmd &`) stays
    # ignored
    ignore_int = signum == signal.SIGTERM
    # the child starts as a foreground command would: SIGINT at its default (a child inherits an
    # ignored SIGINT, and a long test session's process may have one), or ignored on purpose under
    # SIGTERM
    disposition = signal.SIG_IGN if ignore_int else signal.SIG_DFL
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssmkit.cli", "workbook", "run", nb, later, "--out", out],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        preexec_fn=lambda: signal.signal(signal.SIGINT, disposition),
    )
    try:
        kernel = int(wait_for(pid_file))  # the cell is running
        if ignore_int:
            proc.send_signal(signal.SIGINT)
            time.sleep(2)
            assert proc.poll() is None and alive(kernel)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    name = signal.Signals(signum).name
    assert proc.returncode == status, stdout + stderr
    assert stderr == f"ssmkit workbook: interrupted by {name}; summary: {out / 'summary.md'}\n", (
        stderr
    )
    assert not alive(kernel)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] == name
    sleeping, not_run = summary["notebooks"]
    assert sleeping["status"] == "interrupted" and sleeping["error"] == f"interrupted by {name}"
    assert sleeping["cell"] == 2 and "time.sleep(600)" in sleeping["source"]
    assert (
        not_run["status"] == "not run"
        and not_run["seconds"] is None
        and not (out / "02_later.ipynb").exists()
    )
    md = (out / "summary.md").read_text()
    assert f"0 ok, 0 failed, 1 interrupted, 1 not run. Interrupted by {name}." in md
    assert re.search(r"\| 01_sleep.ipynb \| interrupted \|", md) and re.search(
        r"\| 02_later.ipynb \| not run \|", md
    )
    assert "## 01_sleep.ipynb interrupted" in md and "Cell 2 " in md


# --- 4. a full or read-only disk ------------------------------------------------------------------


def test_out_that_cannot_be_created_gives_one_line(tmp_path, capsys, monkeypatch):
    nb = make_notebook(tmp_path / "01_a.ipynb", "x = 1", REPORT)
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep")
    code, err = run_main(capsys, "run", nb, "--out", a_file / "run")
    assert code == 2 and f"cannot write or read {a_file / 'run'}: Not a directory" in one_line(err)
    code, err = run_main(capsys, "run", nb, "--out", a_file)
    assert (
        code == 2
        and "is a file; expected a directory" in one_line(err)
        and a_file.read_text() == "keep"
    )

    # a read-only file system (emulated: root may write anywhere): every create under it fails with
    # EROFS
    ro = tmp_path / "ro"
    real_mkdir, real_open = os.mkdir, os.open

    def refuse(real):
        def call(path, *args, **kwargs):
            if str(path).startswith(str(ro)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "mkdir", refuse(real_mkdir))
    monkeypatch.setattr(os, "open", refuse(real_open))
    code, err = run_main(capsys, "run", nb, "--out", ro / "run")
    assert code == 2 and "the file system is read-only: choose a writable directory" in one_line(
        err
    )
    assert not ro.exists()


def test_disk_full_while_writing_the_summary(tmp_path, capsys, monkeypatch):
    nb = make_notebook(tmp_path / "01_a.ipynb", "x = 1", REPORT)
    out = tmp_path / "run"
    real_fsync = os.fsync

    def fsync(fd):  # the disk fills up just as the summary is written
        if "summary" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    code, err = run_main(capsys, "run", nb, "--out", out)
    assert code == 1 and "the disk is full: free space or choose another directory" in one_line(err)
    left = sorted(p.name for p in out.iterdir())
    assert left == [".ssmkit-workbook.json", ".ssmkit.lock", "01_a", "01_a.ipynb"], (
        left
    )  # no half summary


# --- bad inputs -----------------------------------------------------------------------------------


def test_bad_inputs_give_one_line(tmp_path, capsys, monkeypatch):
    nb = make_notebook(tmp_path / "01_a.ipynb", "x = 1", REPORT)
    not_nb = tmp_path / "02_list.ipynb"
    not_nb.write_text("[]")
    binary, multi = tmp_path / "binary.yaml", tmp_path / "multi.yaml"
    binary.write_bytes(b"\xff\xfe\x00x: 1")
    multi.write_text("x: 1\n  y: [2\n")
    record = tmp_path / "bad-record"
    record.mkdir()
    (record / workbook.RECORD).write_text('{"written": 3}')
    out = tmp_path / "run"
    cases = [
        (["run", nb, "-f", tmp_path], "params file .* is not a file; expected a YAML file"),
        (["run", nb, "-f", binary], "params file .*binary.yaml is not valid YAML"),
        (["run", nb, "-f", multi], "params file .*multi.yaml is not valid YAML"),
        (["run", tmp_path], "is a directory; pass notebook files"),
        (["run", not_nb], "02_list.ipynb is not a notebook: expected a JSON object"),
        (["strip", not_nb], "02_list.ipynb is not a notebook"),
        (
            ["run", nb, "--kernel", "no-such-kernel"],
            "no Jupyter kernel named 'no-such-kernel'; installed: ",
        ),
        (["run", nb, "--out", record], "run record .* is not readable"),
    ]
    for args, message in cases:
        code, err = run_main(
            capsys, *args, *(["--out", out] if args[0] == "run" and "--out" not in args else [])
        )
        assert code == 2 and re.search(message, one_line(err)), (args, err)
        assert not out.exists()
    monkeypatch.setitem(sys.modules, "papermill", None)  # the workbook extra is not installed
    code, err = run_main(capsys, "run", nb, "--out", out)
    assert code == 2 and "papermill is not installed: pip install 'ssmkit[workbook]'" in one_line(
        err
    )
    assert not out.exists()


def _laughs(top_is_list: bool) -> str:
    """A "billion laughs" YAML document: nine aliases of nine aliases ... of nine words (9**9
    strings when expanded), as the top-level list or under a parameter's name."""
    indent = "- " if top_is_list else "  - "
    lines, prev = [indent + "&a [" + ",".join(["lol"] * 9) + "]"], "a"
    for name in "bcdefghi":
        lines.append(f"{indent}&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = name
    return ("" if top_is_list else "x:\n") + "\n".join(lines) + "\n"


@pytest.mark.parametrize("top_is_list", [True, False], ids=["top-level-list", "a-parameter"])
def test_a_params_file_of_nested_aliases_is_refused_at_once(tmp_path, capsys, top_is_list):
    """Fault injected: a params file whose aliases expand to 9**9 values (before: the error message
    built the whole repr, or papermill the whole value -- a hang)."""
    nb = make_notebook(tmp_path / "01_a.ipynb", "x = 1", REPORT)
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(_laughs(top_is_list))
    start = time.monotonic()
    code, err = run_main(capsys, "run", nb, "-f", laughs, "--out", tmp_path / "run")
    assert time.monotonic() - start < 2
    assert code == 2 and re.fullmatch(
        r"ssmkit workbook: params file .*laughs.yaml is not valid YAML: the document expands to "
        r"more than 100,000 values through its &anchors and \*aliases .*",
        one_line(err).strip(),
    ), err
    assert not (tmp_path / "run").exists()


def test_a_params_file_that_is_no_mapping_is_shown_short(tmp_path):
    """A long list at the top: the message shows its type and a few items, never all of them."""
    listed = tmp_path / "list.yaml"
    listed.write_text("".join(f"- [{i}, {i}, {i}, {i}, {i}, {i}]\n" for i in range(5000)))
    with pytest.raises(workbook.WorkbookError) as err:
        workbook.load_params_file(listed)
    message = str(err.value)
    assert "must be a mapping of parameter names to values; got a list: [[0, 0, 0, 0, ...]" in (
        message
    )
    assert len(message) < 300 and "\n" not in message


def test_a_kernel_s_log_after_a_timeout_is_dropped_and_before_it_kept(tmp_path, capfd):
    """Fault injected: the kernel logs an error as it exits, as ipykernel's ZMQ teardown does after
    a cell timeout (before: that traceback reached the terminal under ssmkit's clean report). What
    the kernel logged while it ran is still shown."""
    nb = make_notebook(
        tmp_path / "01_hang.ipynb",
        "x = 1",
        "import atexit\n"
        "from ipykernel.kernelapp import IPKernelApp\n"
        "log = IPKernelApp.instance().log\n"
        "log.error('KEPT: written while the kernel ran')\n"
        "atexit.register(lambda: log.error('zmq.error.ZMQError: Socket operation on non-socket'))",
        "import time; time.sleep(600)",
    )
    with pytest.raises(SystemExit):
        workbook.main(["run", str(nb), "--out", str(tmp_path / "run"), "--cell-timeout", "1"])
    err = capfd.readouterr().err
    assert "KEPT: written while the kernel ran" in err
    assert "ZMQError" not in err and "Traceback" not in err, err
    assert err.rstrip().endswith("ssmkit workbook: 1 of 1 notebook(s) failed")
