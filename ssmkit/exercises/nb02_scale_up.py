"""The exercises of notebooks/02_scale_up.ipynb: the training state each rank holds under DDP and
FSDP, and gradient accumulation over several ranks.

Each judge recomputes the truth with ssmkit itself (the memory planner
:func:`ssmkit.train.plan_memory`, :meth:`TrainConfig.grad_accum`) and returns a hint that says what
is off, never the number.
"""

from __future__ import annotations

import functools

from . import close, exercise


@functools.lru_cache(maxsize=8)
def _state_bytes(preset: str, strategy: str, n_gpus: int) -> tuple[int, int]:
    """(bytes of weights + gradients + AdamW moments per rank, parameters) as the planner has them
    (bf16 autocast: fp32 master weights)."""
    from ..train import plan_memory

    # the state does not depend on the micro-batch: 02's plans (2048 tokens, micro-batch 8)
    plan = plan_memory(
        preset, seq_len=2048, micro_batch=8, precision="bf16", strategy=strategy, n_gpus=n_gpus
    )
    return plan.weights + plan.grads + plan.optimizer, plan.params


@exercise(
    "02.1",
    "training state per rank: DDP and FSDP",
    ("ddp_bytes", "fsdp_bytes"),
    wrong={"ddp_bytes": 16 * 1_372_178_432, "fsdp_bytes": 16 * 1_372_178_432},
)
def _(ddp_bytes, fsdp_bytes, preset="mamba-1.4b", n_gpus=8):
    ddp, params = _state_bytes(preset, "ddp", n_gpus)
    fsdp, _ = _state_bytes(preset, "fsdp", n_gpus)
    if close(ddp_bytes, 16 * params) and not close(ddp, 16 * params):
        return (
            "ddp_bytes: weights, gradients and AdamW's two moments, yes; DDP also holds a copy of "
            "the gradients in its all-reduce buckets"
        )
    if not close(ddp_bytes, ddp, rel=1e-4):
        return "ddp_bytes: count the fp32 numbers each rank holds per parameter, 4 bytes each"
    if close(fsdp_bytes, ddp):
        return "fsdp_bytes: FSDP shards what DDP replicates; each rank keeps a share"
    if close(fsdp_bytes, ddp / n_gpus, rel=1e-4):
        return "fsdp_bytes: FSDP reduce-scatters the gradients: no bucket copy to divide"
    if not close(fsdp_bytes, fsdp, rel=1e-4):
        return "fsdp_bytes: weights, gradients and AdamW's moments, each split over the ranks"
    return None


@exercise(
    "02.2",
    "gradient accumulation on several ranks",
    ("accum_per_rank", "optimizer_steps"),
    wrong={"accum_per_rank": 32, "optimizer_steps": 49591},
)
def _(accum_per_rank, optimizer_steps, config="mamba-1.4b", n_gpus=8):
    from ..workbook.cells import train_config

    cfg = train_config(config)
    if accum_per_rank == cfg.grad_accum(1) != cfg.grad_accum(n_gpus):
        return (
            "accum_per_rank: that is one process's count; the ranks split the batch, each "
            "accumulating its share"
        )
    if accum_per_rank != cfg.grad_accum(n_gpus):
        return "accum_per_rank: batch_tokens = ranks x accumulation x micro_batch x seq_len"
    if optimizer_steps == cfg.total_steps() * n_gpus or optimizer_steps * n_gpus == (
        cfg.total_steps()
    ):
        return "optimizer_steps: the global batch is the same with any number of ranks"
    if optimizer_steps != cfg.total_steps():
        return "optimizer_steps: max_tokens in batches of batch_tokens (a last, partial one counts)"
    return None
