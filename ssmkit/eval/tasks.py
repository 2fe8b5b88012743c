"""Accuracy of a model on the synthetic tasks of :data:`ssmkit.data.TASKS` (selection, recall, state
tracking).

The tasks, their batches and the scoring of logits live in :mod:`ssmkit.data.synthetic`; here the
model runs. The answer at position t is predicted by the logits at t - 1 (next-token prediction):

    accuracy = #{answer positions t : argmax_v logits[t-1, v] = input_ids[t]} / #{answer positions}

Chance: a model that always says one data token scores, in expectation, 1/(number of data tokens) on
induction heads and selective copying (answers are uniform over the data ids).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import checks
from ..data import SyntheticBatch, accuracy, make_task
from .loss import logits_of, model_device


@torch.no_grad()
def answer_accuracy(model: nn.Module, batch: SyntheticBatch, batch_size: int = 64) -> float:
    """Fraction of ``batch``'s answer positions that ``model`` predicts right
    (:func:`ssmkit.data.accuracy` on its logits), run ``batch_size`` sequences at a time; exact over
    the whole batch (right / all).

    batch: a :class:`~ssmkit.data.SyntheticBatch`, input_ids (n, seq_len); ``model(input_ids)``
    returns logits (n, seq_len, vocab) or an object with ``.logits``. The model is in eval mode
    meanwhile."""
    if len(batch) == 0:
        raise ValueError("answer_accuracy: the batch is empty")
    batch_size = checks.integer(batch_size, "batch_size", minimum=1)
    device, training = model_device(model), model.training
    model.eval()
    right = answers = 0
    try:
        for start in range(0, len(batch), batch_size):
            chunk = batch[start : start + batch_size].to(device)
            count = int(chunk.answer_mask[:, 1:].sum())  # answers scored (position 0 never is)
            right += round(accuracy(logits_of(model(chunk.input_ids)), chunk) * count)
            answers += count
    finally:
        model.train(training)
    return right / answers


def task_accuracy(
    model: nn.Module, task, n: int = 256, seed: int = 0, batch_size: int = 64
) -> float:
    """Accuracy of ``model`` on ``n`` fresh sequences of ``task``: :func:`answer_accuracy` of
    ``task.sample(n, seed)``.

    task: a task object
    (``ssmkit.data.make_task("mqar", vocab_size=64, seq_len=64, num_kv_pairs=8)``) or a registered
    name (its default parameters). The test set of ``task.split(n_train, n_test, s)`` is
    ``task.sample(n_test, 2 * s + 1)``: ``task_accuracy(model, task, n_test, seed=2 * s + 1)``
    scores it.
    """
    task = make_task(task) if isinstance(task, str) else task
    return answer_accuracy(model, task.sample(n, seed), batch_size)
