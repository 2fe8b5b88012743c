"""State-tracking synthetic tasks (parity, modular arithmetic): seeded, well-formed, answers equal
to closed forms (bit counts, Python's own arithmetic), checkable, and their knobs checked."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import one_hot_logits, synthetic_corruptions

import ssmkit
from ssmkit.data.synthetic import (
    IGNORE_INDEX,
    TASKS,
    ModularArithmetic,
    Parity,
    SyntheticBatch,
    accuracy,
    check,
    make_task,
    modular_arithmetic_answers,
    parity_answers,
)

# small configurations (the model test needs seq_len a multiple of chunk_size=16)
SMALL = {
    "parity": ("parity", dict(seq_len=32, min_bits=3)),
    "modular-arithmetic": ("modular-arithmetic", dict(seq_len=32, min_len=3)),
    "brackets": ("modular-arithmetic", dict(seq_len=32, min_len=1, brackets=True)),
}
SYMBOLS = {2: "+", 3: "-", 4: "*", 5: "(", 6: ")"}  # ModularArithmetic's operator ids


@pytest.fixture(params=list(SMALL))
def task(request):
    name, kwargs = SMALL[request.param]
    return make_task(name, **kwargs)


def expression(row: list[int], task) -> str:
    """The text of a modular-arithmetic row's expression, e.g. "(3+-2)*4"."""
    body = [tok for tok in row[: task.seq_len - 2] if tok != task.pad_id]
    return "".join(SYMBOLS.get(tok) or str(tok - task.first_residue_id) for tok in body)


# --- determinism, shapes, the answer position -----------------------------------------------------


def test_registered_seeded_and_shaped(task):
    assert TASKS[task.name] is type(task)
    a, b, c = task.sample(64, seed=5), task.sample(64, seed=5), task.sample(64, seed=6)
    for field in ("input_ids", "labels", "answer_mask"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert not torch.equal(a.input_ids, c.input_ids)
    fresh = type(task)(**dataclasses.asdict(task))  # no hidden state in the task object
    assert torch.equal(fresh.sample(64, seed=5).input_ids, a.input_ids)
    for field, dtype in (
        ("input_ids", torch.long),
        ("labels", torch.long),
        ("answer_mask", torch.bool),
    ):
        tensor = getattr(a, field)
        assert tensor.shape == (64, task.seq_len) and tensor.dtype == dtype
    assert 0 <= a.input_ids.min() and a.input_ids.max() < task.vocab_size
    assert a.answer_mask[:, -1].all() and not a.answer_mask[:, :-1].any()  # one answer, last
    assert (a.input_ids[:, -2] == task.eq_id).all()
    assert torch.equal(a.labels[:, -1], a.input_ids[:, -1])
    assert (a.labels[:, :-1] == IGNORE_INDEX).all()
    train, test = task.split(100, 50, seed=3)
    assert torch.equal(train.input_ids, task.sample(100, seed=6).input_ids)
    assert torch.equal(test.input_ids, task.sample(50, seed=7).input_ids)


# --- answers against closed forms -----------------------------------------------------------------


def test_parity_is_the_count_of_ones_mod_2_at_every_length():
    task = Parity(seq_len=12, min_bits=2)
    batch = task.sample(3000, seed=1)
    ids = batch.input_ids
    ones = (ids[:, :-2] == task.one_id).sum(dim=1)
    assert torch.equal(ids[:, -1], torch.where(ones % 2 == 1, task.one_id, task.zero_id))
    used = ids[:, :-2] != task.pad_id
    lengths = used.sum(dim=1)
    assert set(lengths.tolist()) == set(range(2, 11))  # min_bits .. seq_len - 2
    assert torch.equal(used, used.cummax(dim=1).values)  # the padding is a prefix
    assert ((ids[:, :-2][used] == task.zero_id) | (ids[:, :-2][used] == task.one_id)).all()
    assert ids[:, -1].float().mean().item() == pytest.approx(2.5, abs=0.05)  # even and odd alike
    assert Parity(seq_len=9).min_bits == 7  # None: every row full length
    row = torch.tensor([[0, 3, 2, 3, 3, 1, 3]])  # 1 0 1 1 = odd
    assert parity_answers(row, Parity(seq_len=7, min_bits=1)).tolist() == [[IGNORE_INDEX] * 6 + [3]]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(seq_len=40, min_len=1),  # "+-*" with precedence, odd lengths 1 .. 37
        dict(seq_len=21, operators="+", modulus=7),  # a running sum mod 7
        dict(seq_len=21, operators="-*", modulus=3),
        dict(seq_len=40, min_len=1, brackets=True),  # Delétang's "+-"
        dict(seq_len=30, brackets=True, operators="+-*", modulus=11),
    ],
)
def test_modular_arithmetic_value_is_pythons(kwargs):
    task = ModularArithmetic(**kwargs)
    batch = task.sample(400, seed=2)
    for row in batch.input_ids.tolist():
        text = expression(row, task)
        # Python's own arithmetic is the oracle: the same precedence, brackets and unary minus
        assert row[-1] - task.first_residue_id == eval(text) % task.modulus, text
        assert task.brackets or "(" not in text
        assert set(text) - set("0123456789()") <= set(task.operators)
        assert len(row) - row.count(task.pad_id) - 2 >= task.min_len
    assert check(batch, task)


def test_modular_arithmetic_lengths():
    no_brackets = ModularArithmetic(seq_len=20, min_len=4)  # odd lengths 5 .. 17
    lengths = (no_brackets.sample(2000, seed=3).input_ids[:, :-2] != 0).sum(dim=1)
    assert set(lengths.tolist()) == {5, 7, 9, 11, 13, 15, 17}
    brackets = ModularArithmetic(seq_len=20, min_len=4, brackets=True)  # every length 4 .. 18
    lengths = (brackets.sample(2000, seed=3).input_ids[:, :-2] != 0).sum(dim=1)
    assert set(lengths.tolist()) == set(range(4, 19))
    assert ModularArithmetic(seq_len=20).min_len == 17  # None: the longest odd length that fits
    assert ModularArithmetic(seq_len=20, brackets=True).min_len == 18
    assert ModularArithmetic(modulus=7).vocab_size == 14
    assert (
        ModularArithmetic().operators == "+-*"
        and ModularArithmetic(brackets=True).operators == "+-"
    )
    row = torch.tensor([[0, 5, 3, 9, 4, 8, 6, 2, 10, 1, 7]])  # (-2*1)+3 = 1 (mod 5)
    task = ModularArithmetic(seq_len=11, brackets=True, operators="+-*", min_len=1)
    assert modular_arithmetic_answers(row, task).tolist() == [[IGNORE_INDEX] * 10 + [8]]


# --- the independent checker ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("parity", dict(seq_len=3)),  # smallest allowed: one bit
        ("parity", dict(seq_len=258, min_bits=40)),  # Grazzi et al.'s test lengths
        ("modular-arithmetic", dict(seq_len=3)),
        ("modular-arithmetic", dict(seq_len=3, brackets=True)),
        ("modular-arithmetic", dict(seq_len=130, min_len=1, brackets=True, operators="+-*")),
        ("modular-arithmetic", dict(seq_len=64, modulus=2, operators="+")),  # parity, as a sum
    ],
)
def test_checker_accepts_generated_batches(name, kwargs):
    task = make_task(name, **kwargs)
    batch = task.sample(200, seed=7)
    assert check(batch, task) and task.check(batch)


def _context_edit(task):
    """Change what the answer depends on, in place (see helpers.synthetic_corruptions)."""

    def edit(ids, r, t):
        if isinstance(task, Parity):  # flip the last bit
            ids[r, -3] = task.zero_id + task.one_id - ids[r, -3]
            return
        # change some residue so that the value changes (a residue times 0 would not)
        m, r0 = task.modulus, task.first_residue_id
        before = modular_arithmetic_answers(ids[r : r + 1], task)[0, -1].item()
        for at in range(task.seq_len - 2):
            if r0 <= ids[r, at] < r0 + m:
                old = ids[r, at].item()
                ids[r, at] = r0 + (old - r0 + 1) % m
                if modular_arithmetic_answers(ids[r : r + 1], task)[0, -1].item() != before:
                    return
                ids[r, at] = old
        raise AssertionError("no single residue changes this row's value")

    return edit


def test_checker_rejects_corrupted_batches(task):
    batch = task.sample(50, seed=8)
    assert check(batch, task)
    for what, bad in synthetic_corruptions(task, batch, _context_edit(task)):
        assert not check(bad, task), f"checker accepted a corrupted {what}"
    short = SyntheticBatch(batch.input_ids[:, 1:], batch.labels[:, 1:], batch.answer_mask[:, 1:])
    assert not check(short, task)


def test_checker_rejects_what_the_task_does_not_allow():
    plain = ModularArithmetic(seq_len=9, operators="+", min_len=1)
    assert (
        modular_arithmetic_answers(torch.tensor([[0, 0, 8, 2, 9, 2, 9, 1, 7]]), plain)[0, -1] == 7
    )  # 1+2+2 = 0 (mod 5)
    # brackets, an operator outside `operators`, two operators in a row are not expressions of it
    for body in ([5, 8, 2, 9, 6], [0, 0, 8, 4, 9], [0, 0, 8, 2, 2]):
        with pytest.raises(ValueError):
            modular_arithmetic_answers(torch.tensor([body + [2, 9, 1, 7]]), plain)
    # a parity row shorter than min_bits, or with a non-bit in it, is rejected
    for row in ([0, 0, 0, 2, 3, 1, 2], [0, 2, 1, 3, 3, 1, 2]):
        with pytest.raises(ValueError):
            parity_answers(torch.tensor([row]), Parity(seq_len=7, min_bits=3))


# --- accuracy and the model -----------------------------------------------------------------------


def test_accuracy_one_hot_at_t_minus_1_is_perfect(task):
    batch = task.sample(200, seed=9)
    assert accuracy(one_hot_logits(batch, task.vocab_size), batch) == 1.0
    assert (
        accuracy(one_hot_logits(batch, task.vocab_size, offset=0), batch) == 0.0
    )  # all-zero at t-1


def test_tiny_model_accepts_batches(task):
    torch.manual_seed(0)
    model = ssmkit.build_model(
        ssmkit.ModelConfig(
            d_model=32,
            n_layer=2,
            vocab_size=task.vocab_size,
            mixer="mamba2",
            headdim=16,
            d_state=16,
            chunk_size=16,
        )
    )
    batch = task.sample(4, seed=0)
    with torch.no_grad():
        out = model(batch.input_ids, labels=batch.labels)
    assert math.isfinite(out.loss.item())
    manual = torch.nn.functional.cross_entropy(out.logits[:, -2].float(), batch.input_ids[:, -1])
    assert out.loss.item() == pytest.approx(manual.item(), rel=1e-5)


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (Parity, dict(seq_len=2), r"seq_len=2 is too short: need seq_len >= 3"),
        (Parity, dict(seq_len=10, min_bits=9), r"min_bits=9 must be in 1 \.\. 8"),
        (Parity, dict(min_bits=0), r"min_bits must be a positive integer; got 0"),
        (Parity, dict(seq_len=8.0), r"seq_len must be a positive integer"),
        (ModularArithmetic, dict(modulus=1), r"modulus must be an integer >= 2; got 1"),
        (ModularArithmetic, dict(seq_len=2), r"seq_len=2 is too short: need seq_len >= 3"),
        (ModularArithmetic, dict(operators="/"), r"operators='/' must be distinct characters of"),
        (ModularArithmetic, dict(operators=""), r"operators='' must be distinct characters of"),
        (ModularArithmetic, dict(operators="++"), r"operators='\+\+' must be distinct"),
        (
            ModularArithmetic,
            dict(brackets=True, operators="+*"),
            r"operators='\+\*' with brackets must include '\+' and '-'",
        ),
        (ModularArithmetic, dict(brackets="yes"), r"brackets must be True or False; got 'yes'"),
        (ModularArithmetic, dict(seq_len=10, min_len=9), r"min_len=9 must be in 1 \.\. 8"),
        (
            ModularArithmetic,
            dict(seq_len=10, min_len=8),
            r"min_len=8 leaves no odd length in 8 \.\. 8",
        ),
    ],
)
def test_bad_parameters_raise_clear_errors(cls, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        cls(**kwargs)
    assert cls.__name__ in str(info.value)


def test_vocab_is_fixed_by_the_task():
    with pytest.raises(ValueError, match=r"parity: unknown parameter\(s\) \['vocab_size'\]"):
        make_task("parity", vocab_size=8)
