"""Synthetic tasks: seeded, well-formed, checkable, scored at t-1, and accepted by the model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import one_hot_logits

import ssmkit
from ssmkit.data.synthetic import (
    IGNORE_INDEX,
    MQAR,
    TASKS,
    AssociativeRecall,
    Delay,
    InductionHeads,
    ModularArithmetic,
    Parity,
    Passkey,
    Phonebook,
    SelectiveCopying,
    SyntheticBatch,
    accuracy,
    check,
    induction_heads_answers,
    make_task,
    selective_copying_answers,
)

# small configurations of each task (the model test needs seq_len a multiple of chunk_size=16)
SMALL = {
    "selective-copying": dict(vocab_size=16, seq_len=64, n_tokens=8),
    "induction-heads": dict(vocab_size=16, seq_len=64),
    "mqar": dict(vocab_size=64, seq_len=64, num_kv_pairs=8),
}
ANSWERS_PER_ROW = {"selective-copying": 8, "induction-heads": 1, "mqar": 8}


@pytest.fixture(params=list(SMALL))  # the selection tasks; the others: test_synthetic_*.py
def name(request):
    return request.param


@pytest.fixture
def task(name):
    return make_task(name, **SMALL[name])


# --- determinism, shapes --------------------------------------------------------------------------


def test_same_seed_same_tensors_different_seed_different(task):
    a, b, c = task.sample(64, seed=5), task.sample(64, seed=5), task.sample(64, seed=6)
    for field in ("input_ids", "labels", "answer_mask"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert not torch.equal(a.input_ids, c.input_ids)
    # a fresh task object with the same parameters gives the same data too (no hidden state)
    assert torch.equal(
        type(task)(**dataclasses.asdict(task)).sample(64, seed=5).input_ids, a.input_ids
    )


def test_shapes_dtypes_and_vocabulary(task):
    batch = task.sample(32, seed=0)
    assert len(batch) == 32
    for field, dtype in (
        ("input_ids", torch.long),
        ("labels", torch.long),
        ("answer_mask", torch.bool),
    ):
        tensor = getattr(batch, field)
        assert tensor.shape == (32, task.seq_len) and tensor.dtype == dtype
    assert 0 <= batch.input_ids.min() and batch.input_ids.max() < task.vocab_size
    assert len(task.sample(0, seed=0)) == 0
    sub = batch[3:7]
    assert isinstance(sub, SyntheticBatch) and sub.input_ids.shape == (4, task.seq_len)
    assert batch[2].input_ids.shape == (1, task.seq_len) and torch.equal(
        batch[-1].labels, batch.labels[-1:]
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.seq_len = 128


def test_labels_and_answer_mask_consistent(task, name):
    batch = task.sample(256, seed=1)
    mask = batch.answer_mask
    assert torch.equal(mask, batch.labels != IGNORE_INDEX)
    assert torch.equal(batch.labels[mask], batch.input_ids[mask])
    assert (batch.labels[~mask] == IGNORE_INDEX).all()
    assert (mask.sum(dim=1) == ANSWERS_PER_ROW[name]).all()
    assert not mask[:, 0].any()  # position 0 can never be predicted


# --- per-task structure ---------------------------------------------------------------------------


def test_selective_copying_layout():
    task = SelectiveCopying(vocab_size=10, seq_len=41, n_tokens=5)
    batch = task.sample(500, seed=2)
    c = task.context_len
    assert c == 35
    assert (batch.input_ids[:, c] == task.sep_id).all()
    assert batch.answer_mask[:, c + 1 :].all() and not batch.answer_mask[:, : c + 1].any()
    context = batch.input_ids[:, :c]
    assert ((context != task.noise_id).sum(dim=1) == 5).all()
    assert (batch.labels[batch.answer_mask] >= task.first_data_id).all()
    # the data tokens really are scattered: every context position is used by some row
    assert (context != task.noise_id).any(dim=0).all()
    # a hand-made row: answers are the non-noise context tokens in order
    row = torch.tensor([[0, 7, 0, 0, 3, 0, 9, 0, 1, 7, 3, 9]])
    answers = selective_copying_answers(
        row, SelectiveCopying(vocab_size=10, seq_len=12, n_tokens=3)
    )
    assert answers.tolist() == [[IGNORE_INDEX] * 9 + [7, 3, 9]]


def test_induction_heads_layout():
    task = InductionHeads(vocab_size=8, seq_len=20)
    batch = task.sample(2000, seed=3)
    ids = batch.input_ids
    assert ((ids == task.trigger_id).sum(dim=1) == 2).all()
    assert (ids[:, -2] == task.trigger_id).all()
    first = (ids == task.trigger_id).int().argmax(dim=1)
    assert torch.equal(ids[:, -1], ids[torch.arange(len(ids)), first + 1])
    assert set(first.tolist()) == set(
        range(task.seq_len - 3)
    )  # every allowed first position occurs
    row = torch.tensor([[5, 0, 6, 2, 3, 0, 6]])
    answers = induction_heads_answers(row, InductionHeads(vocab_size=8, seq_len=7))
    assert answers.tolist() == [[-100] * 6 + [6]]


def test_mqar_layout_and_power_law():
    task = MQAR(vocab_size=101, seq_len=64, num_kv_pairs=6, num_queries=4, power_a=0.01)
    batch = task.sample(1000, seed=4)
    ids, N = batch.input_ids, task.num_kv_pairs
    keys, values = ids[:, 0 : 2 * N : 2], ids[:, 1 : 2 * N : 2]
    assert ((keys >= 1) & (keys <= task.num_keys)).all() and (values > task.num_keys).all()
    assert (keys.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct keys per row
    assert (values.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct values per row
    assert (batch.answer_mask.sum(dim=1) == 4).all()
    answer_pos = batch.answer_mask.nonzero()[:, 1]
    assert (answer_pos >= 2 * N + 1).all() and ((answer_pos - 2 * N) % 2 == 1).all()
    # the queried keys are distinct and bound to the answers
    for row, lab in zip(ids[:50].tolist(), batch.labels[:50].tolist()):
        binding = dict(zip(row[0 : 2 * N : 2], row[1 : 2 * N : 2]))
        queried = [row[t - 1] for t in range(len(row)) if lab[t] != IGNORE_INDEX]
        assert len(set(queried)) == 4
        assert all(lab[t] == binding[row[t - 1]] for t in range(len(row)) if lab[t] != -100)
    # power_a=0.01 puts queries much earlier than uniform placement (power_a=1)
    uniform = dataclasses.replace(task, power_a=1.0).sample(1000, seed=4)
    early = batch.answer_mask.nonzero()[:, 1].float().mean()
    flat = uniform.answer_mask.nonzero()[:, 1].float().mean()
    assert early < flat - 5
    assert MQAR(vocab_size=101, seq_len=64, num_kv_pairs=6).num_queries == 6  # None -> all keys


# --- the independent checker ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("selective-copying", dict(vocab_size=4, seq_len=3, n_tokens=1)),  # smallest allowed
        ("selective-copying", dict(vocab_size=16, seq_len=256, n_tokens=16)),
        ("selective-copying", dict(vocab_size=30, seq_len=21, n_tokens=10)),  # context exactly full
        ("induction-heads", dict(vocab_size=3, seq_len=4)),
        ("induction-heads", dict(vocab_size=16, seq_len=256)),
        ("mqar", dict(vocab_size=5, seq_len=4, num_kv_pairs=1)),
        ("mqar", dict(vocab_size=33, seq_len=64, num_kv_pairs=16)),  # every key used, no spare slot
        ("mqar", dict(vocab_size=8192, seq_len=256, num_kv_pairs=16, num_queries=5, power_a=1.0)),
    ],
)
def test_checker_accepts_generated_batches(name, kwargs):
    task = make_task(name, **kwargs)
    batch = task.sample(300, seed=7)
    assert check(batch, task) and task.check(batch)


def _corruptions(task, batch):
    """(description, corrupted batch) pairs that a correct checker must reject."""

    def copy():
        return SyntheticBatch(
            batch.input_ids.clone(), batch.labels.clone(), batch.answer_mask.clone()
        )

    rows, cols = batch.answer_mask.nonzero(as_tuple=True)
    r, t = rows[0].item(), cols[0].item()
    out = []

    b = copy()  # a wrong label (in range, a valid-looking token)
    b.labels[r, t] = (
        b.labels[r, t] % (task.vocab_size - 1) + 1 if b.labels[r, t] != task.vocab_size - 1 else 1
    )
    out.append(("label", b))
    b = copy()  # the answer token in the input differs from the label
    b.input_ids[r, t] = (
        batch.input_ids[r, t] - 1 if batch.input_ids[r, t] > 2 else batch.input_ids[r, t] + 1
    )
    out.append(("input answer", b))
    b = copy()  # mask and labels disagree
    b.answer_mask[r, t] = False
    out.append(("mask", b))

    b = (
        copy()
    )  # the context changes, so the derived answer changes while input/labels keep the old one
    if isinstance(task, SelectiveCopying):
        p = (b.input_ids[r, : task.context_len] != task.noise_id).nonzero()[0].item()
        b.input_ids[r, p] = task.first_data_id + (b.input_ids[r, p] - task.first_data_id + 1) % (
            task.vocab_size - task.first_data_id
        )
    elif isinstance(task, InductionHeads):
        p = (b.input_ids[r] == task.trigger_id).nonzero()[0].item() + 1
        b.input_ids[r, p] = task.first_data_id + (b.input_ids[r, p] - task.first_data_id + 1) % (
            task.vocab_size - task.first_data_id
        )
    else:  # rebind the queried key to another value
        key = b.input_ids[r, t - 1]
        p = (b.input_ids[r, : 2 * task.num_kv_pairs] == key).nonzero()[0].item() + 1
        b.input_ids[r, p] = (
            task.vocab_size - 1 if b.input_ids[r, p] != task.vocab_size - 1 else task.num_keys + 1
        )
    out.append(("context", b))

    b = copy()  # an extra answer position that the inputs do not justify
    b.answer_mask[r, 0] = True
    b.labels[r, 0] = b.input_ids[r, 0]
    out.append(("extra answer", b))
    return out


def test_checker_rejects_corrupted_batches(task, name):
    batch = task.sample(50, seed=8)
    assert check(batch, task)
    for what, bad in _corruptions(task, batch):
        assert not check(bad, task), f"checker accepted a corrupted {what}"
    # a batch of another task, or of another length, is rejected too
    other_name = "mqar" if name == "induction-heads" else "induction-heads"
    assert not check(make_task(other_name, **SMALL[other_name]).sample(20, seed=0), task)
    assert not check(
        SyntheticBatch(batch.input_ids[:, :-1], batch.labels[:, :-1], batch.answer_mask[:, :-1]),
        task,
    )


# --- train / test ---------------------------------------------------------------------------------


def test_split_is_reproducible_and_disjoint(task):
    train, test = task.split(500, 200, seed=3)
    train2, test2 = task.split(500, 200, seed=3)
    assert torch.equal(train.input_ids, train2.input_ids) and torch.equal(
        test.input_ids, test2.input_ids
    )
    assert len(train) == 500 and len(test) == 200
    assert not torch.equal(train.input_ids[:200], test.input_ids)
    train_rows = {tuple(row) for row in train.input_ids.tolist()}
    assert not any(tuple(row) in train_rows for row in test.input_ids.tolist())
    assert torch.equal(
        train.input_ids, task.sample(500, seed=6).input_ids
    )  # documented seeds: 2s, 2s+1
    assert torch.equal(test.input_ids, task.sample(200, seed=7).input_ids)
    other_train, _ = task.split(500, 200, seed=4)
    assert not torch.equal(train.input_ids, other_train.input_ids)
    assert check(train, task) and check(test, task)


# --- accuracy -------------------------------------------------------------------------------------


def test_accuracy_one_hot_at_t_minus_1_is_perfect_and_misaligned_is_not(task, name):
    batch = task.sample(400, seed=9)
    assert accuracy(one_hot_logits(batch, task.vocab_size), batch) == 1.0
    assert accuracy(one_hot_logits(batch, task.vocab_size + 5), batch) == 1.0  # padded model vocab
    # one-hot at t (the classic off-by-one) scores about chance, or zero where the previous
    # position is not an answer (its all-zero logits argmax to id 0, a special token)
    shifted = accuracy(one_hot_logits(batch, task.vocab_size, offset=0), batch)
    chance = 1 / (task.vocab_size - 2)
    assert shifted < 3 * chance
    if name != "selective-copying":
        assert shifted == 0.0


def test_accuracy_counts_exact_fraction():
    task = SelectiveCopying(vocab_size=16, seq_len=64, n_tokens=8)
    batch = task.sample(10, seed=0)
    logits = one_hot_logits(batch, 16)
    first_answer = batch.answer_mask.int().argmax(dim=1)
    logits[torch.arange(10), first_answer - 1] = 0.0  # predict noise (0) for the first answer
    assert accuracy(logits, batch) == pytest.approx(7 / 8)
    with pytest.raises(ValueError, match="logits must be"):
        accuracy(logits[:, :-1], batch)


# --- the model accepts the batches ----------------------------------------------------------------


def test_tiny_model_accepts_batches_and_the_loss_is_on_the_answers(task):
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
    assert out.loss is not None and math.isfinite(out.loss.item())
    # the model's internal shift scores exactly the logits at t-1 against the answer at t
    mask = batch.answer_mask[:, 1:]
    manual = F.cross_entropy(out.logits[:, :-1][mask].float(), batch.input_ids[:, 1:][mask])
    assert out.loss.item() == pytest.approx(manual.item(), rel=1e-5)
    assert 0.0 <= accuracy(out.logits, batch) <= 1.0


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (SelectiveCopying, dict(vocab_size=3), r"vocab_size=3 is too small: need vocab_size >= 4"),
        (
            SelectiveCopying,
            dict(seq_len=32, n_tokens=16),
            r"seq_len=32 is too short for n_tokens=16: need seq_len >= .*33",
        ),
        (SelectiveCopying, dict(n_tokens=0), r"n_tokens must be a positive integer; got 0"),
        (SelectiveCopying, dict(seq_len=64.0), r"seq_len must be a positive integer"),
        (InductionHeads, dict(vocab_size=2), r"vocab_size=2 is too small: need vocab_size >= 3"),
        (InductionHeads, dict(seq_len=3), r"seq_len=3 is too short: need seq_len >= 4"),
        (InductionHeads, dict(vocab_size=True), r"vocab_size must be a positive integer"),
        (
            MQAR,
            dict(vocab_size=32, num_kv_pairs=16),
            r"vocab_size=32 is too small for num_kv_pairs=16: need vocab_size >= .*33",
        ),
        (MQAR, dict(seq_len=40, num_kv_pairs=16), r"seq_len=40 is too short: need seq_len >= .*64"),
        (
            MQAR,
            dict(num_kv_pairs=4, num_queries=5),
            r"num_queries=5 must be in 1 \.\. num_kv_pairs=4",
        ),
        (MQAR, dict(num_queries=0), r"num_queries must be a positive integer"),
        (MQAR, dict(power_a=0.0), r"power_a must be a positive number"),
        (MQAR, dict(power_a=float("nan")), r"power_a must be a positive number"),
    ],
)
def test_bad_parameters_raise_clear_errors(cls, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        cls(**kwargs)
    assert cls.__name__ in str(info.value)


def test_bad_sample_arguments(task):
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        task.sample(4, seed=-1)
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        task.sample(-1, seed=0)
    with pytest.raises(ValueError, match="seed must be"):
        task.split(4, 4, seed="0")


def test_registry_and_unknown_names():
    assert TASKS == {
        "selective-copying": SelectiveCopying,
        "induction-heads": InductionHeads,
        "mqar": MQAR,
        "associative-recall": AssociativeRecall,
        "passkey": Passkey,
        "phonebook": Phonebook,
        "delay": Delay,
        "parity": Parity,
        "modular-arithmetic": ModularArithmetic,
    }
    assert make_task("mqar", num_kv_pairs=4) == MQAR(num_kv_pairs=4)
    for name, cls in TASKS.items():
        assert isinstance(make_task(name), cls) and cls.name == name
    with pytest.raises(
        ValueError,
        match="unknown synthetic task 'copying'; valid names: selective-copying, "
        "induction-heads, mqar, associative-recall, passkey, phonebook, delay, parity, "
        "modular-arithmetic",
    ):
        make_task("copying")
    with pytest.raises(
        ValueError, match=r"unknown parameter\(s\) \['n_tokens'\]; valid parameters: "
    ):
        make_task("mqar", n_tokens=3)
    with pytest.raises(TypeError, match="no checker"):
        check(MQAR().sample(1, seed=0), object())
