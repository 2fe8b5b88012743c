"""Training on a synthetic task (:func:`ssmkit.data.make_task`): a short loop with the Trainer's
optimizer and schedule, for tasks whose batches are generated, not read from token shards.

    fit = train_on_task(model, make_task("mqar", vocab_size=33, seq_len=32), steps=200, batch=16)
    fit["accuracy"]        # the fraction of held-out answers right
    rows = train_each({"a": cfg_a, "b": cfg_b}, task, seeds=[0, 1, 2], steps=200)  # a comparison

One step: ``batch`` fresh sequences, the loss on their answer positions only, the global gradient
norm clipped at ``grad_clip``, an AdamW step (:func:`~ssmkit.train.optim.build_optimizer`: decay on
matrices only) at the learning rate of :func:`~ssmkit.train.optim.lr_at`: a linear warmup, then a
cosine to ``lr / 10``. The recipe is a :class:`~ssmkit.train.TrainConfig` (:func:`task_recipe`), so
it reads like the Trainer's and has its checks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .. import checks
from ..env import torch_threads
from ..eval import answer_accuracy
from ..eval.loss import model_device
from ..models import ModelConfig, build_model
from .config import TrainConfig
from .optim import build_optimizer, lr_at

__all__ = ["task_recipe", "train_each", "train_on_task"]


def task_recipe(
    steps: int, lr: float = 3e-3, warmup: float = 0.1, weight_decay: float = 0.1, seed: int = 0
) -> TrainConfig:
    """The TrainConfig of a task training: ``steps`` optimizer steps, peak ``lr``, a linear warmup
    over ``warmup`` of the steps (at least one), then a cosine to ``lr / 10``; AdamW (0.9, 0.95)
    with ``weight_decay`` on matrices, gradients clipped at 1.0."""
    steps = checks.integer(steps, "steps", minimum=1)
    lr = checks.number(lr, "lr", low=0, low_open=True)
    ramp = max(1, round(checks.probability(warmup, "warmup") * steps))
    return TrainConfig(
        max_steps=steps,
        lr=lr,
        min_lr=lr / 10,
        warmup_steps=ramp,
        schedule="cosine",
        betas=(0.9, 0.95),
        weight_decay=weight_decay,
        grad_clip=1.0,
        seed=seed,
    )


def train_on_task(
    model: nn.Module,
    task,
    steps: int = 200,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    n_test: int = 256,
    warmup: float = 0.1,
    weight_decay: float = 0.1,
) -> dict:
    """Train ``model`` on a synthetic ``task`` for ``steps`` steps of ``batch`` fresh sequences
    (:func:`task_recipe`), then score it on ``n_test`` held-out ones.

    Data: ``task.split(steps * batch, n_test, seed)``; inputs (batch, seq_len) with labels -100
    except at the answers. Returns ``{"loss": mean training loss of the last tenth of the steps,
    "accuracy": the fraction of test answers right (:func:`ssmkit.eval.answer_accuracy`), "seconds",
    "steps"}``; the model is left in eval mode."""
    recipe = task_recipe(steps, lr, warmup, weight_decay, seed)
    batch = checks.integer(batch, "batch", minimum=1)
    train, test = task.split(recipe.max_steps * batch, n_test, seed)
    device = model_device(model)
    opt = build_optimizer(model, recipe)
    losses, start = [], time.perf_counter()
    model.train()
    for step in range(recipe.max_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        chunk = train[step * batch : (step + 1) * batch].to(device)
        loss = model(chunk.input_ids, labels=chunk.labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    tail = losses[-max(1, recipe.max_steps // 10) :]
    accuracy = answer_accuracy(model, test)
    model.eval()
    return {
        "loss": sum(tail) / len(tail),
        "accuracy": accuracy,
        "seconds": seconds,
        "steps": recipe.max_steps,
    }


def train_each(
    models: Mapping[str, ModelConfig],
    task,
    seeds: Sequence[int],
    steps: int,
    device="cpu",
    threads: int | None = 1,
    **train,
) -> list[dict]:
    """A comparison on a synthetic task: each model of ``models`` built with each seed
    (``build_model(cfg, seed=seed)``) and trained on ``task`` by :func:`train_on_task` (``steps``,
    ``seed=seed`` and ``train``: batch, lr, n_test, ...), models outer, seeds inner.

    ``threads``: torch threads while training (:func:`ssmkit.env.torch_threads`); 1 by default, as
    the models of such comparisons are so small that a second thread only waits; None: as set.
    Returns one row per run: {"model" (its key), "seed", "accuracy", "loss", "seconds",
    "params"}."""
    rows = []
    for name, cfg in models.items():
        for seed in seeds:
            model = build_model(cfg, seed=seed).to(device)
            if threads is None:
                fit = train_on_task(model, task, steps=steps, seed=seed, **train)
            else:
                with torch_threads(threads):
                    fit = train_on_task(model, task, steps=steps, seed=seed, **train)
            rows.append(
                {
                    "model": name,
                    "seed": seed,
                    "accuracy": fit["accuracy"],
                    "loss": fit["loss"],
                    "seconds": fit["seconds"],
                    "params": model.num_parameters(),
                }
            )
    return rows
