"""Training: the plan's recipe on one CPU or many GPUs.

    cfg = ssmkit.train.TrainConfig.from_yaml("configs/cpu-tiny.yaml", overrides=["max_steps=100"])
    history = ssmkit.train.Trainer(config=cfg).fit()     # model and data built from the config
    # or: Trainer(model, cfg, data="shards/dir", callbacks=[...]).fit()
    # continue out_dir's run: trainer = Trainer(config=cfg); trainer.resume(); trainer.fit()
    plan = ssmkit.train.plan_memory("mamba-1.4b", seq_len=2048, micro_batch=8, n_gpus=8)  # per GPU
    print(plan.table()); print(ssmkit.train.memory_table(ssmkit.train.scale_up_plans()))
    fit = ssmkit.train.train_on_task(model, ssmkit.data.make_task("mqar"), steps=200)  # synthetic

Fine-tuning from a run config (configs/cpu-tiny-lora.yaml): ``base:`` a pretrained checkpoint
(instead of ``model``), ``lora: {r, alpha, dropout, target_modules, modules_to_save, use_dora}``
(None: full fine-tuning),
``freeze_embedding``, ``precision: bf16-pure`` (bf16 weights, no fp32 master),
``data: sft-arith | sft-docstrings | "sft:PATH.jsonl"`` (packed SFT samples; the Trainer passes
their seq_idx to the model). A LoRA run's checkpoints hold only the adapter (peft's format) and its
optimizer state, and resume exactly.

Command line: ``ssmkit train --config FILE [--set key=value ...] [--resume] [--nproc N]``; the
memory planner:
``ssmkit plan --model PRESET_OR_YAML [--seq-len N] [--micro-batch N] [--gpus N] ...``.
"""

from .config import TrainConfig
from .data import prepare_data
from .optim import build_optimizer, lr_at, split_parameters
from .planner import MemoryPlan, memory_table, plan_memory, scale_up_plans
from .task import train_each, train_on_task
from .trainer import Trainer, TrainingError

__all__ = [
    "MemoryPlan",
    "TrainConfig",
    "Trainer",
    "TrainingError",
    "build_optimizer",
    "lr_at",
    "memory_table",
    "plan_memory",
    "prepare_data",
    "scale_up_plans",
    "split_parameters",
    "train_each",
    "train_on_task",
]
