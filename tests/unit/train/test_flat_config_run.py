"""A run saved before ModelConfig grouped its mixer fields still loads and resumes.

tests/data/flat-config-run was made by the ssmkit of then (make.py there): a Mamba-2 hybrid whose
``model_overrides`` give d_state, headdim and chunk_size flat, 2 steps, a checkpoint, and what that
code gave next (the saved model's logits, the losses of steps 3-4 resumed). The oracle is that code.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import ROOT, losses
from safetensors.torch import load_file

import ssmkit
from ssmkit.models import ModelConfig
from ssmkit.models.ssm_config import Mamba2Config
from ssmkit.train import TrainConfig, Trainer

DATA = ROOT / "tests" / "data" / "flat-config-run"
CHECKPOINT = "run/checkpoints/step_00000002"


@pytest.fixture
def old_run(tmp_path, monkeypatch):
    """A copy of the saved run, as the working directory (its config names data/ and run/)."""
    shutil.copytree(DATA, tmp_path / "old", ignore=shutil.ignore_patterns("make.py", "expected.*"))
    monkeypatch.chdir(tmp_path / "old")
    return tmp_path / "old"


def test_its_flat_overrides_and_config_json_mean_what_they_meant(old_run):
    run = TrainConfig.from_yaml(old_run / "run" / "config.yaml")
    assert run.model_overrides["d_state"] == 8  # flat, as runs of then wrote it
    cfg = run.model_config(vocab_size=257)
    assert cfg.mixers == ["mamba2", "attn"]
    assert cfg.mamba2 == Mamba2Config(d_state=8, headdim=8, chunk_size=16)
    expected = json.loads((DATA / "expected.json").read_text())
    assert ModelConfig.from_dict(expected["config"]) == cfg  # the old code's flat to_dict()
    assert ssmkit.from_pretrained(old_run / CHECKPOINT / "model").config == cfg


def test_it_gives_the_old_logits(old_run):
    expected = load_file(str(DATA / "expected.safetensors"))
    model = ssmkit.from_pretrained(old_run / CHECKPOINT / "model")
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-6, rtol=0)


def test_it_resumes_to_the_old_losses(old_run):
    run = TrainConfig.from_yaml(old_run / "run" / "config.yaml", overrides=["max_steps=4"])
    trainer = Trainer(config=run)
    assert trainer.resume() and trainer.step == 2
    expected = json.loads((DATA / "expected.json").read_text())
    assert losses(trainer.fit()) == pytest.approx(expected["resumed_losses"], abs=1e-6)
