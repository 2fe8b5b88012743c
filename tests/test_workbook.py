"""ssmkit.workbook (the headless runner, parameter checks) and ssmkit.plots, on small throwaway notebooks.

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
from ssmkit.plots import LivePlot, plot_curves  # noqa: E402

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}   # offline: tests/conftest.py sets HF_HUB_OFFLINE=1
REPORT = ("import json, pathlib, sys\n"
          "(pathlib.Path(out_dir) / 'metrics.json')"
          ".write_text(json.dumps({{k: globals()[k] for k in {names!r}}} "
          "| {{'python': sys.executable}}))")


def report(*names: str) -> str:
    """A cell that writes the given variables (and the kernel's interpreter) to out_dir/metrics.json."""
    return REPORT.format(names=list(names))


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "ssmkit.cli", "workbook", *map(str, args)],
                          capture_output=True, text=True, env=ENV, cwd=cwd, timeout=300)


# --- running --------------------------------------------------------------------------------------

def test_failing_notebook_is_reported_and_the_others_still_run(tmp_path):
    a = make_notebook(tmp_path / "nb" / "01_a.ipynb", "x = 1", report("x"))
    b = make_notebook(tmp_path / "nb" / "02_b.ipynb", "y = 2", "z = y * 3", "raise ValueError(f'boom {z}')",
                      "never = 1")
    c = make_notebook(tmp_path / "nb" / "03_c.ipynb", "x = 5", report("x"))
    out = tmp_path / "run"
    res = cli("run", a, b, c, "--out", out)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "1 of 3 notebook(s) failed" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    status = {Path(e["notebook"]).name: e for e in summary["notebooks"]}
    assert [e["status"] for e in summary["notebooks"]] == ["ok", "failed", "ok"]
    failed = status["02_b.ipynb"]
    # cell 3 of the original notebook (markdown, parameters, z = ..., raise): the injected cell is not counted
    assert failed["cell"] == 3 and failed["error"] == "ValueError: boom 6"
    assert "raise ValueError" in failed["source"]
    # ran after the failure, with its own defaults
    assert status["03_c.ipynb"]["metrics"]["x"] == 5
    md = (out / "summary.md").read_text()
    assert re.search(r"\| 02_b.ipynb \| failed \|", md) and re.search(r"\| 03_c.ipynb \| ok \|.*x=5", md)
    assert "## 02_b.ipynb failed" in md and "Cell 3" in md and "ValueError: boom 6" in md
    assert "raise ValueError(f'boom {z}')" in md
    executed = nbformat.read(out / "02_b.ipynb", as_version=4)    # the executed copy keeps the traceback
    assert any(o.get("ename") == "ValueError" for cell in executed.cells for o in cell.get("outputs", []))
    # the kernel is this interpreter (whatever `python3` kernel spec the user has)
    assert Path(status["01_a.ipynb"]["metrics"]["python"]).resolve() == Path(sys.executable).resolve()


def test_params_file_and_overrides(tmp_path):
    a = make_notebook(tmp_path / "01_a.ipynb", "lr = 0.1\nname = 'a'\nflag = False\nsteps = 3",
                      report("lr", "name", "flag", "steps"))
    b = make_notebook(tmp_path / "02_b.ipynb", "lr = 0.5\nother = 1", report("lr", "other"))
    params = tmp_path / "p.yaml"
    params.write_text("lr: 3.0e-3\nname: from-file\nunused_key: 7\nother: 2\n")
    out = tmp_path / "run"
    res = cli("run", a, b, "-f", params, "-p", "name", "cli", "-p", "flag", "true", "-p", "steps", "1e3",
              "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((out / "summary.json").read_text())
    ma, mb = (e["metrics"] for e in summary["notebooks"])
    assert ma == {"lr": 0.003, "name": "cli", "flag": True, "steps": 1000.0, "python": ma["python"]}
    assert mb["lr"] == 0.003 and mb["other"] == 2                  # each notebook gets the keys it declares
    assert summary["notebooks"][0]["unused_shared"] == ["other", "unused_key"]
    # out_dir defaults to runs/NAME/<stem>/
    assert Path(summary["notebooks"][1]["metrics_file"]) == (out / "02_b" / "metrics.json").resolve()
    assert "02_b.ipynb ignores: name, unused_key" in (out / "summary.md").read_text()


def test_bad_inputs_give_clear_errors(tmp_path, capsys):
    nb = make_notebook(tmp_path / "01_a.ipynb", "lr = 0.1", "pass")
    out = tmp_path / "run"
    cases = [
        (["run", tmp_path / "missing.ipynb"], "notebook .*missing.ipynb does not exist"),
        (["run", nb, "-f", tmp_path / "nope.yaml"], "params file .*nope.yaml does not exist"),
        (["run", nb, "-p", "lrr", "1"],
         "parameter\\(s\\) lrr not declared by any notebook .*declared: lr, out_dir"),
        (["run", nb, "-p", "bad-name", "1"], "must be a Python identifier"),
    ]
    bad_yaml, a_list = tmp_path / "bad.yaml", tmp_path / "list.yaml"
    bad_yaml.write_text("lr: [1, 2\n")
    a_list.write_text("- 1\n- 2\n")
    cases += [(["run", nb, "-f", bad_yaml], "is not valid YAML"),
              (["run", nb, "-f", a_list], "must be a mapping")]
    for args, message in cases:                                    # in-process: the same main() the CLI calls
        with pytest.raises(SystemExit) as exit_:
            workbook.main([*map(str, args), "--out", str(out)])
        stderr = capsys.readouterr().err
        assert exit_.value.code == 2 and re.search(message, stderr), (args, stderr)
        assert stderr.startswith("ssmkit workbook: ") and "Traceback" not in stderr
        assert not out.exists()                                    # nothing ran, nothing written
    with pytest.raises(workbook.WorkbookError, match="no notebooks matching NN_\\*.ipynb in .*empty"):
        workbook.find_notebooks(tmp_path / "empty")


def test_default_notebooks_in_order_and_timestamped_run(tmp_path):
    make_notebook(tmp_path / "notebooks" / "10_b.ipynb", "x = 2", report("x"))
    make_notebook(tmp_path / "notebooks" / "02_a.ipynb", "x = 1", report("x"))
    make_notebook(tmp_path / "notebooks" / "scratch.ipynb", "x = 3",
                  "raise RuntimeError('not part of the run')")
    res = cli("run", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", run.name)
    summary = json.loads((run / "summary.json").read_text())
    assert [Path(e["notebook"]).name for e in summary["notebooks"]] == ["02_a.ipynb", "10_b.ipynb"]
    assert f"summary: runs/{run.name}/summary.md" in res.stdout


def test_notebooks_run_in_their_own_folder(tmp_path):
    """As in JupyterLab: relative paths in a notebook start at its folder."""
    nb = make_notebook(tmp_path / "nbs" / "01_a.ipynb", "x = 0", "import os\ncwd = os.getcwd()",
                       report("cwd"))
    summary = workbook.run_workbook([nb], out=tmp_path / "run")
    assert summary["failed"] == 0
    metrics = json.loads(Path(summary["notebooks"][0]["metrics_file"]).read_text())
    assert Path(metrics["cwd"]).resolve() == (tmp_path / "nbs").resolve()


def test_cell_timeout_fails_the_notebook(tmp_path):
    slow = make_notebook(tmp_path / "01_slow.ipynb", "x = 0", "import time\ntime.sleep(60)")
    summary = workbook.run_workbook([slow], out=tmp_path / "run", cell_timeout=2)
    (entry,) = summary["notebooks"]
    assert (entry["status"] == "failed" and entry["error"].startswith("timeout after 2 s")
            and entry["seconds"] < 30), entry
    # markdown, parameters, the slow cell
    assert entry["cell"] == 2 and "time.sleep(60)" in entry["source"]
    md = (tmp_path / "run" / "summary.md").read_text()
    assert "## 01_slow.ipynb failed" in md and "Cell 2 " in md and "timeout after 2 s" in md


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
    assert workbook.strip_notebook(executed) is False              # idempotent
    res = cli("strip", tmp_path / "missing.ipynb")
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_declared_parameters(tmp_path):
    nb = make_notebook(tmp_path / "a.ipynb", "a = 1  # one\nb: str = 'x'\nc = 2e3\nd = [1, 2]")
    assert workbook.declared_parameters(nb) == {"a": 1, "b": "x", "c": 2000.0, "d": [1, 2],
                                                "out_dir": "unused"}


def test_parse_value():
    assert ([workbook.parse_value(v) for v in ["3", "3e-3", "2_000", "true", "False", "none", "cpu", "1.5"]]
            == [3, 0.003, 2000, True, False, None, "cpu", 1.5])


# --- notebook helpers -----------------------------------------------------------------------------

def test_check_params_resolves_and_rejects(tmp_path):
    p = workbook.check_params(preset="tiny", data="stdlib-docs", max_tokens=2e5, device="auto",
                              out_dir=tmp_path / "o", seed=0, extra="kept")
    assert (p["device"] in ("cpu", "cuda", "mps") and p["max_tokens"] == 200_000
            and isinstance(p["max_tokens"], int))
    assert p["out_dir"].is_dir() and p["extra"] == "kept"
    bad = {"preset": ("nope", "unknown preset 'nope'; valid: .*mamba-130m"),
           "device": ("gpu", "device='gpu' is not valid; valid: auto, cpu, cuda"),
           "max_tokens": (0, "max_tokens must be an integer >= 1; got 0"),
           "seed": (1.5, "seed must be an integer >= 0"),
           "data": ("no/such/dir", "data='no/such/dir' is not valid; valid: 'stdlib-docs', .*slimpajama"),
           "out_dir": ("", "out_dir must be a non-empty path")}
    for key, (value, message) in bad.items():
        with pytest.raises(workbook.WorkbookError, match=message):
            workbook.check_params(**{key: value})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU error")
def test_pick_device_without_gpu():
    assert workbook.pick_device("auto") in ("cpu", "mps") and workbook.pick_device("cpu") == "cpu"
    with pytest.raises(workbook.WorkbookError, match="CUDA is not available"):
        workbook.pick_device("cuda:0")


def test_preset_info_counts_like_a_built_model():
    import ssmkit

    info = workbook.preset_info("tiny", max_tokens=1000)        # what train_config("tiny") would train
    assert (info["params"]
            == ssmkit.build_model(workbook.train_config("tiny", max_steps=1).model_config()).num_parameters())
    assert info["vocab_size"] == len(ssmkit.data.get_tokenizer("gpt2")) == 50257
    assert info["train_flops"] == 6 * info["params"] * 1000
    assert info["train_state_gb"] == round(16 * info["params"] / 2**30, 3)


def test_write_metrics_and_format_duration(tmp_path):
    path = workbook.write_metrics(tmp_path / "m", {"loss": 1.5, "where": Path("/x")})
    assert (json.loads(path.read_text()) == {"loss": 1.5, "where": "/x"}
            and list(path.parent.iterdir()) == [path])
    assert ([workbook.format_duration(s) for s in (42, 300, 25200, 3e5)]
            == ["42 s", "5 min", "7 h", "3.5 days"])


def test_library_imports_without_matplotlib_and_papermill():
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['papermill'] = None\n"
            "import ssmkit, ssmkit.plots, ssmkit.workbook\n"
            "print(ssmkit.workbook.check_params(seed=1)['seed'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "1", res.stderr


# --- plots ----------------------------------------------------------------------------------------

def train_records(n=5, scale=1.0):
    return [{"step": i, "tokens": 1000 * (i + 1), "loss": scale * (5.0 - i * 0.5), "lr": 1e-3}
            for i in range(n)]


def test_liveplot_records_and_saves(tmp_path):
    live = LivePlot(tmp_path / "fig" / "loss.png", display=False)
    for r in train_records():
        live.on_log(None, r)
    live.on_eval(None, {"step": 4, "tokens": 5000, "val_loss": 3.2, "val_ppl": 24.5})
    path = live.on_end(None)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and list(path.parent.iterdir()) == [path]
    train_line, val_line = live.figure().axes[0].lines
    assert list(train_line.get_xdata()) == [1000, 2000, 3000, 4000, 5000]
    assert list(train_line.get_ydata()) == [5.0, 4.5, 4.0, 3.5, 3.0]
    assert list(val_line.get_xdata()) == [5000] and list(val_line.get_ydata()) == [3.2]
    assert live.draws == 1                                   # no display: drawn once, at the end


def test_liveplot_updates_one_display_in_place(tmp_path, monkeypatch):
    import IPython.display

    shown = []

    class Handle:
        def update(self, obj):
            shown.append(("update", obj))

    def fake_display(obj, display_id=None):
        shown.append(("display", obj))
        return Handle()

    monkeypatch.setattr(IPython.display, "display", fake_display)
    live = LivePlot(tmp_path / "loss.png", display=True, interval=0.0)
    for r in train_records(3):
        live.on_log(None, r)
    live.on_end(None)
    assert [kind for kind, _ in shown] == ["display", "update", "update", "update"]
    assert all(obj.data[:4] == b"\x89PNG" for _, obj in shown)
    shown.clear()
    # throttled: first update, then only the end
    slow = LivePlot(None, display=True, interval=1e9, save_every=2)
    slow.path = tmp_path / "slow.png"
    for r in train_records(4):
        slow.on_log(None, r)
    assert [kind for kind, _ in shown] == ["display"] and slow.path.exists()   # save_every=2 saved mid-run
    slow.on_end(None)
    assert [kind for kind, _ in shown] == ["display", "update"]


def test_plot_curves_several_runs(tmp_path):
    mamba, llama = train_records(4), train_records(3, scale=1.2)
    # an eval record among train records: skipped
    mamba.insert(2, {"step": 2, "tokens": 2500, "val_loss": 4.1})
    fig = plot_curves({"mamba": mamba, "llama": llama}, tmp_path / "cmp.png", x="tokens", y="loss",
                      show=False)
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    lines = fig.axes[0].lines
    assert [ln.get_label() for ln in lines] == ["mamba", "llama"]
    assert list(lines[0].get_xdata()) == [1000, 2000, 3000, 4000]
    assert list(lines[1].get_ydata()) == pytest.approx([6.0, 5.4, 4.8])
    val = plot_curves({"mamba": mamba}, None, y="val_loss", show=False)
    assert list(val.axes[0].lines[0].get_ydata()) == [4.1]
    with pytest.raises(ValueError, match="run 'llama' has no records with keys 'tokens' and 'val_loss'"):
        plot_curves({"mamba": mamba, "llama": llama}, None, y="val_loss", show=False)


def test_summarize_run():
    records = [{"kind": "eval", "step": 0, "tokens": 0, "val_loss": 10.0, "val_ppl": 22026.47},
               {"kind": "train", "step": 1, "tokens": 8, "loss": 9.0, "tokens_per_s": 300.0},
               {"kind": "train", "step": 2, "tokens": 16, "loss": 8.0, "tokens_per_s": 100.0},
               {"kind": "train", "step": 3, "tokens": 24, "loss": 7.0, "tokens_per_s": 200.0},
               {"kind": "eval", "step": 3, "tokens": 24, "val_loss": 7.123456, "val_ppl": 1239.4567}]
    assert workbook.summarize_run(records) == {"tokens": 24, "first_val_loss": 10.0, "val_loss": 7.1235,
                                               "val_ppl": 1239.46, "train_tok_s": 200}
    assert workbook.summarize_run([])["val_loss"] is None
