"""The exercises of notebooks/01_prototype_130m.ipynb: the parameters of a Mamba block, the
learning-rate schedule, and what a step reads (gradient accumulation).

Each judge recomputes the truth with ssmkit itself (a model built from the config, the Trainer's own
schedule :func:`ssmkit.train.lr_at`, :meth:`TrainConfig.grad_accum`) and returns a hint that says
what is off, never the number.
"""

from __future__ import annotations

import math

from . import close, exercise


@exercise("01.1", "the parameters of one Mamba block", ("block_params",), wrong={"block_params": 0})
def _(block_params, d_model=64):
    from ..models import ModelConfig, build_model

    cfg = ModelConfig(d_model=d_model, n_layer=1, vocab_size=8)  # a Mamba-1 block, the defaults
    block = build_model(cfg).backbone.layers[0]
    want = sum(p.numel() for p in block.parameters())
    big = 3 * cfg.mamba1.d_inner(d_model) * d_model  # in_proj and out_proj
    if block_params == big:
        return "that is the in- and out-projections only; count the small tensors too"
    if block_params == want - d_model:
        return "the block's RMSNorm (before the mixer) has weights too"
    if block_params != want:
        return (
            "count every tensor of the block: its norm, then the mixer's in_proj, conv1d (weight "
            "and bias), x_proj, dt_proj (weight and bias), A_log, D and out_proj"
        )
    return None


def _schedule_step(cfg) -> int:
    """The step the exercise asks about: a quarter of the way through the cosine decay."""
    return cfg.warmup_steps + (cfg.total_steps() - cfg.warmup_steps) // 4


@exercise("01.2", "the learning rate after warmup", ("lr_at_step",), wrong={"lr_at_step": 3e-3})
def _(lr_at_step, config="mamba-130m", step=None):
    from ..train import lr_at
    from ..workbook.cells import train_config

    cfg = train_config(config)
    step = _schedule_step(cfg) if step is None else step
    want = lr_at(step, cfg)
    if close(lr_at_step, cfg.lr):
        return "that is the peak; after warmup the cosine has already brought it down"
    progress = (step - cfg.warmup_steps) / (cfg.total_steps() - cfg.warmup_steps)
    if close(lr_at_step, cfg.lr * 0.5 * (1 + math.cos(math.pi * progress)), rel=1e-4):
        return "the cosine ends at min_lr, not at 0"
    if not close(lr_at_step, want, rel=1e-4):
        return "use the schedule's formula with s the step, W warmup_steps, S total_steps()"
    return None


@exercise(
    "01.3",
    "what a step reads",
    ("passes_per_step", "tokens_read"),
    wrong={"passes_per_step": 1, "tokens_read": 0},
)
def _(passes_per_step, tokens_read, cfg=None):
    from ..workbook.cells import train_config

    cfg = train_config("cpu-tiny") if cfg is None else cfg
    if passes_per_step != cfg.grad_accum():
        return (
            "passes_per_step: a step sees batch_tokens tokens, micro_batch windows of seq_len "
            "tokens at a time"
        )
    if tokens_read == cfg.max_tokens != cfg.total_steps() * cfg.batch_tokens:
        return "tokens_read: the run takes whole steps; the last one is not cut short"
    if tokens_read != cfg.total_steps() * cfg.batch_tokens:
        return "tokens_read: every step reads the same number of tokens"
    return None
