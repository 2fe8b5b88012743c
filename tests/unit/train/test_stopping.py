"""Stopping training by hand (Ctrl-C, Jupyter's stop button) says one line and keeps what was done.

A real SIGINT is sent to this process from a callback at a chosen step; the oracle for "the Trainer
is whole" is a run that was never stopped: stopping at step 3 and calling fit() again gives its
losses exactly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, losses, small

from ssmkit.io import Stopped
from ssmkit.train import Trainer


class CtrlC:
    """A callback that sends this process ``times`` SIGINTs when step ``at`` is logged."""

    def __init__(self, at: int, times: int = 1):
        self.at, self.times = at, times

    def on_log(self, trainer, record):
        if record["step"] == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_stops_at_the_step_end_in_one_line_and_fit_goes_on(tmp_path, shards):
    straight = losses(Trainer(config=small(tmp_path / "a", shards)).fit())
    trainer = Trainer(config=small(tmp_path / "b", shards, ckpt_every=2), callbacks=[CtrlC(3)])
    with pytest.raises(Stopped) as info:
        trainer.fit()
    ckpt = tmp_path / "b" / "run" / "checkpoints" / "step_00000002"
    assert str(info.value) == (
        f"train tiny: stopped at step 3 of 6; last checkpoint {ckpt}; fit() goes on from step 3"
    )
    assert info.value._render_traceback_() == [f"Stopped: {info.value}"]  # what IPython shows
    assert isinstance(info.value, KeyboardInterrupt) and info.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
    assert trainer.step == 3 and (ckpt / "trainer.json").exists()
    trainer.callbacks = []
    rest = losses(trainer.fit())  # the same Trainer, in memory, as if never stopped
    assert losses(trainer.history) == pytest.approx(straight, abs=1e-6)
    assert len(rest) == 3


def test_a_second_ctrl_c_stops_at_once_and_says_so(tmp_path, shards):
    trainer = Trainer(config=small(tmp_path, shards), callbacks=[CtrlC(2, times=2)])
    with pytest.raises(Stopped, match=r"stopped at once near step 2 of 6; no checkpoint yet "):
        trainer.fit()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ipython_shows_a_stop_as_one_line(capsys):
    shell = pytest.importorskip("IPython.core.interactiveshell").InteractiveShell.instance()
    shell.run_cell("from ssmkit.io import Stopped\nraise Stopped('train tiny: stopped at step 3')")
    out = capsys.readouterr()
    shown = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert shown == ["Stopped: train tiny: stopped at step 3"]
    assert shell.run_cell("1 + 1").result == 2  # the kernel goes on


def test_ssmkit_train_stopped_by_ctrl_c_says_one_line_and_exits_130(tmp_path, shards):
    config = tmp_path / "c.yaml"
    config.write_text(small(tmp_path, shards, max_steps=100_000, ckpt_every=2).to_yaml())
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssmkit.cli", "train", "--config", str(config)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "SSMKIT_PROGRESS": "off"},
    )  # fmt: skip
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not latest.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err
    (line,) = err.splitlines()
    assert re.fullmatch(
        r"ssmkit train: stopped at step \d+ of 100000; last checkpoint \S+step_\d+ "
        r"\(--resume goes on from it\)",
        line,
    ), line
