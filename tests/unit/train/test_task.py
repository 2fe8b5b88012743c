"""ssmkit.train.task: a short training on a synthetic task, with the Trainer's optimizer and
schedule.

Oracles: chance (an untrained model) against a trained one on associative recall, and the recipe's
learning rates against the schedule's closed form (warmup, then a cosine to lr / 10)."""

from __future__ import annotations

import math

import pytest

from ssmkit.data import make_task
from ssmkit.models import ModelConfig, build_model
from ssmkit.train import lr_at, train_on_task
from ssmkit.train.task import task_recipe


def test_train_on_task_learns_recall_above_chance():
    task = make_task(
        "mqar", vocab_size=17, seq_len=16, num_kv_pairs=2
    )  # 8 values, 2 pairs a sequence
    hybrid = ModelConfig.preset(
        "tiny", d_model=32, n_layer=2, vocab_size=17, attn_every=2, attn_offset=1
    )
    untrained = train_on_task(build_model(hybrid, seed=0), task, steps=1, batch=1, lr=1e-9)
    result = train_on_task(build_model(hybrid, seed=0), task, steps=150, batch=32, lr=3e-3, seed=0)
    assert set(result) == {"loss", "accuracy", "seconds", "steps"} and result["steps"] == 150
    # chance is 1/8; naming one of the sequence's 2 values at random 1/2; untrained ~chance
    assert untrained["accuracy"] < 0.3 and result["accuracy"] > 0.5, (untrained, result)
    assert result["loss"] < untrained["loss"]


def test_train_on_task_solves_single_query_associative_recall():
    task = make_task("associative-recall", vocab_size=9, seq_len=6)  # 2 pairs: 4 keys, 4 values
    hybrid = ModelConfig.preset(
        "tiny", d_model=32, n_layer=2, vocab_size=9, attn_every=2, attn_offset=1
    )
    untrained = train_on_task(build_model(hybrid, seed=0), task, steps=1, batch=1, lr=1e-9)
    result = train_on_task(build_model(hybrid, seed=0), task, steps=100, batch=32, seed=0)
    # a uniform guess over the 4 values scores 1/4 (loss ln 4); naming one of the row's 2 values
    # 1/2 (ln 2): above that the model reads the query
    assert untrained["accuracy"] < 0.3 and untrained["loss"] > math.log(4), untrained
    assert result["accuracy"] > 0.9 and result["loss"] < math.log(2), result


def test_the_recipe_is_warmup_then_a_cosine_to_a_tenth():
    recipe = task_recipe(steps=50, lr=2e-3, warmup=0.1)
    assert recipe.warmup_steps == 5 and recipe.min_lr == pytest.approx(2e-4)
    for step in range(50):
        ramp = 2e-3 * (step + 1) / 5
        cos = 0.5 * (1 + math.cos(math.pi * (step - 5) / 45))
        assert lr_at(step, recipe) == pytest.approx(
            ramp if step < 5 else 2e-4 + 1.8e-3 * cos, rel=1e-12
        )
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        task_recipe(steps=0)


def test_train_each_is_train_on_task_per_model_and_seed_on_one_thread(monkeypatch):
    import torch

    from ssmkit.train import train_each

    task = make_task("mqar", vocab_size=17, seq_len=16, num_kv_pairs=2)
    small = ModelConfig(d_model=16, n_layer=1, vocab_size=17)
    models = {"a": small, "b": small.with_mixer("mamba2")}
    seen = []
    monkeypatch.setattr(
        torch, "set_num_threads", lambda n, real=torch.set_num_threads: seen.append(n) or real(n)
    )
    rows = train_each(models, task, seeds=[0, 1], steps=2, batch=4, n_test=8)
    assert [(r["model"], r["seed"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert set(rows[0]) == {"model", "seed", "accuracy", "loss", "seconds", "params"}
    assert seen[::2] == [1] * 4  # each training on one thread, the count restored after it
    alone = train_on_task(
        build_model(models["b"], seed=1), task, steps=2, batch=4, n_test=8, seed=1
    )
    assert (rows[3]["loss"], rows[3]["accuracy"]) == (alone["loss"], alone["accuracy"])
    assert rows[3]["params"] == build_model(models["b"]).num_parameters()
