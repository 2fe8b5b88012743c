"""ssmkit.workbook.launch: ``ssmkit train --nproc N`` started from a notebook cell as a subprocess.

A real 2-process gloo run of a tiny config returns its metrics (the same losses as one process, to
fp32 rounding: see test_distributed.py); interrupting the cell (SIGINT to the kernel:
KeyboardInterrupt) stops every process of the run, launcher and ranks, and re-raises; a run that
fails raises LaunchError with its ranks' messages; a config that cannot load fails before anything
starts.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
from helpers import small

from ssmkit.train import TrainConfig
from ssmkit.workbook import LaunchError, launch
from ssmkit.workbook.launch import _alive, _set_items, launch_train, process_tree

pytestmark = pytest.mark.slow


def tiny(shards, tmp_path, **kw) -> TrainConfig:
    """helpers.small with 4 steps of 512 tokens (2 micro-batches of 4 x 32 per rank at 2 ranks)."""
    return small(tmp_path, shards, **{"batch_tokens": 512, "max_steps": 4, "min_lr": 1e-5, **kw})


def test_two_processes_return_the_runs_metrics(shards, tmp_path, capsys):
    cfg = tiny(shards, tmp_path, strategy="ddp")
    one = launch_train(cfg, nproc=1, out_dir=tmp_path / "one", overrides={"strategy": "single"})
    two = launch_train(cfg, nproc=2)
    shown = capsys.readouterr().out
    assert (
        "--nproc 2" in shown and "launching 2 processes" in shown
    )  # the command and torchrun's line
    assert "step 4: loss" in shown and "validation loss" in shown  # records shown as they came
    losses = [[r["loss"] for r in run["history"] if r["kind"] == "train"] for run in (one, two)]
    assert len(losses[1]) == 4 and losses[1] == pytest.approx(losses[0], abs=2e-5)
    assert two["final_loss"] == losses[1][-1] and two["val_loss"] == pytest.approx(
        one["val_loss"], abs=2e-5
    )
    assert two["steps"] == 4 and two["tokens"] == 4 * 512 and two["train_tok_s"] > 0
    assert len(two["rank_peak_mem_mb"]) == 2 and all(m > 0 for m in two["rank_peak_mem_mb"])
    assert "rank_peak_mem_mb" not in one  # one process: no ranks
    assert (tmp_path / "run" / "launch.yaml").exists() and two["out_dir"] == (
        tmp_path / "run"
    ).resolve()
    assert TrainConfig.from_yaml(tmp_path / "run" / "config.yaml").strategy == "ddp"


def test_fsdp_ranks_hold_half_the_state(shards, tmp_path):
    runs = {
        s: launch_train(
            tiny(shards, tmp_path, strategy=s, max_steps=2, out_dir=str(tmp_path / s)),
            nproc=2,
            show=False,
        )
        for s in ("ddp", "fsdp")
    }
    ddp, fsdp = runs["ddp"]["rank_state_mb"], runs["fsdp"]["rank_state_mb"]
    assert ddp[0] == ddp[1] and sum(fsdp) == pytest.approx(ddp[0], rel=0.02)  # sharded: 1/2 each


def children() -> set[int]:
    """This test process's live descendants. A test compares them with those alive before it
    launched: an earlier test in the same session may have left a helper running (multiprocessing's
    resource tracker lives as long as the interpreter), which is not the run's to stop."""
    return set(process_tree(os.getpid())[1:])


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this test, as in a Jupyter kernel: a process started in
    the background by a non-interactive shell (``pytest &``, some CI runners) inherits SIGINT
    ignored, and Python keeps it ignored (the full suite then hung here, training on)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_interrupting_the_cell_stops_every_rank(shards, tmp_path, sigint_raises):
    cfg = tiny(shards, tmp_path, strategy="ddp", max_steps=2_000, log_every=1)
    seen: list[int] = []
    before = children()  # helpers an earlier test left (a multiprocessing tracker)

    def interrupt():  # the cell's stop button: SIGINT to the kernel's main thread
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            tree = [p for p in children() if p not in before]
            if (
                len(tree) >= 3 and (tmp_path / "run" / "metrics.jsonl").exists()
            ):  # launcher + 2 ranks
                seen.extend(tree)
                break
            time.sleep(0.2)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        launch_train(cfg, nproc=2, show=False, grace=5)
    thread.join()
    line = (
        r"stopped the run (at step \d+|before its first logged step) \(\d+ processes, all ended\); "
    )
    assert re.match(line, str(info.value)), str(info.value)  # one line, not a traceback
    assert info.value._render_traceback_() == [f"Stopped: {info.value}"]
    assert len(seen) >= 3, "the ranks never started"
    assert not [p for p in seen if _alive(p)], "a process of the run outlived the interrupt"
    assert children() <= before
    assert time.monotonic() - start < 100


def test_stop_escalates_when_sigint_is_ignored(tmp_path):
    """A process that ignores SIGINT gets SIGTERM after the grace period (and SIGKILL after
    that)."""
    import sys

    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "time.sleep(60)'], start_new_session=True); time.sleep(60)"
    )
    run = launch.Launch([sys.executable, "-c", code], tmp_path, show=False, grace=0.5).start()
    deadline = time.monotonic() + 30
    while len(run.pids()) < 2 and time.monotonic() < deadline:  # the child in a session of its own
        time.sleep(0.05)
    found = run.stop()
    assert len(found) == 2 and not [p for p in found if _alive(p)]


def test_a_failing_run_raises_with_the_ranks_message(shards, tmp_path):
    cfg = tiny(shards, tmp_path, strategy="fsdp", data=str(tmp_path / "no-such-corpus"))
    before = children()
    (tmp_path / "bad.yaml").write_text(cfg.to_yaml())  # a config file this time
    with pytest.raises(LaunchError, match="unknown source") as info:
        launch_train(tmp_path / "bad.yaml", nproc=2, show=False)
    assert str((tmp_path / "bad.yaml").resolve()) in info.value.command
    assert info.value.returncode == 1 and any("rank 0" in line for line in info.value.lines)
    assert children() <= before


def test_bad_configs_fail_before_anything_starts(shards, tmp_path):
    cfg = tiny(shards, tmp_path)
    with pytest.raises(ValueError, match="unknown key 'max_stepz'"):
        launch_train(cfg, nproc=2, overrides=["max_stepz=3"])
    with pytest.raises(ValueError, match="needs strategy ddp or fsdp"):
        launch_train(cfg, nproc=2)
    with pytest.raises(ValueError, match="not a multiple"):
        launch_train(cfg, nproc=3, overrides={"strategy": "ddp"})
    with pytest.raises(ValueError, match="does not exist"):
        launch_train(tmp_path / "missing.yaml")
    assert not (tmp_path / "run").exists()


def test_overrides_become_set_items():
    assert _set_items(
        {
            "lr": 1e-5,
            "betas": [0.9, 0.95],
            "val_data": None,
            "data": "x y",
            "model_overrides": {"d_model": 64},
        }
    ) == [
        "lr=1e-05",
        "betas=[0.9, 0.95]",
        "val_data=null",
        "data=x y",
        "model_overrides.d_model=64",
    ]
    cfg = TrainConfig.from_dict(
        {"max_steps": 1}, overrides=_set_items({"lr": 1e-5, "betas": [0.9, 0.95], "val_data": None})
    )
    assert (cfg.lr, cfg.betas, cfg.val_data) == (1e-5, (0.9, 0.95), None)
