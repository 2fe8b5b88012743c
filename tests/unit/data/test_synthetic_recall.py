"""Recall synthetic tasks (associative recall, passkey, phonebook, delay): seeded, well-formed,
checkable against an independent re-derivation, scored at t-1, and their knobs checked."""

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
    AssociativeRecall,
    Delay,
    Passkey,
    Phonebook,
    SyntheticBatch,
    accuracy,
    check,
    delay_answers,
    make_task,
    passkey_answers,
    phonebook_answers,
)

# small configurations (the model test needs seq_len a multiple of chunk_size=16)
SMALL = {
    "associative-recall": dict(vocab_size=33, seq_len=32),  # 15 pairs, 16 keys
    "passkey": dict(seq_len=64, key_len=4),
    "phonebook": dict(vocab_size=32, seq_len=64, name_len=2, number_len=3),  # 9 entries
    "delay": dict(vocab_size=8, seq_len=48, delay=40),  # 8 data tokens
}
ANSWERS_PER_ROW = {"associative-recall": 1, "passkey": 4, "phonebook": 3, "delay": 8}


@pytest.fixture(params=list(SMALL))
def name(request):
    return request.param


@pytest.fixture
def task(name):
    return make_task(name, **SMALL[name])


# --- determinism, shapes, answer positions -------------------------------------------------------


def test_registered_seeded_and_shaped(task, name):
    assert TASKS[name] is type(task) and task.name == name
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
    assert len(task.sample(0, seed=0)) == 0
    # the answers are the last ANSWERS_PER_ROW positions, and labels mirror them
    k = ANSWERS_PER_ROW[name]
    assert a.answer_mask[:, -k:].all() and not a.answer_mask[:, :-k].any()
    assert torch.equal(a.labels[a.answer_mask], a.input_ids[a.answer_mask])
    assert (a.labels[~a.answer_mask] == IGNORE_INDEX).all()
    train, test = task.split(100, 50, seed=3)
    assert torch.equal(train.input_ids, task.sample(100, seed=6).input_ids)
    assert torch.equal(test.input_ids, task.sample(50, seed=7).input_ids)


# --- per-task structure (oracles written with tensor ops, apart from the checkers) ----------------


def test_associative_recall_layout():
    task = AssociativeRecall(vocab_size=21, seq_len=20, num_kv_pairs=6)
    batch = task.sample(2000, seed=1)
    ids, N, K, L = batch.input_ids, 6, task.num_keys, 20
    p = L - 2 - 2 * N
    assert K == 10 and (ids[:, :p] == task.noise_id).all()
    keys, values = ids[:, p : L - 2 : 2], ids[:, p + 1 : L - 2 : 2]
    assert ((keys >= 1) & (keys <= K)).all() and ((values > K) & (values < 21)).all()
    assert (keys.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct keys per row
    hit = keys == ids[:, L - 2 : L - 1]  # which pair is queried: exactly one
    assert (hit.sum(dim=1) == 1).all()
    assert torch.equal(ids[:, L - 1], values[hit])
    assert set(hit.int().argmax(dim=1).tolist()) == set(range(N))  # every pair gets queried
    # values repeat within a row sometimes (uniform draws), keys never
    assert (values.sort(dim=1).values.diff(dim=1) == 0).any()
    assert AssociativeRecall(vocab_size=21, seq_len=23).num_kv_pairs == 10  # None: as many as fit


def test_passkey_depth_and_filler():
    task = Passkey(seq_len=40, key_len=3, vocab_size=15)
    c, latest = task.context_len, task.context_len - 3 - 1
    assert c == 36
    batch = task.sample(3000, seed=2)
    ids = batch.input_ids
    starts = (ids == task.key_id).int().argmax(dim=1)
    assert ((ids == task.key_id).sum(dim=1) == 1).all() and (ids[:, c] == task.query_id).all()
    assert set(starts.tolist()) == set(range(latest + 1))  # depth=None: every start occurs
    key = torch.stack([ids[torch.arange(3000), starts + 1 + i] for i in range(3)], dim=1)
    assert torch.equal(ids[:, c + 1 :], key)
    assert ((key >= 2) & (key <= 11)).all()
    filler = 12 + torch.arange(40) % 3  # the fixed "sentence": 12 13 14 12 13 14 ...
    outside = torch.ones_like(ids, dtype=torch.bool)
    outside[:, c:] = False
    for i in range(4):
        outside[torch.arange(3000), starts + i] = False
    assert (ids == filler)[outside].all()
    # depth 0 puts the key first, 1 just before the question, 0.5 halfway
    for depth, start in ((0.0, 0), (1.0, latest), (0.5, round(0.5 * latest))):
        row = dataclasses.replace(task, depth=depth).sample(5, seed=0).input_ids
        assert (row[:, start] == task.key_id).all()
    # a longer sequence (beyond a training length) is the same task, further apart
    long = dataclasses.replace(task, seq_len=400).sample(10, seed=0)
    assert check(long, dataclasses.replace(task, seq_len=400))
    row = torch.tensor([[12, 0, 5, 6, 7, 13, 14, 12, 13, 1, 5, 6, 7]])
    answers = passkey_answers(row, Passkey(seq_len=13, key_len=3, vocab_size=15))
    assert answers.tolist() == [[IGNORE_INDEX] * 10 + [5, 6, 7]]


def test_delay_layout():
    task = Delay(vocab_size=10, seq_len=20, delay=14)  # 6 data tokens, 8 of noise
    batch = task.sample(400, seed=2)
    ids = batch.input_ids
    assert (ids[:, :6] >= task.first_data_id).all() and (ids[:, 6:14] == task.noise_id).all()
    assert torch.equal(ids[:, 14:], ids[:, :6])  # token t is token t - delay
    assert batch.answer_mask[:, 14:].all() and not batch.answer_mask[:, :14].any()
    assert set(ids[:, :6].unique().tolist()) == set(range(1, 10))  # every data id is drawn
    # a hand-made row (delay 5, 3 data tokens): the answers are the data, 5 steps later
    row = torch.tensor([[7, 3, 9, 0, 0, 7, 3, 9]])
    answers = delay_answers(row, Delay(vocab_size=10, seq_len=8, delay=5))
    assert answers.tolist() == [[IGNORE_INDEX] * 5 + [7, 3, 9]]
    for bad in ([7, 3, 9, 0, 0, 7, 3, 8], [7, 3, 9, 0, 4, 7, 3, 9], [7, 0, 9, 0, 0, 7, 0, 9]):
        with pytest.raises(ValueError):
            delay_answers(torch.tensor([bad]), Delay(vocab_size=10, seq_len=8, delay=5))


def test_phonebook_layout():
    # 3 letters: 9 names, all of them used
    task = Phonebook(vocab_size=16, seq_len=60, name_len=2, number_len=2, num_entries=9)
    N, w, L = task.num_entries, task.entry_len, 60
    assert (N, w, task.num_names) == (9, 5, 9)
    batch = task.sample(500, seed=3)
    ids = batch.input_ids
    p = L - (N + 1) * w
    assert p == 10 and (ids[:, :p] == task.pad_id).all()
    entries = ids[:, p : L - w].reshape(500, N, w)
    names, numbers = entries[:, :, :2], entries[:, :, 2:4]
    assert (entries[:, :, 4] == task.sep_id).all() and (ids[:, L - w] == task.query_id).all()
    assert ((names >= 13) & (names < 16)).all() and ((numbers >= 3) & (numbers <= 12)).all()
    code = (names[:, :, 0] - 13) * 3 + (names[:, :, 1] - 13)
    assert (code.sort(dim=1).values == torch.arange(9)).all()  # 9 distinct names of 9
    hit = (names == ids[:, None, L - w + 1 : L - 2]).all(dim=2)
    assert (hit.sum(dim=1) == 1).all()
    assert torch.equal(ids[:, L - 2 :], numbers[hit])
    row = torch.tensor([[0, 13, 14, 3, 4, 1, 14, 13, 5, 6, 1, 2, 14, 13, 5, 6]])
    answers = phonebook_answers(row, Phonebook(vocab_size=16, seq_len=16, name_len=2, number_len=2))
    assert answers.tolist() == [[IGNORE_INDEX] * 14 + [5, 6]]


# --- the independent checker ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("associative-recall", dict(vocab_size=3, seq_len=4)),  # smallest allowed
        ("associative-recall", dict(vocab_size=101, seq_len=64, num_kv_pairs=5)),  # noise prefix
        ("passkey", dict(seq_len=4, key_len=1, vocab_size=13)),  # no filler at all
        ("passkey", dict(seq_len=300, key_len=8, depth=0.25)),
        ("phonebook", dict(vocab_size=14, seq_len=6, name_len=1, number_len=1)),  # one name
        ("phonebook", dict(vocab_size=64, seq_len=256)),
        ("phonebook", dict(vocab_size=20, seq_len=100, name_len=6, number_len=10, num_entries=2)),
        ("delay", dict(vocab_size=3, seq_len=2, delay=1)),  # smallest allowed
        ("delay", dict(vocab_size=16, seq_len=300, delay=299)),  # one answer, far back
    ],
)
def test_checker_accepts_generated_batches(name, kwargs):
    task = make_task(name, **kwargs)
    batch = task.sample(300, seed=7)
    assert check(batch, task) and task.check(batch)


def _context_edit(task):
    """Change what the first answer depends on, in place (see helpers.synthetic_corruptions)."""

    def edit(ids, r, t):
        if isinstance(task, AssociativeRecall):  # rebind the queried key to another value
            at = (ids[r, : task.seq_len - 2] == ids[r, -2]).nonzero()[0].item() + 1
            ids[r, at] = task.num_keys + 1 + (ids[r, at] - task.num_keys) % task.num_keys
        elif isinstance(task, Passkey):  # change the hidden key's first digit
            at = (ids[r] == task.key_id).nonzero()[0].item() + 1
            ids[r, at] = 2 + (ids[r, at] - 2 + 1) % 10
        elif isinstance(task, Delay):  # change the first data token
            ids[r, 0] = 1 + ids[r, 0] % (task.vocab_size - 1)
        else:  # change the queried entry's first digit
            w, b = task.entry_len, task.number_len
            query = ids[r, -w + 1 : -b]
            for e in range(task.seq_len - (task.num_entries + 1) * w, task.seq_len - w, w):
                if torch.equal(ids[r, e : e + task.name_len], query):
                    at = e + task.name_len
            ids[r, at] = 3 + (ids[r, at] - 3 + 1) % 10

    return edit


def test_checker_rejects_corrupted_batches(task, name):
    batch = task.sample(50, seed=8)
    assert check(batch, task)
    for what, bad in synthetic_corruptions(task, batch, _context_edit(task)):
        assert not check(bad, task), f"checker accepted a corrupted {what}"
    for other in SMALL:  # a batch of another task, or of another length, is rejected too
        if other != name:
            wrong = make_task(other, **SMALL[other]).sample(20, seed=0)
            if wrong.input_ids.max() < task.vocab_size and wrong.input_ids.shape[1] == task.seq_len:
                assert not check(wrong, task)
    short = SyntheticBatch(batch.input_ids[:, 1:], batch.labels[:, 1:], batch.answer_mask[:, 1:])
    assert not check(short, task)


# --- accuracy and the model -----------------------------------------------------------------------


def test_accuracy_one_hot_at_t_minus_1_is_perfect(task):
    batch = task.sample(200, seed=9)
    assert accuracy(one_hot_logits(batch, task.vocab_size), batch) == 1.0
    assert accuracy(one_hot_logits(batch, task.vocab_size + 5), batch) == 1.0
    assert accuracy(one_hot_logits(batch, task.vocab_size, offset=0), batch) < 0.5  # off by one


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
    mask = batch.answer_mask[:, 1:]
    manual = torch.nn.functional.cross_entropy(
        out.logits[:, :-1][mask].float(), batch.input_ids[:, 1:][mask]
    )
    assert out.loss.item() == pytest.approx(manual.item(), rel=1e-5)


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (AssociativeRecall, dict(seq_len=3), r"seq_len=3 is too short: need seq_len >= 4"),
        (
            AssociativeRecall,
            dict(seq_len=20, num_kv_pairs=10),
            r"seq_len=20 is too short: need seq_len >= 2 \* num_kv_pairs \+ 2 = 22",
        ),
        (
            AssociativeRecall,
            dict(vocab_size=20, seq_len=22),
            r"vocab_size=20 is too small for num_kv_pairs=10: need vocab_size >= .* = 21",
        ),
        (AssociativeRecall, dict(num_kv_pairs=0), r"num_kv_pairs must be a positive integer"),
        (Passkey, dict(key_len=0), r"key_len must be a positive integer; got 0"),
        (Passkey, dict(vocab_size=12), r"vocab_size=12 is too small: need vocab_size >= 13"),
        (
            Passkey,
            dict(seq_len=11, key_len=5),
            r"seq_len=11 is too short for key_len=5: need seq_len >= 2 \* key_len \+ 2 = 12",
        ),
        (Passkey, dict(depth=1.5), r"depth must be a number in \[0, 1\]; got 1.5"),
        (Passkey, dict(depth=True), r"depth must be a number"),
        (Phonebook, dict(vocab_size=13), r"vocab_size=13 is too small: need vocab_size >= 14"),
        (
            Phonebook,
            dict(seq_len=64, num_entries=10),
            r"seq_len=64 is too short: need seq_len >= .* = 77",
        ),
        (
            Phonebook,
            dict(vocab_size=15, seq_len=256, name_len=1),
            r"num_entries=41 is more than the 2 distinct names of name_len tokens",
        ),
        (Phonebook, dict(name_len=40), r"at most 2\*\*62 are supported"),
        (Phonebook, dict(number_len=0), r"number_len must be a positive integer"),
        (Delay, dict(vocab_size=2), r"vocab_size=2 is too small: need vocab_size >= 3"),
        (Delay, dict(seq_len=64, delay=64), r"need delay < seq_len <= 2 \* delay"),
        (Delay, dict(seq_len=129, delay=64), r"got seq_len=129, delay=64"),
        (Delay, dict(delay=0), r"delay must be a positive integer"),
    ],
)
def test_bad_parameters_raise_clear_errors(cls, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        cls(**kwargs)
    assert cls.__name__ in str(info.value)


def test_unknown_parameter_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"passkey: unknown parameter\(s\) \['depht'\]; valid"):
        make_task("passkey", depht=0.5)
