"""Training: the plan's recipe on one CPU or many GPUs.

    cfg = ssmkit.train.TrainConfig.from_yaml("configs/cpu-tiny.yaml", overrides=["max_steps=100"])
    history = ssmkit.train.Trainer(config=cfg).fit()     # model and data built from the config
    # or: Trainer(model, cfg, data="shards/dir", callbacks=[...]).fit(); Trainer(..., resume=True)

Command line: ``ssmkit train --config FILE [--set key=value ...] [--resume] [--nproc N]``.
"""

from ..eval import flops_per_token, lm_loss  # still here for old imports; their home is ssmkit.eval
from .config import TrainConfig
from .optim import build_optimizer, lr_at, split_parameters
from .trainer import Trainer, TrainingError, prepare_data

__all__ = ["TrainConfig", "Trainer", "TrainingError", "build_optimizer", "flops_per_token", "lm_loss",
           "lr_at", "prepare_data", "split_parameters"]
