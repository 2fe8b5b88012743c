"""The judging half of the synthetic tasks of :mod:`ssmkit.data.synthetic`: the batch they produce,
the checkers that re-derive each task's answers from ``input_ids`` alone, and a model's accuracy on
the answers.

The checkers are plain Python over lists, written independently of the vectorised generators, and
this module does not import the generators: an oracle that cannot share a bug with what it checks.
:func:`ssmkit.data.synthetic.check` picks a task's checker and compares its answers with a batch.
Each checker raises ValueError for a row that is not a sequence of its task. Everything here is
importable from :mod:`ssmkit.data.synthetic` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = (
    -100
)  # label of positions without a loss (torch's cross_entropy ignore_index default)

__all__ = [
    "IGNORE_INDEX",
    "SyntheticBatch",
    "accuracy",
    "selective_copying_answers",
    "induction_heads_answers",
    "mqar_answers",
]


# --------------------------------------------------------------------------------------------
# The batch
# --------------------------------------------------------------------------------------------


@dataclass
class SyntheticBatch:
    """n sequences of one task.

    input_ids:   LongTensor (n, seq_len), the full sequences (answers included).
    labels:      LongTensor (n, seq_len), ``input_ids`` at answer positions, ``-100`` elsewhere;
                 pass as ``model(input_ids, labels=labels)`` (the model shifts them).
    answer_mask: BoolTensor (n, seq_len), True at the answer positions.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    answer_mask: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index) -> SyntheticBatch:
        """Rows of the batch, e.g. ``batch[:32]`` for a minibatch (always stays 2-D)."""
        if isinstance(index, int):
            index = slice(index, index + 1) if index != -1 else slice(-1, None)
        return SyntheticBatch(self.input_ids[index], self.labels[index], self.answer_mask[index])

    def to(self, device) -> SyntheticBatch:
        return SyntheticBatch(
            self.input_ids.to(device), self.labels.to(device), self.answer_mask.to(device)
        )


# --------------------------------------------------------------------------------------------
# Checkers: the answers of each task, re-derived from input_ids alone
# --------------------------------------------------------------------------------------------


def selective_copying_answers(input_ids: torch.Tensor, task) -> torch.Tensor:
    """Checker: labels re-derived from ``input_ids`` alone (raises ValueError if a row is
    malformed).

    Per row: the single separator splits context from answers; the answers are the non-noise
    context tokens in order, and they must fill the rest of the row.
    """
    expected = []
    for row in input_ids.tolist():
        if row.count(task.sep_id) != 1:
            raise ValueError(
                f"expected exactly one separator ({task.sep_id}); found {row.count(task.sep_id)}"
            )
        sep = row.index(task.sep_id)
        data = [tok for tok in row[:sep] if tok != task.noise_id]
        if sep + 1 + len(data) != len(row):
            raise ValueError(
                f"{len(data)} data tokens in the context but {len(row) - sep - 1} positions "
                "after the separator"
            )
        expected.append([IGNORE_INDEX] * (sep + 1) + data)
    return torch.tensor(expected, dtype=torch.long).reshape(input_ids.shape)


def induction_heads_answers(input_ids: torch.Tensor, task) -> torch.Tensor:
    """Checker: the last label is the token after the trigger's first occurrence; -100 elsewhere."""
    expected = []
    for row in input_ids.tolist():
        triggers = [t for t, tok in enumerate(row) if tok == task.trigger_id]
        if len(triggers) != 2 or triggers[1] != len(row) - 2 or triggers[0] + 1 >= triggers[1]:
            raise ValueError(
                f"expected the trigger ({task.trigger_id}) once in the body and at position "
                f"{len(row) - 2}; found it at {triggers}"
            )
        expected.append([IGNORE_INDEX] * (len(row) - 1) + [row[triggers[0] + 1]])
    return torch.tensor(expected, dtype=torch.long).reshape(input_ids.shape)


def mqar_answers(input_ids: torch.Tensor, task) -> torch.Tensor:
    """Checker: read the pairs at the start; after any later occurrence of a key, its value is
    due."""
    N = task.num_kv_pairs
    expected = []
    for row in input_ids.tolist():
        bindings = dict(zip(row[0 : 2 * N : 2], row[1 : 2 * N : 2]))
        if len(bindings) != N or task.noise_id in bindings:
            raise ValueError(
                f"the first {2 * N} tokens must be {N} key-value pairs with distinct keys"
            )
        labels = [IGNORE_INDEX] * len(row)
        t = 2 * N
        while t < len(row):
            tok = row[t]
            if tok in bindings:  # a query: the next token is the answer
                if t + 1 == len(row):
                    raise ValueError(f"query of key {tok} at the last position has no answer")
                labels[t + 1] = bindings[tok]
                t += 2
            elif tok == task.noise_id:
                t += 1
            else:
                raise ValueError(
                    f"token {tok} at position {t} is neither noise nor a key of this sequence"
                )
        expected.append(labels)
    return torch.tensor(expected, dtype=torch.long).reshape(input_ids.shape)


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def accuracy(logits: torch.Tensor, batch: SyntheticBatch) -> float:
    """Fraction of answer positions predicted right.

    logits: (n, seq_len, vocab) as returned by ``model(batch.input_ids).logits`` (vocab may be
    padded beyond the task's). The answer at position t is predicted by the logits at t - 1
    (next-token prediction), so it counts as right when ``logits[:, t-1].argmax(-1) ==
    input_ids[:, t]``.
    """
    n, L = batch.input_ids.shape
    if logits.dim() != 3 or logits.shape[:2] != (n, L):
        raise ValueError(
            f"logits must be (n, seq_len, vocab) = ({n}, {L}, vocab); got {tuple(logits.shape)}"
        )
    mask = batch.answer_mask[:, 1:].to(logits.device)
    if not mask.any():
        raise ValueError("the batch has no answer positions after position 0")
    predictions = logits[:, :-1].argmax(dim=-1)
    targets = batch.input_ids[:, 1:].to(logits.device)
    return (predictions[mask] == targets[mask]).float().mean().item()
