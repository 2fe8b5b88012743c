"""ssmkit.eval.long_context: peak memory, training-step and generation costs, crossover,
extrapolation."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from ssmkit.data import vocab_size
from ssmkit.eval.long_context import (
    cache_nbytes,
    crossover,
    generation_cost,
    length_extrapolation,
    peak_rss_mb,
    prefill_cache_nbytes,
    train_step_cost,
)
from ssmkit.models import ModelConfig, build_model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Timings of tiny models: one thread (two OpenMP threads on a busy 2-core machine run 100x
    slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rss_measurable() -> bool:
    return peak_rss_mb(lambda: None)[1] is not None


needs_rss = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not rss_measurable(),
    reason="peak RSS needs Linux procfs with a writable /proc/self/clear_refs",
)


def tiny(**kw):
    torch.manual_seed(0)
    return build_model(
        ModelConfig(**{**dict(d_model=32, n_layer=2, vocab_size=64, d_state=8), **kw})
    )


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg)


@needs_rss
def test_peak_rss_sees_an_allocation_and_resets():
    x, mb = peak_rss_mb(lambda: torch.ones(50_000_000))  # 200 MB = 190.7 MiB, kept
    assert x.shape == (50_000_000,)
    expected = 50_000_000 * 4 / 2**20
    assert abs(mb - expected) / expected < 0.10, mb
    del x
    _, big = peak_rss_mb(lambda: float(torch.ones(50_000_000).sum()))  # allocated and freed inside
    assert abs(big - expected) / expected < 0.10, big
    # the high-water mark was reset: a small op after the big ones measures small, twice
    for _ in range(2):
        total, small = peak_rss_mb(lambda: float(torch.ones(1000).sum()))
        assert total == 1000.0 and small < 8, small


@pytest.mark.parametrize("kind", ["mamba1", "mamba2", "llama"])
def test_train_and_generation_cost_are_sane(kind):
    model = tiny_llama() if kind == "llama" else tiny(mixer=kind, headdim=16, chunk_size=16)
    train = train_step_cost(model, seq_len=64, batch=2, steps=2, warmup=1)
    assert train["seq_len"] == 64 and train["batch"] == 2
    assert math.isfinite(train["tokens_per_s"]) and train["tokens_per_s"] > 0
    assert train["step_s"] > 0 and (train["peak_mb"] is None or train["peak_mb"] >= 0)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # backward ran
    gen = generation_cost(model, prompt_len=40, new_tokens=5, batch=2)
    assert gen["prompt_len"] == 40 and gen["new_tokens"] == 5 and gen["batch"] == 2
    assert gen["prefill_s"] > 0 and gen["decode_s"] > 0
    assert gen["decode_tokens_per_s"] == pytest.approx(2 * 5 / gen["decode_s"])
    assert gen["peak_mb"] is None or gen["peak_mb"] >= gen["decode_peak_mb"] >= 0
    assert model.training  # generation_cost restores the mode
    if kind == "llama":  # a DynamicCache holds exactly prompt + new tokens: 2 layers x (k, v) x 4 B
        positions = 40 + 5
        assert (
            gen["cache_mb"] * 2**20 == 2 * 2 * 2 * 4 * positions * 8 * 4
        )  # batch, heads, head_dim


def test_chunked_prefill_gives_the_same_cache():
    model = tiny()
    whole = generation_cost(model, prompt_len=50, new_tokens=2, prefill_chunk=None)
    chunked = generation_cost(model, prompt_len=50, new_tokens=2, prefill_chunk=16)
    assert whole["cache_mb"] == chunked["cache_mb"]


def test_cache_size_flat_for_ssm_and_window_linear_for_full_attention():
    mamba = tiny()
    sizes = [generation_cost(mamba, n, new_tokens=2)["cache_mb"] for n in (16, 300)]
    assert sizes[0] == sizes[1] > 0  # a fixed-size state
    attn = dict(attn_cfg=dict(num_heads=4))
    full = tiny(layout=["mamba1", "attn"], **attn)
    swa = tiny(layout=["mamba1", "swa"], attn_cfg=dict(num_heads=4, window_size=32))
    state_mb = sizes[0] / 2  # one Mamba layer of two
    kv_mb = lambda positions: 2 * 4 * 8 * positions * 4 / 2**20  # noqa: E731  k and v, heads x head_dim, fp32
    for n in (300, 1200):
        got = generation_cost(full, n, new_tokens=2)["cache_mb"] - state_mb
        # KVState grows by doubling: at least every position's keys, at most twice that
        assert kv_mb(n + 2) <= got <= 2 * kv_mb(n + 2), (n, got)
    windowed = [generation_cost(swa, n, new_tokens=2)["cache_mb"] for n in (100, 1200)]
    assert windowed[0] == windowed[1] == pytest.approx(state_mb + kv_mb(32))


def test_cache_nbytes_of_the_cache_kinds():
    from transformers import DynamicCache

    k = torch.zeros(1, 2, 5, 4)
    assert cache_nbytes([(k, k), (k, k)]) == 4 * k.numel() * 4  # legacy tuples
    cache = DynamicCache()
    cache.update(k, k, 0)
    assert cache_nbytes(cache) == 2 * k.numel() * 4
    assert cache_nbytes(tiny().allocate_cache(1)) == tiny().allocate_cache(1).nbytes()


def test_length_extrapolation(shards):
    model = tiny(vocab_size=vocab_size("byte"))
    rows = length_extrapolation(model, shards / "val", [32, 128, 100_000], max_windows=2)
    assert [r["seq_len"] for r in rows] == [32, 128, 100_000]
    for row in rows[:2]:
        assert math.isfinite(row["loss"]) and row["ppl"] == pytest.approx(math.exp(row["loss"]))
        assert row["windows"] == 2 and row["note"] == ""
        assert abs(row["loss"] - math.log(vocab_size("byte"))) < 1.0  # untrained: about uniform
    assert rows[2]["loss"] is None and rows[2]["windows"] == 0 and "shorter" in rows[2]["note"]


def test_crossover():
    lengths = [1024, 2048, 4096, 8192]
    assert crossover(lengths, [1, 2, 5, 9], [4, 3, 3, 3]) == 4096
    assert crossover(lengths, [5, 2, 5, 9], [4, 3, 3, 3]) == 4096  # a lone early win is noise
    assert crossover(lengths, [5, 5, 5, 9], [4, 3, 3, 3]) == 1024  # ahead everywhere
    assert crossover(lengths, [1, 5, 5, 2], [4, 3, 3, 3]) is None  # behind at the longest
    rows = lambda values: [None if v is None else {"tokens_per_s": v, "peak_mb": v} for v in values]  # noqa: E731
    assert crossover(lengths, rows([1, None, 5, 9]), rows([4, 3, 3, 3])) == 4096
    # memory and seconds: lower is better
    assert (
        crossover(lengths, rows([50, 50, 50, 50]), rows([20, 40, 80, 160]), key="peak_mb") == 4096
    )
    assert (
        crossover(lengths, [50, 50, 50, 50], [20, 40, 80, 160], key="x", higher_is_better=False)
        == 4096
    )
    with pytest.raises(ValueError, match="one cost per length"):
        crossover(lengths, [1, 2], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="ascending"):
        crossover([2, 1], [1, 2], [2, 1])


def test_training_steps_are_timed_in_the_trainers_allocator_setting(monkeypatch):
    """train_step_cost times its steps under the Trainer's allocator setting (freed memory reused)
    and measures the peak in one more step under the memory-measuring one; afterwards the Trainer's
    setting is back. Timing under the measuring setting taxed models by their allocations (page
    faults)."""
    from ssmkit import env

    if not env.reuse_freed_memory():
        pytest.skip("allocator settings need glibc")
    model = tiny()
    modes, forward = [], model.forward
    monkeypatch.setattr(
        model, "forward", lambda *a, **k: modes.append(env.malloc_mode()) or forward(*a, **k)
    )
    row = train_step_cost(model, seq_len=32, steps=2, warmup=1)
    assert modes == ["reuse", "reuse", "reuse", "measure"]
    assert env.malloc_mode() == "reuse"
    assert row["step_s"] > 0 and (row["peak_mb"] is None or row["peak_mb"] >= 0)


def test_prefill_cache_nbytes_is_flat_for_mamba_and_grows_for_attention():
    mamba = build_model(ModelConfig(d_model=16, n_layer=1, vocab_size=32), seed=0).eval()
    attn = build_model(
        ModelConfig(d_model=16, n_layer=1, vocab_size=32, mixer="attn", attn_cfg={"num_heads": 2}),
        seed=0,
    ).eval()
    assert prefill_cache_nbytes(mamba, 8) == prefill_cache_nbytes(mamba, 64) > 0
    # keys and values in fp32, one layer of 2 heads of 8: at least 2 * 4 * 16 bytes per token held
    assert prefill_cache_nbytes(attn, 512) >= 2 * 4 * 16 * 512 > prefill_cache_nbytes(attn, 8)
