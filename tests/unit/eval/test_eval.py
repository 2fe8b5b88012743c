"""ssmkit.eval against oracles: cross-entropy computed by hand, a model that knows each task's
answers, a constant model at the chance rate, the FLOPs closed forms, a fake clock, and a measured
allocation."""

import copy
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ssmkit
import ssmkit.eval as ev
from ssmkit.data import TokenLoader, prepare
from ssmkit.data.synthetic import (
    IGNORE_INDEX,
    MQAR,
    AssociativeRecall,
    Delay,
    InductionHeads,
    ModularArithmetic,
    Parity,
    Passkey,
    Phonebook,
    SelectiveCopying,
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
from ssmkit.eval import measure
from ssmkit.train import TrainConfig, Trainer

SEQ, BATCH = 32, 4


@pytest.fixture(scope="module")
def val_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "val"
    prepare("stdlib-docs", "byte", out, split="validation", max_tokens=8_000, progress=False)
    return out


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ssmkit.build_model(
        ssmkit.ModelConfig.preset("tiny", vocab_size=257, d_model=32, n_layer=2)
    ).eval()


def hand_loss(model, batches) -> float:
    """Mean over batches of -log softmax(logits)[target], by log_softmax and gather (not
    cross_entropy)."""
    per_batch = []
    with torch.no_grad():
        for x, y in batches:
            logp = torch.log_softmax(model(x).logits.double(), dim=-1)
            per_batch.append(-logp.gather(-1, y[..., None]).mean().item())
    return sum(per_batch) / len(per_batch)


def first_batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


# --- loss and perplexity --------------------------------------------------------------------------


def test_perplexity_is_exp_of_the_mean_cross_entropy(model, val_dir):
    loader = TokenLoader(val_dir, SEQ, BATCH)
    expected = hand_loss(model, first_batches(TokenLoader(val_dir, SEQ, BATCH), 3))
    result = ev.perplexity(model, loader, 3)
    assert result["batches"] == 3
    assert result["loss"] == pytest.approx(expected, rel=1e-6)
    assert result["ppl"] == pytest.approx(math.exp(expected), rel=1e-6)
    x, y = first_batches(TokenLoader(val_dir, SEQ, BATCH), 1)[0]
    with torch.no_grad():
        assert ev.lm_loss(model, x, y).item() == pytest.approx(hand_loss(model, [(x, y)]), rel=1e-6)
    # equal batch sizes: the mean of batch means is the mean over every position
    xs, ys = zip(*first_batches(TokenLoader(val_dir, SEQ, BATCH), 3))
    assert result["loss"] == pytest.approx(
        hand_loss(model, [(torch.cat(xs), torch.cat(ys))]), rel=1e-6
    )


def test_perplexity_reads_the_same_windows_and_leaves_loader_and_model_as_they_were(model, val_dir):
    loader = TokenLoader(val_dir, SEQ, BATCH)
    first = ev.perplexity(model, loader, 2)
    first_batches(loader, 3)  # the loader moves on (e.g. a training loader)
    model.train()
    try:
        again = ev.perplexity(model, loader, 2)
        assert model.training  # its mode is given back
    finally:
        model.eval()
    assert again == first
    assert (loader.epoch, loader.step) == (0, 3)
    assert ev.perplexity(model, loader)["batches"] == loader.batches_per_epoch  # None: one epoch
    assert ev.perplexity(model, loader, 10_000)["batches"] == loader.batches_per_epoch


def test_every_world_size_scores_the_same_windows(model, val_dir):
    """Two ranks, each scoring batches // 2 of its own windows and averaged by ``reduce``, score
    what one rank scores alone."""
    one = ev.perplexity(model, TokenLoader(val_dir, SEQ, BATCH), 4)
    rank1 = ev.perplexity(model, TokenLoader(val_dir, SEQ, BATCH, rank=1, world_size=2), 4)
    other = torch.tensor(rank1["loss"])
    rank0 = ev.perplexity(
        model,
        TokenLoader(val_dir, SEQ, BATCH, rank=0, world_size=2),
        4,
        reduce=lambda mean: (mean + other) / 2,
    )
    assert rank0["batches"] == rank1["batches"] == 2
    assert rank0["loss"] == pytest.approx(one["loss"], rel=1e-5)


def test_perplexity_of_any_iterable_reads_only_the_batches_asked_for(model, val_dir):
    pairs = first_batches(TokenLoader(val_dir, SEQ, BATCH), 3)
    pulled = []

    def stream():
        for pair in pairs:
            pulled.append(1)
            yield pair

    assert ev.perplexity(model, stream(), 2)["loss"] == pytest.approx(
        hand_loss(model, pairs[:2]), rel=1e-6
    )
    assert len(pulled) == 2
    assert ev.perplexity(model, pairs)["batches"] == 3
    with pytest.raises(ValueError, match="no batches"):
        ev.perplexity(model, [])


def test_a_diverged_loss_has_a_finite_perplexity():
    class Confident(nn.Module):  # all its mass on token 0, every target is 1
        def forward(self, ids):
            logits = torch.full((*ids.shape, 4), -1e4)
            logits[..., 0] = 1e4
            return logits

    x, y = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long)
    result = ev.perplexity(Confident(), [(x, y)])
    assert result["loss"] == pytest.approx(2e4) and result["ppl"] == math.exp(50.0)


def test_the_trainer_evaluates_with_ssmkit_eval(tmp_path, val_dir):
    cfg = TrainConfig(
        model="tiny",
        model_overrides={"d_model": 32, "n_layer": 2},
        data=str(val_dir),
        val_data=str(val_dir),
        seq_len=SEQ,
        micro_batch=BATCH,
        batch_tokens=SEQ * BATCH,
        max_steps=1,
        eval_batches=3,
        progress=False,
        out_dir=str(tmp_path / "run"),
    )
    trainer = Trainer(config=cfg)
    record = trainer.evaluate()
    expected = hand_loss(trainer.model.eval(), first_batches(TokenLoader(val_dir, SEQ, BATCH), 3))
    assert record["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert record["val_ppl"] == pytest.approx(math.exp(expected), rel=1e-6)


# --- synthetic tasks ------------------------------------------------------------------------------

ANSWERS = {
    SelectiveCopying: selective_copying_answers,
    InductionHeads: induction_heads_answers,
    MQAR: mqar_answers,
    AssociativeRecall: associative_recall_answers,
    Passkey: passkey_answers,
    Phonebook: phonebook_answers,
    Delay: delay_answers,
    Parity: parity_answers,
    ModularArithmetic: modular_arithmetic_answers,
}
TASKS = [
    SelectiveCopying(vocab_size=16, seq_len=64, n_tokens=8),
    InductionHeads(vocab_size=16, seq_len=64),
    MQAR(vocab_size=64, seq_len=64, num_kv_pairs=8),
    AssociativeRecall(vocab_size=33, seq_len=32),
    Passkey(seq_len=64, key_len=4),
    Phonebook(vocab_size=32, seq_len=64),
    Delay(vocab_size=16, seq_len=64, delay=48),
    Parity(seq_len=20, min_bits=3),
    ModularArithmetic(seq_len=20, min_len=1, brackets=True),
]


class Solver(nn.Module):
    """Knows the task: at t - 1 all its weight is on the answer the task's checker derives for t."""

    def __init__(self, task, vocab: int):
        super().__init__()
        self.task, self.vocab = task, vocab
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, ids):
        answers = ANSWERS[type(self.task)](ids, self.task)
        logits = torch.zeros(*ids.shape, self.vocab)
        rows, cols = (answers != IGNORE_INDEX).nonzero(as_tuple=True)
        logits[rows, cols - 1, answers[rows, cols]] = 1.0
        return SimpleNamespace(logits=logits)  # an output object, as ssmkit's LMOutput


class Constant(nn.Module):
    """Always says ``token``."""

    def __init__(self, token: int, vocab: int):
        super().__init__()
        self.token, self.vocab = token, vocab

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, self.vocab)
        logits[..., self.token] = 1.0
        return logits  # a plain tensor


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_a_model_that_knows_the_answers_scores_one(task):
    solver = Solver(task, task.vocab_size + 3)  # a padded vocabulary is fine
    assert ev.task_accuracy(solver, task, n=50, seed=1, batch_size=7) == 1.0


@pytest.mark.parametrize("task", TASKS[:2], ids=lambda t: t.name)
def test_a_constant_model_scores_the_chance_rate(task):
    token, n, seed = task.first_data_id + 3, 3000, 2
    batch = task.sample(n, seed)
    expected = (batch.input_ids[batch.answer_mask] == token).double().mean().item()  # exact oracle
    got = ev.task_accuracy(Constant(token, task.vocab_size), task, n=n, seed=seed, batch_size=512)
    assert got == pytest.approx(expected, abs=1e-12)
    chance = 1 / (task.vocab_size - task.first_data_id)  # answers are uniform over the data ids
    assert got == pytest.approx(chance, abs=0.015)


def test_chunks_are_weighted_by_their_answers_and_a_name_is_a_default_task():
    task = TASKS[1]
    batch = task.sample(10, seed=3)

    class EvenRows(Solver):  # right on rows 0, 2, 4, ... of each chunk only
        def forward(self, ids):
            logits = super().forward(ids).logits
            logits[1::2] = 0.0  # argmax 0: the trigger, never an answer
            return logits

    # chunks of 3, 3, 3, 1 rows: 2 + 2 + 2 + 1 right of 10 (the mean of the chunks' accuracies would
    # be 0.75)
    assert ev.answer_accuracy(EvenRows(task, 16), batch, batch_size=3) == pytest.approx(7 / 10)
    default = InductionHeads()
    assert ev.task_accuracy(Solver(default, 16), "induction-heads", n=20) == 1.0
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        ev.answer_accuracy(EvenRows(task, 16), batch, batch_size=0)


# --- FLOPs, peak, MFU -----------------------------------------------------------------------------


def test_flops_per_token_closed_forms():
    cfg = ssmkit.ModelConfig.preset("tiny", vocab_size=257)
    model = ssmkit.build_model(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d)))
    m = cfg.mamba1
    scan = cfg.n_layer * 3 * 9 * m.d_inner(cfg.d_model) * m.d_state
    assert ev.flops_per_token(model, 128) == 6 * linear + scan
    cfg2 = ssmkit.ModelConfig(
        d_model=64, n_layer=2, vocab_size=257, mixer="mamba2", headdim=16, d_state=16, chunk_size=32
    )
    model2 = ssmkit.build_model(cfg2)
    linear2 = sum(
        m.weight.numel() for m in model2.modules() if isinstance(m, (nn.Linear, nn.Conv1d))
    )
    g2 = cfg2.mamba2
    for seq_len, q in ((128, 32), (8, 8)):  # the chunk is min(chunk_size, seq_len)
        ssd = (
            2 * q * g2.d_state * g2.ngroups  # C·Bᵀ per group
            + g2.nheads(64) * (2 * q * g2.headdim + 4 * g2.d_state * g2.headdim)
        )  # mask·X, h
        assert ev.flops_per_token(model2, seq_len) == 6 * linear2 + cfg2.n_layer * 3 * ssd
    # a hybrid: attention layers cost 12 · H·d · keys (a sliding window caps the keys), Mamba layers
    # as above
    cfg3 = ssmkit.ModelConfig(
        d_model=64,
        n_layer=4,
        vocab_size=257,
        layout=["mamba1", "attn", "mamba1", "swa"],
        attn_cfg=dict(num_heads=2, head_dim=16, window_size=32),
    )
    model3 = ssmkit.build_model(cfg3)
    linear3 = sum(
        m.weight.numel() for m in model3.modules() if isinstance(m, (nn.Linear, nn.Conv1d))
    )
    s6 = 3 * 9 * cfg3.mamba1.d_inner(64) * cfg3.mamba1.d_state
    assert ev.flops_per_token(model3, 128) == 6 * linear3 + 2 * s6 + 12 * 32 * 128 + 12 * 32 * 32


def test_peak_flops_and_mfu(monkeypatch):
    assert ev.peak_flops(torch.device("cpu"), "bf16") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert ev.peak_flops(cuda, "bf16") == 989e12 and ev.peak_flops(cuda, "fp32") == 989e12 / 2
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert ev.peak_flops(cuda, "bf16") is None
    assert ev.mfu(1e9, 1e3, 1e13) == pytest.approx(0.1)  # 1e12 FLOP/s used of 1e13
    assert ev.mfu(1e9, 8e3, 1e13, world_size=8) == pytest.approx(0.1)  # the rate is all ranks'
    assert ev.mfu(1e9, 1e3, None) is None


# --- timing and memory ----------------------------------------------------------------------------


def test_time_round_robin_and_throughput_on_a_fake_clock(monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    calls, rounds = [], []

    def call(name, seconds):
        def run():
            calls.append(name)
            clock.now += seconds

        return run

    seconds = ev.time_round_robin(
        {"a": call("a", 1.0), "b": call("b", 3.0), "slow": call("slow", 100.0)},
        steps=3,
        warmup=2,
        skip=lambda name, r: name == "slow" and r not in (0, 2),
        on_round=rounds.append,
    )
    assert calls == [
        "a",
        "b",
        "slow",
        "a",
        "b",
        "a",
        "b",
        "slow",
        "a",
        "b",
        "a",
        "b",
    ]  # slow: rounds 0, 2
    assert seconds == {"a": [1.0] * 3, "b": [3.0] * 3, "slow": [100.0]}  # warm-up: not timed
    assert rounds == [0, 1, 2, 3, 4]
    durations = iter([50.0, 2.0, 4.0, 1.0])  # warm-up, then a median of 2 s
    assert (
        ev.throughput(lambda: setattr(clock, "now", clock.now + next(durations)), 1000, steps=3)
        == 500.0
    )
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        ev.time_round_robin({"a": call("a", 1.0)}, steps=0)


def test_peak_memory_grows_with_an_allocation():
    code = (
        "import torch; from ssmkit.eval import peak_memory_mb as p; before = p(); "
        "x = torch.ones(256 * 2**20 // 4); print(before, p())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(float, out.stdout.split())
    assert before > 0 and after - before >= 200  # 256 MiB touched: the peak RSS grows by it
    assert ev.peak_memory_mb() >= 0 and ev.peak_memory_mb("cpu") >= 0


def test_peak_memory_on_cuda_is_the_allocator_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**20)
    assert ev.peak_memory_mb(torch.device("cuda", 0)) == 3.0


def test_eval_imports_no_layer_above_it():
    code = (
        "import sys, ssmkit.eval; print(sorted(m for m in sys.modules if m.split('.')[:2] in "
        "(['ssmkit', 'train'], ['ssmkit', 'workbook'], ['ssmkit', 'cli'])))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_perplexity_autocast_allocator_peak_and_synchronized_timing(model, val_dir):
    cuda = torch.device("cuda")
    gpu_model = copy.deepcopy(model).to(cuda)
    pairs = first_batches(TokenLoader(val_dir, SEQ, BATCH), 2)  # CPU batches: moved by perplexity
    fp32 = ev.perplexity(gpu_model, pairs)
    assert fp32["loss"] == pytest.approx(hand_loss(model, pairs), rel=1e-3)
    bf16 = ev.perplexity(gpu_model, pairs, dtype=torch.bfloat16)
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=3e-2)
    torch.cuda.reset_peak_memory_stats(cuda)
    before = ev.peak_memory_mb(cuda)
    block = torch.ones(64 * 2**20, device=cuda)  # 256 MiB
    assert ev.peak_memory_mb(cuda) - before >= 255
    del block
    x = pairs[0][0].to(cuda)
    assert ev.throughput(lambda: gpu_model(x), SEQ * BATCH, steps=3, device=cuda) > 0


def test_summarize_run_is_the_one_summary_of_a_history():
    """Worked by hand: the median of an even count is the higher middle one; per-rank and fp16
    numbers come from the last training record; nothing is rounded."""
    records = [
        {"kind": "eval", "step": 0, "tokens": 0, "val_loss": 10.0, "val_ppl": 22026.47},
        {
            "kind": "train",
            "step": 1,
            "tokens": 8,
            "loss": 9.0,
            "tokens_per_s": 300.0,
            "peak_mem_mb": 5.0,
        },
        {
            "kind": "train",
            "step": 2,
            "tokens": 16,
            "loss": 8.0,
            "tokens_per_s": 100.0,
            "peak_mem_mb": 7.0,
        },
        {"kind": "train", "step": 3, "tokens": 24, "loss": 7.0, "tokens_per_s": 200.0},
        {
            "kind": "train",
            "step": 4,
            "tokens": 32,
            "loss": 6.5,
            "tokens_per_s": 150.0,
            "grad_scale": 1024.0,
            "scaler_skipped": 1,
            "rank_peak_mem_mb": [7.0, 6.0],
        },
        {"kind": "eval", "step": 4, "tokens": 32, "val_loss": 7.123456, "val_ppl": 1239.4567},
    ]
    assert ev.summarize_run(records) == {
        "steps": 4,
        "tokens": 32,
        "final_loss": 6.5,
        "first_val_loss": 10.0,
        "val_loss": 7.123456,
        "val_ppl": 1239.4567,
        "train_tok_s": 200,
        "peak_mem_mb": 7.0,
        "grad_scale": 1024.0,
        "scaler_skipped": 1,
        "rank_peak_mem_mb": [7.0, 6.0],
    }
    empty = ev.summarize_run([])
    assert empty["val_loss"] is None and empty["train_tok_s"] is None and empty["steps"] == 0
