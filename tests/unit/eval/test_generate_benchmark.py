"""benchmarks/generate.py --mixed (packed prompts vs left padding vs the matched Llama), in process
on tiny models: its length mix, the three runners and their checks, the targets' arithmetic. The
full run prints the ratios; this keeps the code it runs correct (the import of transformers for the
Llama dominates the time)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from helpers import ROOT

import ssmkit
from ssmkit.models import ModelConfig


def test_the_mixed_length_benchmark_measures_what_it_says():
    """Its length mix (seeded, the range's ends in it; the even control of the same total), the
    three runners on one cell (packed and padded tokens checked equal), the left-padded Llama
    loop against each prompt alone (chunked prefill included), and the targets' arithmetic."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        bench = importlib.import_module("generate")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    lengths = bench.mixed_lengths(6, 4, 40)
    assert lengths == bench.mixed_lengths(6, 4, 40) and lengths[:2] == [40, 4]
    assert all(4 <= n <= 40 for n in lengths)
    even = bench.even_lengths(lengths)
    assert len(even) == 6 and sum(even) == sum(lengths) and max(even) - min(even) <= 1
    torch.manual_seed(0)
    ssm = ssmkit.build_model(
        ModelConfig(
            d_model=32, n_layer=2, vocab_size=bench.VOCAB, mixer="mamba2", d_state=8, headdim=16
        )
    ).eval()
    llama = ssmkit.models.matched_transformer(ssm, max_len=64).eval()
    models = {bench.MIXED_SSM: ssm, "llama": llama}
    cells = {
        mix: bench.mixed_cell(models, ls, 3, 16, 1, bench.RUNNERS, lambda _: None, mix)
        for mix, ls in (("mixed", lengths), ("even", even))
    }
    for c in cells.values():
        assert c["packed_equals_padded"] and c["prompt_tokens"] == sum(lengths)
        assert all(c[n]["tokens_per_s"] > 0 for n in bench.RUNNERS)
    assert cells["mixed"]["padded_tokens"] == 6 * 40
    goals = bench.mixed_targets({6: cells}, [6])["packed_vs_padded"]
    mixed = cells["mixed"]
    assert goals["batch"] == 6 and goals["ratio"] == pytest.approx(
        mixed["packed"]["tokens_per_s"] / mixed["padded"]["tokens_per_s"]
    )
    prompts = [torch.randint(0, bench.VOCAB, (n,)) for n in (21, 5, 12)]
    with torch.no_grad():
        batched = bench.llama_generate(llama, prompts, 4, chunk=8)
        for i, p in enumerate(prompts):
            assert torch.equal(batched[i], bench.llama_generate(llama, [p], 4, chunk=None)[0]), i
