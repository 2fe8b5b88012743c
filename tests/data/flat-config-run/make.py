"""How this directory was made, with the ssmkit of before ModelConfig's mixer groups (flat fields):

    cd <that checkout> && PYTHONPATH=$PWD python tests/data/flat-config-run/make.py OUT

A Mamba-2 hybrid (tiny-mamba2 with d_state 8, headdim 8, chunk 16 and an attention layer, given flat
in ``model_overrides`` as runs of then wrote them) trains 2 steps on a few KB of byte-level shards
(``data/``) and checkpoints (``run/``). ``expected.safetensors``: the saved model's logits for fixed
ids; ``expected.json``: the losses of steps 3-4 when the run is resumed to step 4, and the model's
flat config. tests/unit/train/test_flat_config_run.py loads and resumes it with today's code.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import ssmkit
from ssmkit.data import prepare
from ssmkit.train import TrainConfig, Trainer

out = Path(sys.argv[1]).resolve()
shutil.rmtree(out, ignore_errors=True)
out.mkdir(parents=True)
prepare(
    "stdlib-docs",
    "byte",
    out / "data" / "train",
    max_tokens=4096,
    shard_tokens=4096,
    progress=False,
)
prepare(
    "stdlib-docs", "byte", out / "data" / "val", split="validation", max_tokens=1024, progress=False
)
overrides = dict(
    d_model=16,
    n_layer=2,
    d_state=8,
    headdim=8,
    chunk_size=16,
    attn_layer_idx=[1],
    attn_cfg=dict(num_heads=2),
)
cfg = dict(
    model="tiny-mamba2",
    model_overrides=overrides,
    data="data/train",
    val_data="data/val",
    seq_len=32,
    micro_batch=4,
    batch_tokens=128,
    lr=3e-3,
    min_lr=3e-4,
    warmup_steps=1,
    max_steps=2,
    log_every=1,
    eval_every=0,
    eval_batches=1,
    ckpt_every=2,
    keep_last=1,
    progress=False,
    out_dir="run",
    seed=0,
)
os.chdir(out)
Trainer(config=TrainConfig(**cfg)).fit()
model = ssmkit.from_pretrained("run/checkpoints/step_00000002/model")
ids = torch.arange(24).reshape(2, 12) * 7 % 256
with torch.no_grad():
    logits = model(ids).logits
with tempfile.TemporaryDirectory() as tmp:
    shutil.copytree("run", Path(tmp) / "run")
    resumed = Trainer(
        config=TrainConfig(**{**cfg, "max_steps": 4, "out_dir": f"{tmp}/run"}), resume=True
    )
    losses = [r["loss"] for r in resumed.fit() if r["kind"] == "train"]
for lock in out.rglob(".ssmkit.lock"):
    lock.unlink()
save_file({"input_ids": ids, "logits": logits.contiguous()}, "expected.safetensors")
Path("expected.json").write_text(
    json.dumps(
        {
            "resumed_losses": losses,
            "resumed_steps": 4,
            "model_class": type(model).__name__,
            "config": model.config.to_dict(),
        },
        indent=1,
    )
    + "\n"
)
