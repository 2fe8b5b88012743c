"""Next-token loss and perplexity over a token split.

For a split of T scored positions with targets y_t and model probabilities p(y_t | y_<t):

    loss = -(1/T) Σ_t log p(y_t | y_<t)          (cross-entropy in nats per token)
    ppl  = exp(loss)

Batches of a :class:`~ssmkit.data.TokenLoader` all hold ``batch_size x seq_len`` positions, so the
mean of the per-batch means is the mean over every position (and, averaged over ranks, over every
rank's).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..data import TokenLoader

MAX_LOG_PPL = 50.0  # exp(50) ≈ 5e21: a diverged loss gives a huge perplexity, never an overflow


def logits_of(output) -> torch.Tensor:
    """The logits (batch, seqlen, vocab) of a model's output: ``output.logits`` (ssmkit's LMOutput,
    transformers' outputs) or the tensor itself."""
    return output.logits if hasattr(output, "logits") else output


def lm_loss(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, chunk_size: int = 0
) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions, in fp32 (labels -100 are not scored).

    input_ids, labels: (batch, seqlen) int64; ``labels[b, t]`` is the target of position t (the
    loader's windows are already shifted). ``model(input_ids)`` returns logits (batch, seqlen,
    vocab) or an object with ``.logits`` (ssmkit's LMOutput, transformers' outputs). Returns a
    scalar tensor. chunk_size > 0: the model computes the loss over chunks of that many positions
    and never holds all logits (ssmkit models: ``loss_chunk_size``; long context)."""
    if chunk_size:
        return model(input_ids, labels=labels, shift_labels=False, loss_chunk_size=chunk_size).loss
    logits = logits_of(model(input_ids))
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def ppl_of(loss: float) -> float:
    """exp(loss), with the loss capped at :data:`MAX_LOG_PPL`."""
    return math.exp(min(loss, MAX_LOG_PPL))


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def perplexity(
    model: nn.Module,
    loader: TokenLoader | Iterable,
    batches: int | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict:
    """Mean next-token loss and perplexity of ``model`` over the first ``batches`` batches of
    ``loader``.

    loader: a :class:`~ssmkit.data.TokenLoader` (read from its first window, the same windows every
    call; its position is left as it was) or any iterable of ``(input_ids, labels)``, each (batch,
    seqlen). batches: micro-batches in all, over every rank of the loader: each of its
    ``world_size`` ranks scores ``batches // world_size`` (at least 1, at most one epoch), so any
    world size scores the same windows. None: one epoch of a TokenLoader, every batch of another
    iterable.
    device: where the batches go (default: the model's). dtype: autocast to it (bf16/fp16), None:
    none. reduce: averages a scalar tensor over ranks (e.g. ``Dist.all_reduce_mean``); None: this
    process only.

    Returns
    ``{"loss": mean cross-entropy (nats/token), "ppl": exp(loss), "batches": batches scored here}``.
    The model is in eval mode meanwhile and goes back to the mode it had.
    """
    device = torch.device(device) if device is not None else model_device(model)
    if isinstance(loader, TokenLoader):
        per_rank = (
            loader.batches_per_epoch
            if batches is None
            else min(max(1, batches // loader.world_size), loader.batches_per_epoch)
        )
        position = loader.epoch, loader.step
        loader.epoch = loader.step = 0  # the same windows every time
    else:
        per_rank, position = batches, None
    training = model.training
    model.eval()
    total, n = torch.zeros((), device=device), 0
    try:
        for x, y in itertools.islice(loader, per_rank):  # exactly per_rank batches read
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with (
                torch.autocast(device.type, dtype=dtype)
                if dtype is not None
                else contextlib.nullcontext()
            ):
                total += lm_loss(model, x, y)
            n += 1
    finally:
        model.train(training)
        if position is not None:
            loader.epoch, loader.step = position
    if n == 0:
        raise ValueError("perplexity: the loader gave no batches")
    mean = total / n
    loss = (reduce(mean) if reduce is not None else mean).item()
    return {"loss": loss, "ppl": ppl_of(loss), "batches": n}
