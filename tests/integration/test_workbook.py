"""ssmkit.workbook's headless runner (``ssmkit workbook run``), on small throwaway notebooks.

The runner is exercised as a user would: ``python -m ssmkit.cli workbook run ...`` in a subprocess.
The oracles are the notebooks themselves: each writes the parameter values and interpreter it saw to
its metrics.json, so the summary can be checked against what actually ran.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")

from helpers import make_notebook  # noqa: E402

from ssmkit import workbook  # noqa: E402

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # offline: tests/conftest.py sets HF_HUB_OFFLINE=1
REPORT = (
    "import json, pathlib, sys\n"
    "(pathlib.Path(out_dir) / 'metrics.json')"
    ".write_text(json.dumps({{k: globals()[k] for k in {names!r}}} "
    "| {{'python': sys.executable}}))"
)


def report(*names: str) -> str:
    """A cell that writes the given variables (and the kernel's interpreter) to
    out_dir/metrics.json."""
    return REPORT.format(names=list(names))


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "ssmkit.cli", "workbook", *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=cwd,
        timeout=300,
    )


# --- running --------------------------------------------------------------------------------------


def test_failing_notebook_is_reported_and_the_others_still_run(tmp_path):
    a = make_notebook(tmp_path / "nb" / "01_a.ipynb", "x = 1", report("x"))
    b = make_notebook(
        tmp_path / "nb" / "02_b.ipynb",
        "y = 2",
        "z = y * 3",
        "raise ValueError(f'boom {z}')",
        "never = 1",
    )
    c = make_notebook(tmp_path / "nb" / "03_c.ipynb", "x = 5", report("x"))
    out = tmp_path / "run"
    res = cli("run", a, b, c, "--out", out)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "1 of 3 notebook(s) failed" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    status = {Path(e["notebook"]).name: e for e in summary["notebooks"]}
    assert [e["status"] for e in summary["notebooks"]] == ["ok", "failed", "ok"]
    failed = status["02_b.ipynb"]
    # cell 3 of the original notebook (markdown, parameters, z = ..., raise): the injected cell is
    # not counted
    assert failed["cell"] == 3 and failed["error"] == "ValueError: boom 6"
    assert "raise ValueError" in failed["source"]
    # ran after the failure, with its own defaults
    assert status["03_c.ipynb"]["metrics"]["x"] == 5
    md = (out / "summary.md").read_text()
    assert re.search(r"\| 02_b.ipynb \| failed \|", md) and re.search(r"\| 03_c.ipynb \| ok \|", md)
    assert (
        "## 03_c.ipynb\n\n| metric | value | unit |\n|---|---|---|\n| x | 5 | – |" in md
    )  # metrics table
    assert "## 02_b.ipynb failed" in md and "Cell 3" in md and "ValueError: boom 6" in md
    assert "raise ValueError(f'boom {z}')" in md
    # a line per code cell as it ends, the failing one marked
    assert re.search(r"^  02_b \[3/5\] cell 'z = y \* 3' \d+\.\d s$", res.stdout, re.M), res.stdout
    assert re.search(
        r"^  02_b \[4/5\] cell \"raise ValueError\(f'boom \{z\}'\)\" \d+\.\d s \(error\)$",
        res.stdout,
        re.M,
    ), res.stdout
    assert "never = 1" not in res.stdout
    executed = nbformat.read(
        out / "02_b.ipynb", as_version=4
    )  # the executed copy keeps the traceback
    assert any(
        o.get("ename") == "ValueError" for cell in executed.cells for o in cell.get("outputs", [])
    )
    # the kernel is this interpreter (whatever `python3` kernel spec the user has)
    assert (
        Path(status["01_a.ipynb"]["metrics"]["python"]).resolve() == Path(sys.executable).resolve()
    )


def test_params_file_and_overrides(tmp_path):
    """Each notebook gets the keys it declares; one that declares `overrides` (it trains) also gets
    the TrainConfig keys it does not declare, merged into its overrides; -p wins over -f."""
    params_a = (
        "lr = 0.1\nname = 'a'\nflag = False\nsteps = 3\noverrides = {'seed': 5, 'micro_batch': 1}"
    )
    a = make_notebook(
        tmp_path / "01_a.ipynb", params_a, report("lr", "name", "flag", "steps", "overrides")
    )
    b = make_notebook(tmp_path / "02_b.ipynb", "lr = 0.5\nother = 1", report("lr", "other"))
    make_notebook(
        tmp_path / "03_c.ipynb", "knob = 1", "pass"
    )  # not run: a file for the workbook is fine
    params = tmp_path / "p.yaml"
    params.write_text(
        "lr: 3.0e-3\nname: from-file\nother: 2\nmicro_batch: 4\nwarmup_steps: 1\nknob: 2\n"
    )
    out = tmp_path / "run"
    res = cli(
        "run",
        a,
        b,
        "-f",
        params,
        "-p",
        "name",
        "cli",
        "-p",
        "flag",
        "true",
        "-p",
        "steps",
        "1e3",
        "-p",
        "warmup_steps",
        "7",
        "--out",
        out,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((out / "summary.json").read_text())
    ea, eb = summary["notebooks"]
    ma = json.loads(Path(ea["metrics_file"]).read_text())  # all of it (the summary keeps scalars)
    # lr is a parameter of 01_a: it goes there, not into overrides; the notebook's own overrides
    # stay
    assert ma == {
        "lr": 0.003,
        "name": "cli",
        "flag": True,
        "steps": 1000.0,
        "python": ma["python"],
        "overrides": {"seed": 5, "micro_batch": 4, "warmup_steps": 7},
    }
    mb = eb["metrics"]
    assert mb["lr"] == 0.003 and mb["other"] == 2  # each notebook gets the keys it declares
    assert ea["unused_shared"] == ["knob", "other"]
    assert eb["unused_shared"] == ["knob", "micro_batch", "name", "warmup_steps"]
    # out_dir defaults to runs/NAME/<stem>/
    assert Path(eb["metrics_file"]) == (out / "02_b" / "metrics.json").resolve()
    md = (out / "summary.md").read_text()
    assert "02_b.ipynb ignores: knob, micro_batch, name, warmup_steps" in md
    assert (
        "01_a.ipynb trains with overrides: `{'seed': 5, 'micro_batch': 4, 'warmup_steps': 7}`" in md
    )
    assert (
        "[2/2] 02_b.ipynb ... (not used here: knob, micro_batch, name, warmup_steps)" in res.stdout
    )


def test_bad_inputs_give_clear_errors(tmp_path, capsys):
    nb = make_notebook(tmp_path / "01_a.ipynb", "lr = 0.1", "pass")
    out = tmp_path / "run"
    cases = [
        (["run", tmp_path / "missing.ipynb"], "notebook .*missing.ipynb does not exist"),
        (["run", nb, "-f", tmp_path / "nope.yaml"], "params file .*nope.yaml does not exist"),
        (
            ["run", nb, "-p", "lrr", "1"],
            "parameter\\(s\\) lrr not declared by any notebook .*declared: lr, out_dir",
        ),
        (["run", nb, "-p", "bad-name", "1"], "must be a Python identifier"),
        # a TrainConfig key, but no notebook of the run trains (declares overrides)
        (
            ["run", nb, "-p", "micro_batch", "4"],
            "parameter\\(s\\) micro_batch not declared by any notebook",
        ),
        (["run", nb, "-p", "out_dir", ""], "out_dir must be a non-empty path"),
    ]
    stray, bad_override = tmp_path / "stray.yaml", tmp_path / "override.yaml"
    stray.write_text("lr: 0.2\nmicro_batch: 4\nmicro_bacth: 4\n")
    trains = make_notebook(tmp_path / "02_t.ipynb", "seed = 0\nevals = 2\noverrides = {}", "pass")
    bad_override.write_text("overrides: {lrr: 1}\n")
    cases += [
        # not declared by any notebook of the workbook (this folder's NN_*.ipynb) nor a TrainConfig
        # key
        (
            ["run", nb, "-f", stray],
            "params file key\\(s\\) micro_bacth: not a parameter of any notebook "
            "\\(evals, lr, out_dir, overrides, seed\\) nor a TrainConfig key",
        ),
        (
            ["run", trains, "-f", bad_override],
            "02_t.ipynb: overrides: unknown TrainConfig key\\(s\\) lrr; ",
        ),
        (
            ["run", trains, "-p", "overrides", "{seed: 1}"],
            "overrides: seed is a parameter of this notebook",
        ),
        (
            ["run", trains, "-p", "eval_every", "3"],
            "this notebook sets eval_every from its parameter evals",
        ),
        (
            ["run", nb, trains, "-p", "overrides", "[1]"],
            "overrides must be a mapping of TrainConfig keys",
        ),
    ]
    bad_yaml, a_list = tmp_path / "bad.yaml", tmp_path / "list.yaml"
    bad_yaml.write_text("lr: [1, 2\n")
    a_list.write_text("- 1\n- 2\n")
    cases += [
        (["run", nb, "-f", bad_yaml], "is not valid YAML"),
        (["run", nb, "-f", a_list], "must be a mapping"),
    ]
    for args, message in cases:  # in-process: the same main() the CLI calls
        with pytest.raises(SystemExit) as exit_:
            workbook.main([*map(str, args), "--out", str(out)])
        stderr = capsys.readouterr().err
        assert exit_.value.code == 2 and re.search(message, stderr), (args, stderr)
        assert stderr.startswith("ssmkit workbook: ") and "Traceback" not in stderr
        assert not out.exists()  # nothing ran, nothing written
    with pytest.raises(
        workbook.WorkbookError, match="no notebooks matching NN_\\*.ipynb in .*empty"
    ):
        workbook.find_notebooks(tmp_path / "empty")


def test_default_notebooks_in_order_and_timestamped_run(tmp_path):
    make_notebook(tmp_path / "notebooks" / "10_b.ipynb", "x = 2", report("x"))
    make_notebook(tmp_path / "notebooks" / "02_a.ipynb", "x = 1", report("x"))
    make_notebook(
        tmp_path / "notebooks" / "scratch.ipynb",
        "x = 3",
        "raise RuntimeError('not part of the run')",
    )
    res = cli("run", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", run.name)
    summary = json.loads((run / "summary.json").read_text())
    assert [Path(e["notebook"]).name for e in summary["notebooks"]] == ["02_a.ipynb", "10_b.ipynb"]
    assert f"summary: runs/{run.name}/summary.md" in res.stdout


def test_notebooks_run_in_their_own_folder(tmp_path):
    """As in JupyterLab: relative paths in a notebook start at its folder."""
    nb = make_notebook(
        tmp_path / "nbs" / "01_a.ipynb", "x = 0", "import os\ncwd = os.getcwd()", report("cwd")
    )
    summary = workbook.run_workbook([nb], out=tmp_path / "run")
    assert summary["failed"] == 0
    metrics = json.loads(Path(summary["notebooks"][0]["metrics_file"]).read_text())
    assert Path(metrics["cwd"]).resolve() == (tmp_path / "nbs").resolve()


def test_cell_timeout_fails_the_notebook(tmp_path):
    slow = make_notebook(tmp_path / "01_slow.ipynb", "x = 0", "import time\ntime.sleep(60)")
    summary = workbook.run_workbook([slow], out=tmp_path / "run", cell_timeout=2)
    (entry,) = summary["notebooks"]
    assert (
        entry["status"] == "failed"
        and entry["error"].startswith("timeout after 2 s")
        and entry["seconds"] < 30
    ), entry
    # markdown, parameters, the slow cell
    assert entry["cell"] == 2 and "time.sleep(60)" in entry["source"]
    md = (tmp_path / "run" / "summary.md").read_text()
    assert "## 01_slow.ipynb failed" in md and "Cell 2 " in md and "timeout after 2 s" in md


def test_summary_units_figures_slow_warning_and_kernel_env(tmp_path, monkeypatch):
    """summary.md: metrics as a table with units, links to the figures this run wrote (not an older
    one), a warning for a CPU run far over the notebook's stated CPU time; the kernel gets
    SSMKIT_PROGRESS=text."""
    monkeypatch.setenv("SSMKIT_PROGRESS", "unset below")  # restored after the test
    monkeypatch.delenv("SSMKIT_PROGRESS")
    nb = make_notebook(
        tmp_path / "nb" / "01_slow.ipynb",
        "device = 'cpu'",
        "import json, os, pathlib, time\ntime.sleep(1.5)\nout = pathlib.Path(out_dir)\n"
        "(out / 'curve.png').write_bytes(b'png')\n"
        "metrics = {'val_loss': 3.25, 'train_tok_s': 1234, 'params': 7000000,\n"
        "           'val_ppl': 25.8, 'progress': os.environ.get('SSMKIT_PROGRESS')}\n"
        "(out / 'metrics.json').write_text(json.dumps(metrics))",
    )
    book = nbformat.read(nb, as_version=4)
    book.metadata["ssmkit"] = {"cpu_seconds": 0.1}
    nbformat.write(book, nb)
    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "old.png").write_bytes(b"png")
    os.utime(figs / "old.png", (1e9, 1e9))  # an earlier run's figure
    summary = workbook.run_workbook(
        [nb], parameters={"device": "cpu", "out_dir": str(figs)}, out=tmp_path / "run", quiet=True
    )
    (entry,) = summary["notebooks"]
    assert entry["status"] == "ok" and entry["cpu_seconds"] == 0.1, entry
    assert (
        entry["warning"].startswith("01_slow.ipynb ran ")
        and "x its stated CPU time (~0.1 s" in entry["warning"]
    )
    assert entry["figures"] == [str(figs / "curve.png")]
    md = (tmp_path / "run" / "summary.md").read_text()
    assert re.search(r"\| 01_slow.ipynb \| ok \| [\d.]+ \| ~0.1 \|", md)
    assert f"> **Warning**: {entry['warning']}." in md
    for row in [
        "| val_loss | 3.25 | nats/token |",
        "| train_tok_s | 1,234 | tokens/s |",
        "| params | 7,000,000 | parameters |",
        "| val_ppl | 25.8 | – |",
        "| progress | text | – |",
    ]:
        assert row in md, row
    assert (
        "Figures: [curve.png](../figs/curve.png)" in md and "old.png" not in md
    )  # relative to summary.md


MIB = 2**20


def test_peak_rss_of_the_kernel_and_its_children(tmp_path, capsys):
    """Each notebook's peak RSS is recorded (summary.json, summary.md's column, the terminal line):
    200 MiB allocated and freed again in the kernel (between two samples: the kernel's high-water
    mark catches it) and 200 MiB held by a child process for 1.5 s each show as 200 MiB more than a
    notebook that allocates nothing, within 40 MiB (allocator slack, an imported module). What the
    kernel still holds after its last cell is recorded too: 200 MiB more for a notebook that keeps
    its allocation, nothing more for one that freed it."""
    spend = "import subprocess, sys, time\nb = b'1' * (200 * 2**20)\ndel b"
    child = (
        "import subprocess, sys\nsubprocess.run([sys.executable, '-c', "
        "'import time; b = bytes(1) * (200 * 2**20); time.sleep(1.5)'], check=True)"
    )
    paths = [
        make_notebook(tmp_path / "nb" / f"{name}.ipynb", "x = 1", cell)
        for name, cell in [
            ("01_idle", "import subprocess, sys, time"),
            ("02_spend", spend),
            ("03_child", child),
            ("04_hold", "b = b'1' * (200 * 2**20)"),
        ]
    ]
    summary = workbook.run_workbook(paths, out=tmp_path / "run", quiet=True)
    assert [e["status"] for e in summary["notebooks"]] == ["ok"] * 4, summary
    recorded = json.loads((tmp_path / "run" / "summary.json").read_text())
    idle, spend, child, hold = (e["peak_rss_mb"] for e in recorded["notebooks"])
    held = {Path(e["notebook"]).stem: e["held_rss_mb"] for e in recorded["notebooks"]}
    assert abs(held["04_hold"] - held["01_idle"] - 200) < 40, held  # kept after its last cell
    assert held["02_spend"] - held["01_idle"] < 40, held  # freed before the end
    assert abs(hold - spend) < 40, (hold, spend)
    assert 20 < idle < 400, idle  # a Python with IPython loaded
    assert abs(spend - idle - 200) < 40, (idle, spend)
    assert abs(child - idle - 200) < 40 + 15, (idle, child)  # + the child interpreter itself
    md = (tmp_path / "run" / "summary.md").read_text()
    assert "| peak RSS (MiB) | held at the end (MiB) |" in md
    assert re.search(
        rf"\| 02_spend.ipynb \| ok \| [\d.]+ \| – \| {spend:,.0f} \| {held['02_spend']:,.0f} \|",
        md,
    ), md
    assert f"peak RSS {spend:,.0f} MiB" in capsys.readouterr().out


def test_cell_lines_name_each_cell_and_a_long_one_while_it_runs():
    import io
    import time

    from ssmkit.workbook.progress import CellLines, slow_warning

    book = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell
    book.cells = [
        nbformat.v4.new_markdown_cell("# x"),
        code("import os\nx = 1"),
        code("# Parameters\nx = 2"),
        code("time.sleep(1)"),
    ]
    stream = io.StringIO()
    lines = CellLines("01_a", stream=stream, first_notice=0.3, notice_every=0.3)
    hooks = lines.hooks()
    hooks["on_notebook_start"](notebook=book)
    for i, cell in enumerate(book.cells[1:], 1):
        hooks["on_cell_execute"](cell=cell, cell_index=i)
        time.sleep(1.0 if i == 3 else 0)
        hooks["on_cell_executed"](
            cell=cell, cell_index=i, execute_reply={"content": {"status": "ok"}}
        )
    out = stream.getvalue().splitlines()
    assert out[0].startswith("  01_a [1/3] cell 'x = 1' ")
    assert out[1].startswith("  01_a [2/3] cell 'parameters (injected)' ")
    notices = [ln for ln in out if "running for" in ln]
    assert 2 <= len(notices) <= 4 and all(
        ln.startswith("  01_a [3/3] cell 'time.sleep(1)' running for ") for ln in notices
    ), out
    assert re.fullmatch(r"  01_a \[3/3\] cell 'time.sleep\(1\)' 1\.\d s", out[-1]), out
    late = CellLines("01_a", stream=io.StringIO(), first_notice=0.2)
    late.hooks()["on_notebook_start"](notebook=book)
    late.hooks()["on_cell_execute"](cell=book.cells[3], cell_index=3)
    late.stop()  # a timeout or a signal ended the cell
    time.sleep(0.5)
    assert late.stream.getvalue() == ""
    assert slow_warning("a", 100, 10, "cuda") is None and slow_warning("a", 20, 10, "cpu") is None
    assert slow_warning("a", 40, 10, "cpu").startswith(
        "a ran 40 s on CPU, 4.0x its stated CPU time (~10 s"
    )


def test_strip_clears_an_executed_copy(tmp_path):
    nb = make_notebook(tmp_path / "01_a.ipynb", "x = 0", "print('hel' + 'lo')")
    workbook.run_workbook([nb], out=tmp_path / "run")
    executed = tmp_path / "run" / "01_a.ipynb"
    assert "hello" in executed.read_text()
    assert workbook.strip_notebook(executed) is True
    stripped = nbformat.read(executed, as_version=4)
    code = [c for c in stripped.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)
    assert "papermill" not in stripped.metadata and "hello" not in executed.read_text()
    assert stripped.metadata.language_info == {
        "name": "python"
    }  # as committed: no diff after `make strip`
    assert workbook.strip_notebook(executed) is False  # idempotent
    res = cli("strip", tmp_path / "missing.ipynb")
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_declared_parameters(tmp_path):
    nb = make_notebook(tmp_path / "a.ipynb", "a = 1  # one\nb: str = 'x'\nc = 2e3\nd = [1, 2]")
    assert workbook.declared_parameters(nb) == {
        "a": 1,
        "b": "x",
        "c": 2000.0,
        "d": [1, 2],
        "out_dir": "unused",
    }


def test_library_imports_without_matplotlib_and_papermill():
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.modules['papermill'] = None\n"
        "import ssmkit, ssmkit.plots, ssmkit.workbook\n"
        "from ssmkit.workbook import Param, Parameters\n"
        "seed = Parameters(Param('seed', 0, ssmkit.checks.integer, 'seed'))\n"
        "print(seed.check({'seed': 1})['seed'])"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "1", res.stderr
