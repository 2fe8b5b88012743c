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
    "associative_recall_answers",
    "passkey_answers",
    "phonebook_answers",
    "delay_answers",
    "parity_answers",
    "modular_arithmetic_answers",
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


def _strip_padding(row: list[int], pad_id: int) -> int:
    """Index of the first token of ``row`` that is not ``pad_id`` (the padding is a prefix)."""
    start = 0
    while start < len(row) and row[start] == pad_id:
        start += 1
    return start


def associative_recall_answers(input_ids: torch.Tensor, task) -> torch.Tensor:
    """Checker: after the noise prefix, pairs (key, value) up to the last two positions; the query
    at ``seq_len - 2`` is one of their keys, and the last label is its value."""
    N, K, L = task.num_kv_pairs, task.num_keys, task.seq_len
    expected = []
    for row in input_ids.tolist():
        start = _strip_padding(row, task.noise_id)
        if start != L - 2 - 2 * N:
            raise ValueError(f"expected {L - 2 - 2 * N} noise tokens first; found {start}")
        pairs = row[start : L - 2]
        keys, values = pairs[0::2], pairs[1::2]
        if len(set(keys)) != N or not all(1 <= k <= K for k in keys):
            raise ValueError(f"expected {N} distinct keys (ids 1 .. {K}); found {keys}")
        if not all(K < v < task.vocab_size for v in values):
            raise ValueError(f"values must be ids {K + 1} .. {task.vocab_size - 1}; found {values}")
        query = row[L - 2]
        if query not in keys:
            raise ValueError(f"the query {query} at position {L - 2} is not a key of the row")
        expected.append([IGNORE_INDEX] * (L - 1) + [dict(zip(keys, values))[query]])
    return torch.tensor(expected, dtype=torch.long).reshape(input_ids.shape)


def delay_answers(input_ids: torch.Tensor, task) -> torch.Tensor:
    """Checker: the first ``seq_len - delay`` tokens are data (no noise id), then noise up to
    position ``delay``; from there every label is the token ``delay`` positions earlier."""
    D, L = task.delay, task.seq_len
    M = L - D  # the data tokens, and the answers
    expected = []
    for row in input_ids.tolist():
        data, gap, copy = row[:M], row[M:D], row[D:]
        if task.noise_id in data or any(tok != task.noise_id for tok in gap):
            raise ValueError(
                f"expected {M} data tokens, then noise ({task.noise_id}) up to position {D}"
            )
        if copy != [row[t - D] for t in range(D, L)]:
            raise ValueError(f"from position {D} each token must repeat the one {D} before it")
        expected.append([IGNORE_INDEX] * D + copy)
    return torch.tensor(expected, dtype=torch.long).reshape(input_ids.shape)


def passkey_answers(input_ids: torch.Tensor, task) -> torch.Tensor:
    """Checker: the query marker sits at ``seq_len - 1 - key_len``; the context before it is filler
    with one key marker followed by ``key_len`` digits; the labels after the query are those
    digits."""
    k, L = task.key_len, task.seq_len
    c = L - 1 - k  # the query marker's position
    digits = range(task.first_digit_id, task.first_digit_id + 10)
    expected = []
    for row in input_ids.tolist():
        if row[c] != task.query_id or row.count(task.query_id) != 1:
            raise ValueError(f"expected the query marker ({task.query_id}) once, at position {c}")
        if row.count(task.key_id) != 1 or row.index(task.key_id) + k >= c:
            raise ValueError(
                f"expected the key marker ({task.key_id}) once, with {k} digits after it before "
                f"position {c}"
            )
        s = row.index(task.key_id)
        key = row[s + 1 : s + 1 + k]
        filler = row[:s] + row[s + 1 + k : c]
        if not all(tok in digits for tok in key) or any(
            tok < task.first_filler_id for tok in filler
        ):
            raise ValueError("the passkey must be digits and the rest of the context filler")
        expected.append([IGNORE_INDEX] * (c + 1) + key)
    return torch.tensor(expected, dtype=torch.long).reshape(input_ids.shape)


def phonebook_answers(input_ids: torch.Tensor, task) -> torch.Tensor:
    """Checker: after the padding, ``num_entries`` entries (name, number, separator), then the query
    marker and a name listed exactly once; the labels after it are that entry's number."""
    a, b, L = task.name_len, task.number_len, task.seq_len
    w = a + b + 1  # an entry: name, number, separator
    digits = range(task.first_digit_id, task.first_digit_id + 10)
    expected = []
    for row in input_ids.tolist():
        start = _strip_padding(row, task.pad_id)
        if start != L - (task.num_entries + 1) * w:
            raise ValueError(
                f"expected {L - (task.num_entries + 1) * w} padding tokens first; found {start}"
            )
        book = {}
        for e in range(start, L - w, w):
            name, number, sep = tuple(row[e : e + a]), row[e + a : e + a + b], row[e + a + b]
            if (
                sep != task.sep_id
                or any(tok < task.first_name_id for tok in name)
                or not all(tok in digits for tok in number)
                or name in book
            ):
                raise ValueError(f"the entry at position {e} is not a new name, a number and a sep")
            book[name] = number
        query = tuple(row[L - w + 1 : L - b])
        if row[L - w] != task.query_id or query not in book:
            raise ValueError(
                f"expected the query marker ({task.query_id}) at position {L - w} and a listed name"
            )
        expected.append([IGNORE_INDEX] * (L - b) + book[query])
    return torch.tensor(expected, dtype=torch.long).reshape(input_ids.shape)


def parity_answers(input_ids: torch.Tensor, task) -> torch.Tensor:
    """Checker: after the padding, at least ``min_bits`` bits, then ``=`` at ``seq_len - 2``; the
    last label is the bit token of the number of ones mod 2."""
    L, bits = task.seq_len, (task.zero_id, task.one_id)
    expected = []
    for row in input_ids.tolist():
        start = _strip_padding(row, task.pad_id)
        string = row[start : L - 2]
        if row[L - 2] != task.eq_id or len(string) < task.min_bits or not set(string) <= set(bits):
            raise ValueError(
                f"expected padding, at least {task.min_bits} bits {bits}, then '=' "
                f"({task.eq_id}) at position {L - 2}"
            )
        expected.append([IGNORE_INDEX] * (L - 1) + [bits[string.count(task.one_id) % 2]])
    return torch.tensor(expected, dtype=torch.long).reshape(input_ids.shape)


def modular_arithmetic_answers(input_ids: torch.Tensor, task) -> torch.Tensor:
    """Checker: after the padding, an expression of at least ``min_len`` tokens, then ``=`` at
    ``seq_len - 2``; the last label is the residue token of its value mod ``modulus``.

    The expression is parsed by recursive descent with the usual precedence (``*`` before ``+``
    and ``-``, left to right), brackets and unary minus allowed only when ``task.brackets``, and
    binary operators only from ``task.operators``::

        expr   := term (("+" | "-") term)*
        term   := factor ("*" factor)*
        factor := residue | "-" factor | "(" expr ")"
    """
    L, m, r0 = task.seq_len, task.modulus, task.first_residue_id
    symbol = {task.plus_id: "+", task.minus_id: "-", task.times_id: "*"}
    symbol.update({task.open_id: "(", task.close_id: ")"})
    expected = []
    for row in input_ids.tolist():
        start = _strip_padding(row, task.pad_id)
        tokens = row[start : L - 2]
        if row[L - 2] != task.eq_id or len(tokens) < task.min_len:
            raise ValueError(
                f"expected padding, an expression of at least {task.min_len} tokens, then '=' "
                f"({task.eq_id}) at position {L - 2}"
            )
        at = 0

        def peek():
            return symbol.get(tokens[at]) if at < len(tokens) else None

        def expr():
            nonlocal at
            value = term()
            while peek() in ("+", "-") and peek() in task.operators:
                sign = 1 if peek() == "+" else -1
                at += 1
                value += sign * term()
            return value

        def term():
            nonlocal at
            value = factor()
            while peek() == "*" and "*" in task.operators:
                at += 1
                value *= factor()
            return value

        def factor():
            nonlocal at
            if at == len(tokens):
                raise ValueError("the expression ends where a residue is due")
            tok = tokens[at]
            at += 1
            if r0 <= tok < r0 + m:
                return tok - r0
            if task.brackets and tok == task.minus_id:
                return -factor()
            if task.brackets and tok == task.open_id:
                value = expr()
                if peek() != ")":
                    raise ValueError("a bracket is not closed")
                at += 1
                return value
            raise ValueError(f"token {tok} at expression position {at - 1} is not a residue")

        value = expr()
        if at != len(tokens):
            raise ValueError(f"token {tokens[at]} at expression position {at} is out of place")
        expected.append([IGNORE_INDEX] * (L - 1) + [r0 + value % m])
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
