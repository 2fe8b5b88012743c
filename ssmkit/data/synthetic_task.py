"""The machinery every synthetic task shares: the task base class (seeded ``sample``, ``split``,
``check``), the batch builder, knob checks and distinct random draws.

The tasks themselves live in :mod:`ssmkit.data.synthetic` (selection: selective copying, induction
heads, MQAR, and the registry ``TASKS``), :mod:`ssmkit.data.synthetic_recall` (associative recall,
passkey, phonebook, delay) and :mod:`ssmkit.data.synthetic_state` (parity, modular arithmetic);
their checkers in :mod:`ssmkit.data.synthetic_checks`. A task is a frozen dataclass deriving from
:class:`_Task` with a ``name``, a ``_generate(n, gen)`` and its checker as ``_answers``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .. import checks
from .synthetic_checks import IGNORE_INDEX, SyntheticBatch


def _batch(input_ids: torch.Tensor, answer_mask: torch.Tensor) -> SyntheticBatch:
    labels = torch.where(answer_mask, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return SyntheticBatch(input_ids=input_ids, labels=labels, answer_mask=answer_mask)


def _require_int(task: str, name: str, value, minimum: int) -> None:
    checks.integer(value, f"{task}: {name}", minimum=minimum)


def _generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(checks.integer(seed, "seed", minimum=0))


def _random_subset(n: int, population: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(n, k) indices into range(population): per row k distinct ones, uniformly, in random
    order."""
    if population < 4 * k:  # dense: the k largest of `population` uniform numbers
        return torch.rand(n, population, generator=gen).topk(k, dim=1).indices
    # sparse (e.g. 16 keys out of 4095): draw with repetition, redraw the repeats until none are
    # left. Relabelling the population maps runs onto equally likely runs, so every ordered k-tuple
    # of distinct indices is equally likely, as with the dense method, at O(n k^2) instead of O(n
    # population).
    draws = torch.randint(population, (n, k), generator=gen)
    while True:
        # equals an earlier one
        repeat = (draws[:, :, None] == draws[:, None, :]).tril(diagonal=-1).any(dim=2)
        if not repeat.any():
            return draws
        draws[repeat] = torch.randint(population, (int(repeat.sum()),), generator=gen)


class _Task:
    """Methods every task shares; subclasses define ``name``, ``_generate`` and ``_answers`` (the
    task's checker from :mod:`ssmkit.data.synthetic_checks`, as a staticmethod)."""

    name: ClassVar[str]
    vocab_size: int
    seq_len: int

    def sample(self, n: int, seed: int = 0) -> SyntheticBatch:
        """n sequences drawn with ``torch.Generator().manual_seed(seed)``; see
        :class:`SyntheticBatch`."""
        _require_int(type(self).__name__, "n", n, 0)
        return self._generate(n, _generator(seed))

    def split(
        self, n_train: int, n_test: int, seed: int = 0
    ) -> tuple[SyntheticBatch, SyntheticBatch]:
        """(train, test): ``sample(n_train, 2 * seed)`` and ``sample(n_test, 2 * seed + 1)``.

        Train seeds are even and test seeds odd, so no train set of any split seed shares a
        random stream with any test set.
        """
        _generator(seed)  # validates seed
        return self.sample(n_train, 2 * seed), self.sample(n_test, 2 * seed + 1)

    def check(self, batch: SyntheticBatch) -> bool:
        """Same as :func:`check(batch, self) <check>`."""
        return check(batch, self)

    def _generate(
        self, n: int, gen: torch.Generator
    ) -> SyntheticBatch:  # pragma: no cover - abstract
        raise NotImplementedError


def check(batch: SyntheticBatch, task) -> bool:
    """True iff the batch is a well-formed batch of ``task``.

    The answers are recomputed from ``batch.input_ids`` by the task's checker (``task._answers``,
    e.g. :func:`~ssmkit.data.synthetic_checks.mqar_answers`) and must equal ``batch.labels`` and the
    answer tokens in ``input_ids``; ``answer_mask`` must be ``labels != -100``; shapes must be
    (n, task.seq_len) and token ids inside the vocabulary.
    """
    checker = getattr(type(task), "_answers", None) if isinstance(task, _Task) else None
    if checker is None:
        raise TypeError(
            f"no checker for {type(task).__name__}: not a synthetic task "
            "(ssmkit.data.TASKS lists them)"
        )
    ids, labels, mask = batch.input_ids, batch.labels, batch.answer_mask
    if (
        ids.dim() != 2
        or ids.shape[1] != task.seq_len
        or labels.shape != ids.shape
        or mask.shape != ids.shape
    ):
        return False
    if ids.numel() and (ids.min() < 0 or ids.max() >= task.vocab_size):
        return False
    try:
        expected = checker(ids.cpu(), task)
    except ValueError:
        return False
    answers = expected != IGNORE_INDEX
    return (
        torch.equal(expected, labels.cpu())
        and torch.equal(mask.cpu(), answers)
        and torch.equal(ids.cpu()[answers], expected[answers])
    )
