"""Recall synthetic tasks: associative recall, passkey retrieval and phonebook lookup, where the
answer is a token (or several) seen once, far back, and fetched by content; and the delay task,
where it is fetched by its distance alone.

A fixed-size recurrent state has to hold everything that might be asked; attention can look it
up. These are the tasks on which hybrids and Transformers beat pure SSMs in the papers cited below.

    from ssmkit.data import make_task
    make_task("associative-recall", vocab_size=21, seq_len=22)    # 10 pairs, one query
    make_task("passkey", seq_len=1024, depth=0.5)                 # the key halfway through filler
    make_task("phonebook", vocab_size=64, seq_len=256)             # 36 entries of 2 + 4 tokens
    make_task("delay", seq_len=96, delay=64)                       # the token 64 steps ago

Tasks
-----
``AssociativeRecall`` ("associative-recall")
    Fu, Dao et al. 2022, "Hungry Hungry Hippos", arXiv:2212.14052, section 3.1 and table 1.
    Key-value pairs, then one key is queried at the end::

        a 2 c 4 b 3 d 1 a -> 2

    One query per sequence, at the end; the multi-query form with queries spread through the
    sequence is MQAR (:class:`ssmkit.data.synthetic.MQAR`).

``Passkey`` ("passkey")
    Mohtashami & Jaggi 2023, "Landmark Attention", arXiv:2305.16300 (used for lengths beyond
    training by Samba, Ren et al. 2024, arXiv:2406.07522): a passkey
    hidden at some depth in long repetitive filler, asked for at the end::

        f f f f K 7 1 4 3 2 f f f f f f f f Q 7 1 4 3 2    (K: "the pass key is", Q: "what is it?")

``Phonebook`` ("phonebook")
    Jelassi, Brandfonbrener, Kakade & Malach 2024, "Repeat After Me: Transformers are Better than
    State Space Models at Copying", arXiv:2402.01032, used by Waleffe et al. 2024 ("An Empirical
    Study of Mamba-based Language Models", arXiv:2406.07887): a list of
    (name, number) entries, then a name; the answer is its number::

        j o 5 5 5 1 ; a l 2 0 1 9 ; ... ? a l -> 2 0 1 9

``Delay`` ("delay")
    The copying-memory task of Arjovsky, Shah & Bengio 2016 ("Unitary Evolution Recurrent Neural
    Networks", arXiv:1511.06464), without its delimiter: output the token seen ``delay`` steps
    ago. The long-range memory test of HiPPO (Gu, Dao, Ermon, Rudra & Ré 2020, arXiv:2008.07069)
    and S4's initialisation ablations. A time-invariant model solves it with one kernel tap at
    the right lag, if its state can hold ``delay`` steps::

        7 3 9 0 0 0 0 0 7 3 9          (delay 8: data, noise, the data again)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import checks
from .synthetic_checks import (
    associative_recall_answers,
    delay_answers,
    passkey_answers,
    phonebook_answers,
)
from .synthetic_task import _batch, _random_subset, _require_int, _Task

__all__ = ["AssociativeRecall", "Delay", "Passkey", "Phonebook"]

_DIGITS = 10  # passkeys and phone numbers are decimal, as in the papers


# --------------------------------------------------------------------------------------------
# 1. Associative recall
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AssociativeRecall(_Task):
    """After key-value pairs, one key again: say its value (H3's associative recall).

    Layout (``N = num_kv_pairs``, ``p = seq_len - 2N - 2`` noise positions)::

        positions 0 .. p-1          noise (0)
        positions p .. L-3          k1 v1 k2 v2 ... kN vN   (distinct keys, values with repetition)
        position  L-2               one of the keys, uniformly
        position  L-1               its value                          <- the answer position

    Keys are ids ``1 .. K`` with ``K = (vocab_size - 1) // 2`` and values
    ``K + 1 .. vocab_size - 1`` (H3 likewise draws keys and values from two halves of the
    vocabulary). Keys are distinct so the answer is unique (H3 may repeat a pair); values are
    uniform, so a value can serve two keys.
    ``num_kv_pairs=None``: as many pairs as fit. Defaults: 10 keys and 10 values, 10 pairs.
    """

    vocab_size: int = 21
    seq_len: int = 22
    num_kv_pairs: int | None = None

    name: ClassVar[str] = "associative-recall"
    _answers: ClassVar = staticmethod(associative_recall_answers)
    noise_id: ClassVar[int] = 0

    def __post_init__(self):
        cls = type(self).__name__
        _require_int(cls, "vocab_size", self.vocab_size, 1)
        _require_int(cls, "seq_len", self.seq_len, 1)
        if self.seq_len < 4:
            raise ValueError(
                f"{cls}: seq_len={self.seq_len} is too short: need seq_len >= 4 "
                "(a key, its value, the query, the answer)"
            )
        if self.num_kv_pairs is None:
            object.__setattr__(self, "num_kv_pairs", (self.seq_len - 2) // 2)
        _require_int(cls, "num_kv_pairs", self.num_kv_pairs, 1)
        if self.seq_len < 2 * self.num_kv_pairs + 2:
            raise ValueError(
                f"{cls}: seq_len={self.seq_len} is too short: need seq_len >= 2 * num_kv_pairs + "
                f"2 = {2 * self.num_kv_pairs + 2} (the pairs, the query, the answer)"
            )
        if self.vocab_size < 1 + 2 * self.num_kv_pairs:
            raise ValueError(
                f"{cls}: vocab_size={self.vocab_size} is too small for num_kv_pairs="
                f"{self.num_kv_pairs}: need vocab_size >= 1 + 2 * num_kv_pairs = "
                f"{1 + 2 * self.num_kv_pairs} (noise token, that many distinct keys and values)"
            )

    @property
    def num_keys(self) -> int:
        """Size of the key vocabulary (ids 1 .. num_keys); values are the ids above it."""
        return (self.vocab_size - 1) // 2

    def _generate(self, n, gen):
        N, K, L = self.num_kv_pairs, self.num_keys, self.seq_len
        keys = _random_subset(n, K, N, gen) + 1
        values = torch.randint(K + 1, self.vocab_size, (n, N), generator=gen)
        which = torch.randint(0, N, (n, 1), generator=gen)
        ids = torch.full((n, L), self.noise_id, dtype=torch.long)
        p = L - 2 - 2 * N
        ids[:, p : L - 2 : 2] = keys
        ids[:, p + 1 : L - 2 : 2] = values
        ids[:, L - 2] = keys.gather(1, which)[:, 0]
        ids[:, L - 1] = values.gather(1, which)[:, 0]
        mask = torch.zeros(n, L, dtype=torch.bool)
        mask[:, L - 1] = True
        return _batch(ids, mask)


# --------------------------------------------------------------------------------------------
# 2. Passkey retrieval
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Passkey(_Task):
    """Find the passkey hidden in filler and repeat it after the question (passkey retrieval).

    Layout (``k = key_len``, ``c = seq_len - 1 - k`` context positions)::

        positions 0 .. c-1   filler, except at a start s: the key marker (0) then the k digits
        position  c          the query marker (1)
        positions c+1 ..     the k digits again                          <- the answer positions

    Digits are ids ``2 .. 11`` (uniform). The filler is the same "sentence" everywhere, as the
    original's "The grass is green. The sky is blue. ...": position t holds filler id
    ``12 + t % (vocab_size - 12)``. ``depth`` places the key at ``s = round(depth * (c - k - 1))``
    (0: first, 1: just before the question; the axis of needle-in-a-haystack plots); ``None``: s
    uniform per row. Sweep ``seq_len`` past the training length for extrapolation curves.
    Defaults: a 5-digit key (as Mohtashami & Jaggi) in 256 tokens.
    """

    seq_len: int = 256
    key_len: int = 5
    depth: float | None = None
    vocab_size: int = 16

    name: ClassVar[str] = "passkey"
    _answers: ClassVar = staticmethod(passkey_answers)
    key_id: ClassVar[int] = 0
    query_id: ClassVar[int] = 1
    first_digit_id: ClassVar[int] = 2
    first_filler_id: ClassVar[int] = 2 + _DIGITS

    def __post_init__(self):
        cls = type(self).__name__
        _require_int(cls, "key_len", self.key_len, 1)
        _require_int(cls, "vocab_size", self.vocab_size, 1)
        _require_int(cls, "seq_len", self.seq_len, 1)
        if self.depth is not None:
            checks.probability(self.depth, f"{cls}: depth")
        if self.vocab_size < self.first_filler_id + 1:
            raise ValueError(
                f"{cls}: vocab_size={self.vocab_size} is too small: need vocab_size >= "
                f"{self.first_filler_id + 1} (key and query markers, {_DIGITS} digits, at least "
                "one filler token)"
            )
        need = 2 * self.key_len + 2
        if self.seq_len < need:
            raise ValueError(
                f"{cls}: seq_len={self.seq_len} is too short for key_len={self.key_len}: need "
                f"seq_len >= 2 * key_len + 2 = {need} (marker and key, question, answer)"
            )

    @property
    def context_len(self) -> int:
        """Positions before the question: filler and the marked key."""
        return self.seq_len - 1 - self.key_len

    def _generate(self, n, gen):
        k, c, L = self.key_len, self.context_len, self.seq_len
        key = torch.randint(self.first_digit_id, self.first_filler_id, (n, k), generator=gen)
        latest = c - k - 1  # the last start that keeps the key inside the context
        if self.depth is None:
            start = torch.randint(0, latest + 1, (n,), generator=gen)
        else:
            start = torch.full((n,), round(self.depth * latest), dtype=torch.long)
        filler = self.first_filler_id + torch.arange(L) % (self.vocab_size - self.first_filler_id)
        ids = filler.expand(n, L).clone()
        block = start[:, None] + torch.arange(k + 1)  # the marker and the key
        ids.scatter_(1, block, torch.cat([torch.full((n, 1), self.key_id), key], dim=1))
        ids[:, c] = self.query_id
        ids[:, c + 1 :] = key
        mask = torch.zeros(n, L, dtype=torch.bool)
        mask[:, c + 1 :] = True
        return _batch(ids, mask)


# --------------------------------------------------------------------------------------------
# 3. Phonebook lookup
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phonebook(_Task):
    """After a phonebook of (name, number) entries, a name: say its number (phonebook lookup).

    Layout (``a = name_len``, ``b = number_len``, an entry is ``w = a + b + 1`` tokens, ``N =
    num_entries``, ``p = seq_len - (N + 1) w`` padding positions)::

        positions 0 .. p-1       padding (0)
        N entries                a name tokens, b digits, the separator (1)
        position  L-w            the query marker (2)
        positions L-w+1 .. L-b-1 a listed name, uniformly
        positions L-b ..         its number                            <- the answer positions

    Digits are ids ``3 .. 12`` (uniform); names are ``a`` tokens from ids ``13 .. vocab_size - 1``,
    distinct within a row. ``num_entries=None``: as many entries as fit. Jelassi et al. use real
    names and 10-digit numbers; the defaults here (2-token names, 4-digit numbers, 36 entries in
    256 tokens) fit a CPU.
    """

    vocab_size: int = 64
    seq_len: int = 256
    num_entries: int | None = None
    name_len: int = 2
    number_len: int = 4

    name: ClassVar[str] = "phonebook"
    _answers: ClassVar = staticmethod(phonebook_answers)
    pad_id: ClassVar[int] = 0
    sep_id: ClassVar[int] = 1
    query_id: ClassVar[int] = 2
    first_digit_id: ClassVar[int] = 3
    first_name_id: ClassVar[int] = 3 + _DIGITS

    def __post_init__(self):
        cls = type(self).__name__
        _require_int(cls, "name_len", self.name_len, 1)
        _require_int(cls, "number_len", self.number_len, 1)
        _require_int(cls, "vocab_size", self.vocab_size, 1)
        _require_int(cls, "seq_len", self.seq_len, 1)
        w = self.entry_len
        if self.num_entries is None:
            object.__setattr__(self, "num_entries", max(1, self.seq_len // w - 1))
        _require_int(cls, "num_entries", self.num_entries, 1)
        if self.vocab_size < self.first_name_id + 1:
            raise ValueError(
                f"{cls}: vocab_size={self.vocab_size} is too small: need vocab_size >= "
                f"{self.first_name_id + 1} (padding, separator, query marker, {_DIGITS} digits, at "
                "least one name token)"
            )
        need = (self.num_entries + 1) * w
        if self.seq_len < need:
            raise ValueError(
                f"{cls}: seq_len={self.seq_len} is too short: need seq_len >= (num_entries + 1) * "
                f"(name_len + number_len + 1) = {need} (the entries, then the query and answer)"
            )
        if self.num_names > 2**62:
            raise ValueError(
                f"{cls}: name_len={self.name_len} gives {self.num_names} possible names; at most "
                "2**62 are supported (use shorter names)"
            )
        if self.num_entries > self.num_names:
            raise ValueError(
                f"{cls}: num_entries={self.num_entries} is more than the {self.num_names} distinct "
                "names of name_len tokens: raise vocab_size or name_len"
            )

    @property
    def entry_len(self) -> int:
        """Tokens of one entry: name, number, separator."""
        return self.name_len + self.number_len + 1

    @property
    def num_names(self) -> int:
        """How many distinct names exist: (vocab_size - 13) ** name_len."""
        return (self.vocab_size - self.first_name_id) ** self.name_len

    def _generate(self, n, gen):
        N, a, b, L, w = (
            self.num_entries,
            self.name_len,
            self.number_len,
            self.seq_len,
            self.entry_len,
        )
        letters = self.vocab_size - self.first_name_id
        codes = _random_subset(n, self.num_names, N, gen)  # distinct names, as base-`letters` codes
        place = letters ** torch.arange(a - 1, -1, -1)
        names = self.first_name_id + codes[:, :, None] // place % letters  # (n, N, a)
        numbers = torch.randint(self.first_digit_id, self.first_name_id, (n, N, b), generator=gen)
        which = torch.randint(0, N, (n,), generator=gen)
        entries = torch.cat([names, numbers, torch.full((n, N, 1), self.sep_id)], dim=2)
        rows = torch.arange(n)
        ids = torch.full((n, L), self.pad_id, dtype=torch.long)
        ids[:, L - (N + 1) * w : L - w] = entries.reshape(n, N * w)
        ids[:, L - w] = self.query_id
        ids[:, L - w + 1 : L - b] = names[rows, which]
        ids[:, L - b :] = numbers[rows, which]
        mask = torch.zeros(n, L, dtype=torch.bool)
        mask[:, L - b :] = True
        return _batch(ids, mask)


# --------------------------------------------------------------------------------------------
# 4. Delay
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delay(_Task):
    """Output the token seen ``delay`` steps ago (copying memory at a fixed lag).

    Layout (``M = seq_len - delay`` data tokens, ``delay >= M``)::

        positions 0 .. M-1          data tokens, uniform over ids 1 .. vocab_size - 1
        positions M .. delay-1      noise (0)
        positions delay .. L-1      the data again: token t = token t - delay   <- the answers

    Every answer is exactly ``delay`` steps after its source, so the task needs no content
    lookup, only a memory of ``delay`` steps: the same lag for every answer (a time-invariant
    model can solve it), far beyond a short convolution's reach.
    """

    vocab_size: int = 16
    seq_len: int = 96
    delay: int = 64

    name: ClassVar[str] = "delay"
    _answers: ClassVar = staticmethod(delay_answers)
    noise_id: ClassVar[int] = 0
    first_data_id: ClassVar[int] = 1

    def __post_init__(self):
        cls = type(self).__name__
        _require_int(cls, "vocab_size", self.vocab_size, 1)
        _require_int(cls, "seq_len", self.seq_len, 1)
        _require_int(cls, "delay", self.delay, 1)
        if self.vocab_size < self.first_data_id + 2:
            raise ValueError(
                f"{cls}: vocab_size={self.vocab_size} is too small: need vocab_size >= "
                f"{self.first_data_id + 2} (noise={self.noise_id} plus at least 2 data tokens)"
            )
        if not self.delay < self.seq_len <= 2 * self.delay:
            raise ValueError(
                f"{cls}: need delay < seq_len <= 2 * delay (at least one answer, and the copy "
                f"after the data); got seq_len={self.seq_len}, delay={self.delay}"
            )

    def _generate(self, n, gen):
        M, D = self.seq_len - self.delay, self.delay
        data = torch.randint(self.first_data_id, self.vocab_size, (n, M), generator=gen)
        ids = torch.full((n, self.seq_len), self.noise_id, dtype=torch.long)
        ids[:, :M] = data
        ids[:, D:] = data
        mask = torch.zeros(n, self.seq_len, dtype=torch.bool)
        mask[:, D:] = True
        return _batch(ids, mask)
