"""DDP and FSDP2 on CPU with 2 processes (gloo, torchrun): the same losses as one process with the
same global batch, and a checkpoint written by 2 processes resumes in 1.

Tolerance: 2e-5 on the loss. The two runs add the same numbers in another order (each rank
averages its half of the batch, then the ranks' gradients are averaged), so they agree to fp32
rounding, not bit for bit.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, small

from ssmkit.data import prepare
from ssmkit.train import TrainConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist-shards")
    prepare("stdlib-docs", "byte", base / "train", max_tokens=40_000, progress=False)
    prepare(
        "stdlib-docs", "byte", base / "val", split="validation", max_tokens=8_000, progress=False
    )
    return base


def config(path: Path, shards: Path, **kw) -> Path:
    """helpers.small's run (4 steps of 512 tokens) written as a YAML config in ``path``."""
    cfg = small(path, shards, **{"batch_tokens": 512, "max_steps": 4, "min_lr": 1e-5, **kw})
    path.mkdir(parents=True, exist_ok=True)
    (path / "c.yaml").write_text(cfg.to_yaml())
    return path / "c.yaml"


def train(cfg: Path, *args, nproc: int = 1) -> list[dict]:
    cmd = [sys.executable, "-m", "ssmkit", "train", "--config", str(cfg), *args]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = Path(TrainConfig.from_yaml(cfg).out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in out.read_text().splitlines()]


def losses(records, kind="train", key="loss"):
    return [r[key] for r in records if r["kind"] == kind]


@pytest.fixture(scope="module")
def single(tmp_path_factory, shards):
    return train(config(tmp_path_factory.mktemp("single"), shards))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one(tmp_path, shards, single, strategy):
    # micro_batch 4 x 2 ranks x 2 accumulation steps x 32 tokens = 512, as 4 x 1 x 4 x 32 in one
    # process
    two = train(config(tmp_path, shards, strategy=strategy), nproc=2)
    assert len(losses(two)) == 4
    assert losses(two) == pytest.approx(losses(single), abs=2e-5)
    assert losses(two, "eval", "val_loss") == pytest.approx(
        losses(single, "eval", "val_loss"), abs=2e-5
    )


def test_fsdp_checkpoint_resumes_in_one_process(tmp_path, shards, single):
    cfg = config(tmp_path, shards, strategy="fsdp")
    train(
        cfg, "--set", "max_steps=4", "--set", "ckpt_every=2", nproc=2
    )  # checkpoints at steps 2 and 4
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "latest").write_text("step_00000002\n")  # go back to step 2 ...
    cfg1 = config(tmp_path, shards, strategy="single")  # ... in one process
    resumed = train(cfg1, "--resume")
    assert [r["step"] for r in resumed if r["kind"] == "train"] == [1, 2, 3, 4]
    assert losses(resumed) == pytest.approx(losses(single), abs=2e-5)
