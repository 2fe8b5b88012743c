"""Jupyter's stop button on a training cell, in a real ipykernel: the cell's error is one line
(issue #25: it was a 74-79 line autograd traceback) and the kernel, and the Trainer, go on."""

from __future__ import annotations

import os
import time

import pytest
from helpers import ROOT

pytest.importorskip("ipykernel")
jupyter_client = pytest.importorskip("jupyter_client.manager")

SETUP = """
from ssmkit.train import TrainConfig, Trainer
cfg = TrainConfig(model="tiny", model_overrides={{"d_model": 32, "n_layer": 2}}, data={data!r},
                  seq_len=32, micro_batch=4, batch_tokens=256, max_steps=100_000, log_every=1,
                  eval_every=0, ckpt_every=3, progress=False, out_dir={out!r})
trainer = Trainer(config=cfg)
"""


@pytest.mark.slow
def test_the_stop_button_on_a_training_cell_says_one_line(shards, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SSMKIT_PROGRESS": "off"}
    km, kc = jupyter_client.start_new_kernel(kernel_name="python3", cwd=str(ROOT), env=env)
    try:
        setup = SETUP.format(data=str(shards / "train"), out=str(tmp_path / "run"))
        assert kc.execute_interactive(setup, timeout=300)["content"]["status"] == "ok"
        cell = kc.execute("trainer.fit()")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
            time.sleep(0.2)
        time.sleep(1)
        km.interrupt_kernel()  # what the stop button does: SIGINT to the kernel
        errors = []
        while True:
            msg = kc.get_iopub_msg(timeout=300)
            if msg["parent_header"].get("msg_id") != cell:
                continue
            if msg["msg_type"] == "error":
                errors.append(msg["content"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        (error,) = errors
        assert error["ename"] == "Stopped"
        (line,) = error["traceback"]
        assert line.startswith("Stopped: train tiny: stopped at step ")
        assert "fit() goes on from step" in line
        shown = []
        reply = kc.execute_interactive(
            "print(trainer.step > 0)",
            timeout=60,
            output_hook=lambda m: shown.append(m["content"].get("text", "")),
        )
        assert reply["content"]["status"] == "ok" and "True" in "".join(shown)  # a next cell runs
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
