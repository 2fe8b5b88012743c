"""Synthetic tasks from the state-space-model literature, seeded, checkable, pure torch: the
selection tasks, and the registry of every task (``TASKS``, ``make_task``).

Three small tasks here test whether a sequence model can *select* and *recall* information
from its context. A recurrent model has to squeeze the whole past into a fixed-size state,
so these tasks are where a selective SSM (Mamba) and a plain linear-time-invariant SSM differ.
Recall at a distance (``associative-recall``, ``passkey``, ``phonebook``, ``delay``) is in
:mod:`ssmkit.data.synthetic_recall`, state tracking (``parity``, ``modular-arithmetic``) in
:mod:`ssmkit.data.synthetic_state`; all of them are registered in :data:`TASKS` below.

    from ssmkit.data.synthetic import make_task, accuracy, check
    task = make_task("mqar", vocab_size=256, seq_len=128, num_kv_pairs=8)
    train, test = task.split(10_000, 1_000, seed=0)
    out = model(train.input_ids, labels=train.labels)     # out.loss: loss on the answers only
    acc = accuracy(model(test.input_ids).logits, test)    # fraction of answers right
    assert check(test, task)                              # answers re-derived from the inputs

Tasks
-----
``SelectiveCopying`` ("selective-copying")
    Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
    arXiv:2312.00752, section 4.1.1 and figure 2 (appendix E.1). A variant of the classic
    copying task (Arjovsky, Shah & Bengio 2016, arXiv:1511.06464) in which the data tokens
    sit at *random* positions among noise tokens, so a time-invariant convolution cannot
    solve it by a fixed shift::

        5 0 0 9 0 3 0 0 | 1 | 5 9 3          (0 = noise, 1 = separator)
        ---- context ---  sep  -- answers --

``InductionHeads`` ("induction-heads")
    Gu & Dao 2023, section 4.1.2, following the synthetic of Fu et al. 2023 ("Hungry Hungry
    Hippos", arXiv:2212.14052) and the mechanism named by Olsson et al. 2022, "In-context
    Learning and Induction Heads" (Transformer Circuits Thread). A trigger token appears
    once, followed by a target; at the end the trigger appears again and the model must
    say the target ("Harry Potter ... Harry -> Potter")::

        7 4 0 9 2 5 8 ... 3 0 9              (0 = trigger, 9 = target = answer)

``MQAR`` ("mqar")
    Multi-query associative recall, Arora, Eyuboglu et al. 2023, "Zoology: Measuring and
    Improving Recall in Efficient Language Models", arXiv:2312.04927 (their generator is
    ``zoology/data/multiquery_ar.py``). Key-value pairs first, then several keys are queried;
    after each query comes the value bound to it. Query positions are drawn from Zoology's
    power law (``power_a``; 1.0 = uniform), so most queries come soon after the pairs::

        k1 v1 k2 v2 k3 v3 | 0 k2 v2 0 0 0 k1 v1 0 ...   (0 = noise; the v after a query = answer)

Glossary
--------
data token
    A token the model has to remember and reproduce (keys and values for MQAR).
noise token
    Filler (id 0 for selective copying and MQAR) carrying no information.
separator / trigger
    Special tokens that tell the model *when* to answer. Special tokens use the lowest ids.
answer position
    A position ``t`` whose token is determined by the earlier context. The model is scored on
    the logits of position ``t - 1`` (next-token prediction).
labels
    Targets aligned with ``input_ids`` in the transformers convention that ssmkit's model uses:
    ``model(input_ids, labels=labels)`` shifts internally, so the logits at ``t - 1`` are
    trained to predict ``labels[t]``. Here ``labels[t] == input_ids[t]`` at every answer
    position and ``-100`` (no loss) everywhere else; the answers are also present in
    ``input_ids`` (teacher forcing), as in ordinary language-model training.
answer_mask
    Boolean (n, seq_len), True exactly at the answer positions (``labels != -100``).
checker
    A per-task function that re-derives the answers from ``input_ids`` alone, written
    independently of the (vectorised) generator, in its own module that does not import the
    generators (:mod:`ssmkit.data.synthetic_checks`, with :class:`SyntheticBatch` and
    :func:`accuracy`); :func:`check` compares it with a batch.

Seeds: ``task.sample(n, seed)`` draws from ``torch.Generator().manual_seed(seed)``, so the same
(task, n, seed) always gives the same tensors. ``task.split(n_train, n_test, seed)`` uses seed
``2 * seed`` for train and ``2 * seed + 1`` for test: the two streams never share a seed (for
any pair of split seeds), so the sets are reproducible and independently drawn (identical
sequences can still occur by chance when the space of sequences is tiny).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import checks
from .synthetic_checks import (
    IGNORE_INDEX,
    SyntheticBatch,
    accuracy,
    associative_recall_answers,
    delay_answers,
    induction_heads_answers,
    modular_arithmetic_answers,
    mqar_answers,
    parity_answers,
    passkey_answers,
    phonebook_answers,
    selective_copying_answers,
)
from .synthetic_recall import AssociativeRecall, Delay, Passkey, Phonebook
from .synthetic_state import ModularArithmetic, Parity
from .synthetic_task import _batch, _random_subset, _require_int, _Task, check

__all__ = [
    "IGNORE_INDEX",
    "SyntheticBatch",
    "SelectiveCopying",
    "InductionHeads",
    "MQAR",
    "AssociativeRecall",
    "Passkey",
    "Phonebook",
    "Delay",
    "Parity",
    "ModularArithmetic",
    "TASKS",
    "make_task",
    "accuracy",
    "check",
    "selective_copying_answers",
    "induction_heads_answers",
    "mqar_answers",
    "associative_recall_answers",
    "passkey_answers",
    "phonebook_answers",
    "delay_answers",
    "parity_answers",
    "modular_arithmetic_answers",
]


# --------------------------------------------------------------------------------------------
# 1. Selective copying
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectiveCopying(_Task):
    """Copy the data tokens scattered in a noisy context, in order, after a separator.

    Layout of a sequence (``c = seq_len - 1 - n_tokens`` context positions)::

        positions 0 .. c-1   noise (0) with n_tokens data tokens at random distinct positions
        position  c          separator (1)
        positions c+1 ..     the n_tokens data tokens in order  <- answer positions

    Data tokens are drawn uniformly (with repetition) from ids ``2 .. vocab_size - 1``.
    Defaults follow the Mamba paper (vocabulary of 16 including the special tokens, 16 tokens
    to copy), at length 256 instead of 4096.
    """

    vocab_size: int = 16
    seq_len: int = 256
    n_tokens: int = 16

    name: ClassVar[str] = "selective-copying"
    _answers: ClassVar = staticmethod(selective_copying_answers)
    noise_id: ClassVar[int] = 0
    sep_id: ClassVar[int] = 1
    first_data_id: ClassVar[int] = 2

    def __post_init__(self):
        cls = type(self).__name__
        _require_int(cls, "n_tokens", self.n_tokens, 1)
        _require_int(cls, "vocab_size", self.vocab_size, 1)
        _require_int(cls, "seq_len", self.seq_len, 1)
        if self.vocab_size < self.first_data_id + 2:
            raise ValueError(
                f"{cls}: vocab_size={self.vocab_size} is too small: need vocab_size >= "
                f"{self.first_data_id + 2} (2 special tokens, noise={self.noise_id} and "
                f"separator={self.sep_id}, plus at least 2 data tokens)"
            )
        if self.seq_len < 2 * self.n_tokens + 1:
            raise ValueError(
                f"{cls}: seq_len={self.seq_len} is too short for n_tokens={self.n_tokens}: need "
                f"seq_len >= 2 * n_tokens + 1 = {2 * self.n_tokens + 1} (a context of at least "
                f"n_tokens positions, the separator, then n_tokens answers)"
            )

    @property
    def context_len(self) -> int:
        return self.seq_len - 1 - self.n_tokens

    def _generate(self, n, gen):
        c, k = self.context_len, self.n_tokens
        data = torch.randint(self.first_data_id, self.vocab_size, (n, k), generator=gen)
        positions = _random_subset(n, c, k, gen).sort(dim=1).values  # where the data sits, in order
        ids = torch.full((n, self.seq_len), self.noise_id, dtype=torch.long)
        ids[:, :c].scatter_(1, positions, data)
        ids[:, c] = self.sep_id
        ids[:, c + 1 :] = data
        mask = torch.zeros(n, self.seq_len, dtype=torch.bool)
        mask[:, c + 1 :] = True
        return _batch(ids, mask)


# --------------------------------------------------------------------------------------------
# 2. Induction heads
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InductionHeads(_Task):
    """Recall the token that followed the trigger's first occurrence.

    Layout (``p`` uniform in ``0 .. seq_len - 4``)::

        random data tokens, except
        position p           trigger (0)
        position p+1         target (a random data token)
        position seq_len-2   trigger (0) again
        position seq_len-1   the target                          <- the answer position

    Data tokens are uniform over ids ``1 .. vocab_size - 1``; the trigger occurs exactly twice.
    Defaults follow the Mamba paper (vocabulary 16, training length 256).
    """

    vocab_size: int = 16
    seq_len: int = 256

    name: ClassVar[str] = "induction-heads"
    _answers: ClassVar = staticmethod(induction_heads_answers)
    trigger_id: ClassVar[int] = 0
    first_data_id: ClassVar[int] = 1

    def __post_init__(self):
        cls = type(self).__name__
        _require_int(cls, "vocab_size", self.vocab_size, 1)
        _require_int(cls, "seq_len", self.seq_len, 1)
        if self.vocab_size < self.first_data_id + 2:
            raise ValueError(
                f"{cls}: vocab_size={self.vocab_size} is too small: need vocab_size >= "
                f"{self.first_data_id + 2} "
                f"(the trigger={self.trigger_id} plus at least 2 data tokens)"
            )
        if self.seq_len < 4:
            raise ValueError(
                f"{cls}: seq_len={self.seq_len} is too short: need seq_len >= 4 "
                "(trigger, target, trigger, answer)"
            )

    def _generate(self, n, gen):
        L, rows = self.seq_len, torch.arange(n)
        ids = torch.randint(self.first_data_id, self.vocab_size, (n, L), generator=gen)
        p = torch.randint(0, L - 3, (n,), generator=gen)  # first trigger in 0 .. L-4
        ids[rows, p] = self.trigger_id
        ids[:, L - 2] = self.trigger_id
        ids[:, L - 1] = ids[rows, p + 1]  # the target, already random
        mask = torch.zeros(n, L, dtype=torch.bool)
        mask[:, L - 1] = True
        return _batch(ids, mask)


# --------------------------------------------------------------------------------------------
# 3. Multi-query associative recall
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MQAR(_Task):
    """Multi-query associative recall (Zoology): after each queried key, say its value.

    Layout (``N = num_kv_pairs``)::

        positions 0 .. 2N-1     k1 v1 k2 v2 ... kN vN   (distinct keys, distinct values)
        positions 2N ..         noise (0), except num_queries queries: a key k at an even
                                offset 2N + 2s, and its value v right after   <- answer positions

    Keys are ids ``1 .. K`` with ``K = (vocab_size - 1) // 2`` and values
    ``K + 1 .. vocab_size - 1`` (Zoology likewise splits the vocabulary in halves). ``num_queries``
    distinct keys are queried (``None``: all N, as in Zoology) in random order, at query slots ``s``
    drawn without replacement with probability proportional to ``s ** (power_a - 1)`` (Zoology's
    power law, ``s = 1, 2, ...``; ``power_a=1.0`` is uniform). Unlike Zoology the value also appears
    in ``input_ids`` after the query (the teacher-forced next-token setup) and the filler is always
    the noise token, never random tokens.
    """

    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16
    num_queries: int | None = None
    power_a: float = 0.01

    name: ClassVar[str] = "mqar"
    _answers: ClassVar = staticmethod(mqar_answers)
    noise_id: ClassVar[int] = 0

    def __post_init__(self):
        cls = type(self).__name__
        _require_int(cls, "num_kv_pairs", self.num_kv_pairs, 1)
        _require_int(cls, "vocab_size", self.vocab_size, 1)
        _require_int(cls, "seq_len", self.seq_len, 1)
        if self.num_queries is None:
            object.__setattr__(self, "num_queries", self.num_kv_pairs)
        _require_int(cls, "num_queries", self.num_queries, 1)
        if self.num_queries > self.num_kv_pairs:
            raise ValueError(
                f"{cls}: num_queries={self.num_queries} must be in 1 .. num_kv_pairs="
                f"{self.num_kv_pairs} (each key is queried at most once)"
            )
        checks.number(
            self.power_a, f"{cls}: power_a", low=0, low_open=True
        )  # 1.0: uniform query positions
        if self.vocab_size < 1 + 2 * self.num_kv_pairs:
            raise ValueError(
                f"{cls}: vocab_size={self.vocab_size} is too small for num_kv_pairs="
                f"{self.num_kv_pairs}: need vocab_size >= 1 + 2 * num_kv_pairs = "
                f"{1 + 2 * self.num_kv_pairs} "
                "(noise token, plus that many distinct keys and values)"
            )
        need = 2 * self.num_kv_pairs + 2 * self.num_queries
        if self.seq_len < need:
            raise ValueError(
                f"{cls}: seq_len={self.seq_len} is too short: "
                f"need seq_len >= 2 * num_kv_pairs + 2 * num_queries = {need} "
                "(the pairs, then a key and its value per query)"
            )

    @property
    def num_keys(self) -> int:
        """Size of the key vocabulary (ids 1 .. num_keys); values are the ids above it."""
        return (self.vocab_size - 1) // 2

    @property
    def num_slots(self) -> int:
        """Number of places a query (key + value) can go after the pairs."""
        return (self.seq_len - 2 * self.num_kv_pairs) // 2

    def _generate(self, n, gen):
        N, Q, K = self.num_kv_pairs, self.num_queries, self.num_keys
        keys = _random_subset(n, K, N, gen) + 1  # ids 1 .. K
        values = _random_subset(n, self.vocab_size - 1 - K, N, gen) + K + 1  # ids K+1 .. V-1
        ids = torch.full((n, self.seq_len), self.noise_id, dtype=torch.long)
        ids[:, 0 : 2 * N : 2] = keys
        ids[:, 1 : 2 * N : 2] = values

        which = _random_subset(n, N, Q, gen)  # the pairs queried
        slot_weights = torch.arange(1, self.num_slots + 1, dtype=torch.float64) ** (
            self.power_a - 1
        )
        slots = torch.multinomial(slot_weights.expand(n, -1), Q, replacement=False, generator=gen)
        query_pos = 2 * N + 2 * slots
        ids.scatter_(1, query_pos, keys.gather(1, which))
        ids.scatter_(1, query_pos + 1, values.gather(1, which))
        mask = torch.zeros(n, self.seq_len, dtype=torch.bool)
        mask.scatter_(1, query_pos + 1, True)
        return _batch(ids, mask)


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

TASKS = {
    task.name: task
    for task in (
        SelectiveCopying,
        InductionHeads,
        MQAR,
        AssociativeRecall,
        Passkey,
        Phonebook,
        Delay,
        Parity,
        ModularArithmetic,
    )
}


def make_task(name: str, **kwargs):
    """``TASKS[name](**kwargs)``, e.g. ``make_task("mqar", num_kv_pairs=8)``."""
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; valid names: {', '.join(TASKS)}")
    cls = TASKS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(
            f"{name}: unknown parameter(s) {unknown}; valid parameters: {', '.join(sorted(fields))}"
        )
    return cls(**kwargs)
