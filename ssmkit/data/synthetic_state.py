"""State-tracking synthetic tasks: parity and modular arithmetic, the tasks a linear recurrence
solves only with negative or complex eigenvalues in its state transition.

Sarrof et al. 2024 and Grazzi et al. 2025 ("Unlocking State-Tracking in Linear RNNs Through
Negative Eigenvalues", arXiv:2411.12537, theorem 1) show that a linear recurrence whose transition
has eigenvalues only in [0, 1] (Mamba-1/2's ``exp(Δ A)``) cannot compute parity at every length;
a rotation can (parity is a half turn per 1). Mamba-3 (Lahoti et al. 2026, arXiv:2603.15569, its
state-tracking experiments) gets the rotation from complex-valued states and tests it on parity
and on modular arithmetic without and with brackets, the tasks and protocol of Grazzi et al., who
take them from Delétang et al. 2023 ("Neural Networks and the Chomsky Hierarchy",
arXiv:2207.02098; ``tasks/regular/parity_check.py``, ``tasks/regular/modular_arithmetic.py``,
``tasks/dcf/modular_arithmetic_brackets.py``): one answer after the whole string, strings of
length 3 .. 40 in training and 40 .. 256 at test.

    from ssmkit.data import make_task
    train = make_task("parity", seq_len=42, min_bits=3)          # strings of 3 .. 40 bits
    test = make_task("parity", seq_len=258, min_bits=40)          # 40 .. 256: beyond training
    arith = make_task("modular-arithmetic", modulus=5, brackets=True)

Both tasks give the answer once, after ``=`` at the end (Delétang's form). A running answer
(the parity of every prefix) is not offered: with teacher forcing each earlier answer is in the
input, so the next one is ``previous XOR bit``, a two-token lookup that needs no state. Shorter
strings are left-padded, so the answer is always at the last position::

    0 0 0 3 2 3 2 1 | 2          (pad pad pad 1 0 1 0 = | even)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import torch

from .synthetic_checks import modular_arithmetic_answers, parity_answers
from .synthetic_task import _batch, _require_int, _Task

__all__ = ["Parity", "ModularArithmetic"]


def _resolve_min(task, field: str, maximum: int, default: int) -> int:
    """The validated minimum length ``field`` of ``task`` (None: ``default``), in 1 .. maximum."""
    value = getattr(task, field)
    if value is None:
        object.__setattr__(task, field, default)
        return default
    _require_int(type(task).__name__, field, value, 1)
    if value > maximum:
        raise ValueError(
            f"{type(task).__name__}: {field}={value} must be in 1 .. {maximum} (seq_len - 2, the "
            f"longest string that fits before '=' and the answer)"
        )
    return value


def _place(strings: torch.Tensor, lengths: torch.Tensor, task, answers: torch.Tensor):
    """The batch of rows ``pad .. pad, string, =, answer``.

    strings: (n, seq_len - 2), each row's string right-aligned (its last ``lengths[i]`` tokens);
    lengths: (n,); answers: (n,) token ids.
    """
    n, L = strings.shape[0], task.seq_len
    used = torch.arange(L - 2) >= (L - 2 - lengths)[:, None]
    ids = torch.full((n, L), task.pad_id, dtype=torch.long)
    ids[:, : L - 2] = torch.where(used, strings, task.pad_id)
    ids[:, L - 2] = task.eq_id
    ids[:, L - 1] = answers
    mask = torch.zeros(n, L, dtype=torch.bool)
    mask[:, L - 1] = True
    return _batch(ids, mask)


# --------------------------------------------------------------------------------------------
# 1. Parity
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parity(_Task):
    """Say whether a bit string holds an even or odd number of ones (Delétang et al.'s parity
    check).

    Layout (``b`` bits, uniform in ``min_bits .. seq_len - 2`` per row)::

        positions 0 .. L-3-b   padding (0)
        positions L-2-b .. L-3 the bits: 2 = "0", 3 = "1", uniform
        position  L-2          "=" (1)
        position  L-1          2 if the number of ones is even, 3 if odd   <- the answer position

    Vocabulary: 4 ids (0 pad, 1 "=", 2 and 3 the bits and the answers). ``min_bits=None``: every
    row has ``seq_len - 2`` bits. The defaults are Grazzi et al.'s longest training strings (40
    bits); ``Parity(seq_len=42, min_bits=3)`` is their training range.
    """

    seq_len: int = 42
    min_bits: int | None = None

    name: ClassVar[str] = "parity"
    _answers: ClassVar = staticmethod(parity_answers)
    pad_id: ClassVar[int] = 0
    eq_id: ClassVar[int] = 1
    zero_id: ClassVar[int] = 2
    one_id: ClassVar[int] = 3
    vocab_size: ClassVar[int] = 4

    def __post_init__(self):
        cls = type(self).__name__
        _require_int(cls, "seq_len", self.seq_len, 1)
        if self.seq_len < 3:
            raise ValueError(
                f"{cls}: seq_len={self.seq_len} is too short: need seq_len >= 3 "
                "(a bit, '=', the answer)"
            )
        _resolve_min(self, "min_bits", self.seq_len - 2, self.seq_len - 2)

    def _generate(self, n, gen):
        L = self.seq_len
        bits = torch.randint(0, 2, (n, L - 2), generator=gen)
        lengths = torch.randint(self.min_bits, L - 1, (n,), generator=gen)
        used = torch.arange(L - 2) >= (L - 2 - lengths)[:, None]
        odd = (bits * used).sum(dim=1) % 2
        return _place(self.zero_id + bits, lengths, self, self.zero_id + odd)


# --------------------------------------------------------------------------------------------
# 2. Modular arithmetic
# --------------------------------------------------------------------------------------------

_OPERATORS = "+-*"


@dataclass(frozen=True)
class ModularArithmetic(_Task):
    """Reduce an arithmetic expression of residues mod ``modulus`` (Delétang et al.'s modular
    arithmetic, without or with brackets).

    Without brackets (``tasks/regular/modular_arithmetic.py``): ``r op r op ... r``, residues
    uniform in ``0 .. modulus - 1`` and operators uniform over ``operators``, evaluated with ``*``
    before ``+`` and ``-``; the length is odd. With brackets (``tasks/dcf/...brackets.py``):
    Delétang's grammar, drawn top down at an exact length ``n``: ``d`` (n=1), ``-d`` (2), ``(d)``
    (3), ``(-d)`` (4), else ``(E op E)`` with the left part's length uniform in ``1 .. n-4``.
    ``operators="+"`` without brackets is a running sum mod m (commutative: no rotation needed
    beyond one of order m).

    Layout (an expression of ``e`` tokens, ``e`` uniform in ``min_len .. seq_len - 2``, odd
    lengths only without brackets)::

        positions 0 .. L-3-e   padding (0)
        positions L-2-e .. L-3 the expression
        position  L-2          "=" (1)
        position  L-1          the value's residue token                  <- the answer position

    Vocabulary (``vocab_size = 7 + modulus``): 0 pad, 1 "=", 2 "+", 3 "-", 4 "*", 5 "(", 6 ")",
    then ``7 + r`` for residue r. ``operators=None``: Delétang's defaults, ``"+-*"`` without
    brackets and ``"+-"`` with; with brackets ``"+"`` and ``"-"`` are required (``-`` is also the
    unary minus of the grammar). ``min_len=None``: the longest length that fits. Defaults: modulus
    5 as Delétang et al., expressions up to 40 tokens as Grazzi et al.'s training.
    """

    seq_len: int = 42
    modulus: int = 5
    brackets: bool = False
    operators: str | None = None
    min_len: int | None = None

    name: ClassVar[str] = "modular-arithmetic"
    _answers: ClassVar = staticmethod(modular_arithmetic_answers)
    pad_id: ClassVar[int] = 0
    eq_id: ClassVar[int] = 1
    plus_id: ClassVar[int] = 2
    minus_id: ClassVar[int] = 3
    times_id: ClassVar[int] = 4
    open_id: ClassVar[int] = 5
    close_id: ClassVar[int] = 6
    first_residue_id: ClassVar[int] = 7

    def __post_init__(self):
        cls = type(self).__name__
        _require_int(cls, "seq_len", self.seq_len, 1)
        _require_int(cls, "modulus", self.modulus, 2)
        if not isinstance(self.brackets, bool):
            raise ValueError(f"{cls}: brackets must be True or False; got {self.brackets!r}")
        if self.operators is None:
            object.__setattr__(self, "operators", "+-" if self.brackets else _OPERATORS)
        ops = self.operators
        if (
            not isinstance(ops, str)
            or not ops
            or len(set(ops)) != len(ops)
            or not set(ops) <= set(_OPERATORS)
        ):
            raise ValueError(
                f"{cls}: operators={ops!r} must be distinct characters of {_OPERATORS!r}, "
                "e.g. '+' or '+-*'"
            )
        if self.brackets and not {"+", "-"} <= set(ops):
            raise ValueError(
                f"{cls}: operators={ops!r} with brackets must include '+' and '-' "
                "(Delétang's grammar: '+-' or '+-*')"
            )
        if self.seq_len < 3:
            raise ValueError(
                f"{cls}: seq_len={self.seq_len} is too short: need seq_len >= 3 "
                "(a residue, '=', the answer)"
            )
        longest = self.max_len if self.brackets else self.max_len - (self.max_len + 1) % 2
        min_len = _resolve_min(self, "min_len", self.max_len, longest)
        if min_len > longest:
            raise ValueError(
                f"{cls}: min_len={min_len} leaves no odd length in {min_len} .. {self.max_len} "
                "(without brackets an expression 'r op r ... r' has odd length)"
            )

    @property
    def vocab_size(self) -> int:
        return self.first_residue_id + self.modulus

    @property
    def max_len(self) -> int:
        """The longest expression: ``seq_len - 2`` tokens."""
        return self.seq_len - 2

    def _generate(self, n, gen):
        if self.brackets:
            return self._generate_brackets(n, gen)
        m, T = self.modulus, (self.max_len + 1) // 2  # T: the most residues a row can hold
        residues = torch.randint(0, m, (n, T), generator=gen)
        op_ids = torch.tensor([self.plus_id + _OPERATORS.index(op) for op in self.operators])
        ops = op_ids[torch.randint(0, len(op_ids), (n, max(T - 1, 0)), generator=gen)]
        # residues per row: the odd lengths min_len .. max_len are 2t - 1 for t in lo .. T
        lo = self.min_len // 2 + 1
        terms = torch.randint(lo, T + 1, (n,), generator=gen)
        # evaluate the last `terms` residues of each row left to right: `total` holds the sum of
        # the finished products, `product` the signed product being built (``*`` binds tighter)
        total = torch.zeros(n, dtype=torch.long)
        product = torch.zeros(n, dtype=torch.long)
        for j in range(T):
            first, later = j == T - terms, j > T - terms
            product = torch.where(first, residues[:, j], product)
            if j == 0:
                continue
            op = ops[:, j - 1]
            times = later & (op == self.times_id)
            new_term = later & ~times
            total = torch.where(new_term, (total + product) % m, total)
            sign = torch.where(op == self.minus_id, -1, 1)
            product = torch.where(times, product * residues[:, j] % m, product)
            product = torch.where(new_term, sign * residues[:, j], product)
        value = (total + product) % m
        expression = torch.empty(n, 2 * T - 1, dtype=torch.long)
        expression[:, 0::2] = self.first_residue_id + residues
        expression[:, 1::2] = ops
        strings = torch.full((n, self.max_len), self.pad_id, dtype=torch.long)
        strings[:, self.max_len - (2 * T - 1) :] = expression
        return _place(strings, 2 * terms - 1, self, self.first_residue_id + value)

    def _generate_brackets(self, n, gen):
        lengths = torch.randint(self.min_len, self.max_len + 1, (n,), generator=gen)
        # one Python stream per row, seeded from `gen`: Delétang's recursive draw is sequential
        seeds = torch.randint(0, 2**62, (n,), generator=gen).tolist()
        strings = torch.full((n, self.max_len), self.pad_id, dtype=torch.long)
        values = torch.empty(n, dtype=torch.long)
        for i, (length, seed) in enumerate(zip(lengths.tolist(), seeds)):
            tokens, values[i] = self._bracketed(length, random.Random(seed))
            strings[i, self.max_len - length :] = torch.tensor(tokens)
        return _place(strings, lengths, self, self.first_residue_id + values)

    def _bracketed(self, length: int, rng: random.Random) -> tuple[list[int], int]:
        """(tokens, value mod m) of an expression of exactly ``length`` tokens, Delétang's
        ``generate_one_expression_and_result``."""
        m, r0 = self.modulus, self.first_residue_id
        if length <= 4:
            d = rng.randrange(m)
            tokens = {
                1: [r0 + d],
                2: [self.minus_id, r0 + d],
                3: [self.open_id, r0 + d, self.close_id],
                4: [self.open_id, self.minus_id, r0 + d, self.close_id],
            }[length]
            return tokens, (-d if length % 2 == 0 else d) % m
        left_len = rng.randint(1, length - 4)
        left, a = self._bracketed(left_len, rng)
        right, b = self._bracketed(length - left_len - 3, rng)
        op = rng.choice(self.operators)
        value = {"+": a + b, "-": a - b, "*": a * b}[op] % m
        op_id = self.plus_id + _OPERATORS.index(op)
        return [self.open_id, *left, op_id, *right, self.close_id], value
