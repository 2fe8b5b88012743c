"""ssmkit.workbook.chapters.ch01_prototype: notebook 01's mixer comparison (section 1.6): the same
model with each mixer (ModelConfig.with_mixer), trained on the same tokens in the same order."""

from __future__ import annotations

import math

from helpers import small

from ssmkit.workbook.chapters import ch01_prototype


def test_notebook_comparison_trains_each_mixer_on_the_same_tokens(tmp_path, shards):
    cfg = small(tmp_path, shards, max_steps=8)
    assert ch01_prototype.comparison_tokens(cfg) == 2 * 256  # a quarter of 8 steps of 256 tokens
    swapped = cfg.model_config(vocab_size=257).with_mixer("mamba3").mamba3  # d_inner 64
    assert (swapped.d_state, swapped.headdim, swapped.chunk_size) == (64, 32, 64)
    rows, runs = ch01_prototype.compare_mixers(
        cfg, shards / "train", shards / "val", tmp_path / "m", tokens=256
    )
    assert [r["mixer"] for r in rows] == ["mamba1", "mamba2", "mamba3"]
    assert list(runs) == ["Mamba-1", "Mamba-2", "Mamba-3"]
    assert all(math.isfinite(r["val_loss"]) for r in rows)
    sizes = [r["non_embedding"] for r in rows]
    assert max(sizes) < 1.2 * min(sizes), sizes  # comparable blocks at equal width
    assert len({tuple(x["tokens"] for x in h if x["kind"] == "train") for h in runs.values()}) == 1
