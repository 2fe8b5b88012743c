"""k tokens in one cached call: ``model(tokens (batch, k), cache=cache)`` after a prefill.

The oracle is k one-token calls on a copy of the same cache: the same logits (fp32, max |difference|
<= TOL = 1e-5) and the same cache afterwards (every tensor of every layer: conv and SSM states,
Mamba-3's angle / previous key / previous input, attention's keys, values and positions), for
Mamba-1, Mamba-2 (with and without dt_limit), Mamba-3 (SISO and MIMO) and a hybrid of all three with
full and sliding-window attention; the whole sequence run without a cache is a second oracle. A call
of up to ``STEP_TOKENS`` tokens runs as recurrent steps (no scan: checked by spying on the scans),
a longer one as the scan from the cached states (the threshold lowered to reach it cheaply); both
are held to the same oracle. Last, greedy speculative decoding (a draft proposes k tokens, the
target verifies them in one call, a rejected tail is undone from a saved cache) gives exactly the
target's own greedy tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import perturb_

import ssmkit
from ssmkit import ops
from ssmkit.models import ModelConfig, mixer_parts

TOL = 1e-5
VOCAB = 50

CASES = {
    "mamba1": dict(mixer="mamba1", d_state=8),
    "mamba2": dict(mixer="mamba2", d_state=8, headdim=16, ngroups=2, chunk_size=4),
    "mamba2-dt-limit": dict(mixer="mamba2", d_state=8, headdim=16, dt_limit=(0.01, 0.3)),
    "mamba3": dict(mixer="mamba3", d_state=8, headdim=16),
    "mamba3-mimo": dict(mixer="mamba3", d_state=8, headdim=16, is_mimo=True, mimo_rank=2),
    "hybrid": dict(
        layout=["mamba1", "attn", "mamba2", "swa", "mamba3"],
        d_state=8,
        headdim=16,
        attn_cfg=dict(window_size=3, rotary_emb_dim=4, d_conv=4),
    ),
}


def build(case: str, seed: int = 0):
    torch.manual_seed(seed)
    kw = CASES[case]
    n_layer = len(kw["layout"]) if "layout" in kw else 2
    cfg = ModelConfig(d_model=32, n_layer=n_layer, vocab_size=VOCAB, **kw)
    return perturb_(ssmkit.build_model(cfg), seed + 1).eval()  # off the init: nothing can hide


def tokens(batch, length, seed=3):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def cache_diff(a, b) -> float:
    """The largest difference between two caches over every tensor of every layer; their other
    fields (lengths, counters) must be equal."""
    assert a.seqlen_offset == b.seqlen_offset
    worst = 0.0
    for la, lb in zip(a.layers, b.layers, strict=True):
        for name, va in vars(la).items():
            vb = getattr(lb, name)
            if isinstance(va, torch.Tensor):
                assert va.shape == vb.shape, name
                worst = max(worst, (va.float() - vb.float()).abs().max().item())
            else:
                assert va == vb, name
    return worst


def one_call_and_steps(model, ids, prefill):
    """After the same prefill of ``prefill`` tokens: the logits of the rest of ids in one cached
    call and that cache, and the logits of one-token calls on a copy and that cache."""
    cache = model.allocate_cache(ids.shape[0])
    model(ids[:, :prefill], cache=cache)
    other = copy.deepcopy(cache)
    one = model(ids[:, prefill:], cache=cache).logits
    steps = torch.cat(
        [model(ids[:, t : t + 1], cache=other).logits for t in range(prefill, ids.shape[1])], dim=1
    )
    return one, cache, steps, other


@pytest.mark.parametrize("path", ["steps", "scan"])
@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_k_tokens_in_one_call_equal_k_single_token_calls(case, path, monkeypatch):
    if path == "scan":  # a call longer than STEP_TOKENS: the scan from the cached states
        monkeypatch.setattr(mixer_parts, "STEP_TOKENS", 2)
    model, prefill, k = build(case), 5, 4
    ids = tokens(2, prefill + k)
    one, cache, steps, other = one_call_and_steps(model, ids, prefill)
    assert (one - steps).abs().max() <= TOL
    assert cache_diff(cache, other) <= TOL
    full = model(ids).logits[:, prefill:]  # no cache at all
    assert (one - full).abs().max() <= TOL


@torch.no_grad()
def test_short_calls_run_as_steps_and_long_ones_as_the_scan(monkeypatch):
    model = build("hybrid")
    scans = []
    for name in ("selective_scan", "ssd_scan", "mamba3_scan"):
        real = getattr(ops, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            scans.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    cache = model.allocate_cache(1)
    model(tokens(1, mixer_parts.STEP_TOKENS + 1), cache=cache)  # a prefill: the scans
    assert sorted(scans) == ["mamba3_scan", "selective_scan", "ssd_scan"]
    scans.clear()
    model(
        tokens(1, mixer_parts.STEP_TOKENS, seed=4), cache=cache
    )  # a draft of STEP_TOKENS: steps only
    assert scans == []
    model(tokens(1, mixer_parts.STEP_TOKENS + 1, seed=5), cache=cache)
    assert len(scans) == 3


@pytest.mark.parametrize("case", ["mamba2", "hybrid"])
@torch.no_grad()
def test_k_tokens_after_a_left_padded_prefill(case):
    """Row 1's prompt is 4 tokens behind 4 pads: after the masked prefill, one call of 4 tokens
    gives each row what it gives alone, one token at a time."""
    model = build(case)
    ids = tokens(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    cache = model.allocate_cache(2)
    model(ids[:, :8], cache=cache, attention_mask=mask[:, :8])
    one = model(ids[:, 8:], cache=cache).logits
    for row, start in ((0, 0), (1, 4)):
        alone = model.allocate_cache(1)
        model(ids[row : row + 1, start:8], cache=alone)
        steps = [model(ids[row : row + 1, t : t + 1], cache=alone).logits for t in range(8, 12)]
        assert (one[row] - torch.cat(steps, dim=1)[0]).abs().max() <= TOL


def speculative_greedy(target, draft, prompt, new_tokens, k, check_steps=True):
    """Greedy speculative decoding (Leviathan et al. 2023 at temperature 0) for one sequence.

    Each round the draft proposes k tokens, one cached step each; the target scores all k in ONE
    cached call (the verification step) and keeps the longest prefix it agrees with, plus its own
    token after it. A rejected tail is undone by restoring the caches saved before the round and
    running the kept tokens again (in one call too). Returns (tokens, rounds, rounds fully
    accepted); with ``check_steps`` every verification is also compared with k one-token calls."""
    t_cache, d_cache = target.allocate_cache(1), draft.allocate_cache(1)
    vocab = target.config.vocab_size  # greedy over the real vocabulary, as generate()
    t_next = target(prompt, cache=t_cache).logits[:, -1, :vocab]  # the target's next-token logits
    draft(prompt[:, :-1], cache=d_cache)  # the draft's cache lags by the last token
    out, last, rounds, full = prompt, prompt[:, -1:], 0, 0
    while out.shape[1] < prompt.shape[1] + new_tokens:
        saved_t, saved_d = copy.deepcopy(t_cache), copy.deepcopy(d_cache)
        drafted, x = [], last
        for _ in range(k):
            x = draft(x, cache=d_cache).logits[:, -1, :vocab].argmax(-1, keepdim=True)
            drafted.append(x)
        drafted = torch.cat(drafted, dim=1)  # (1, k)
        verified = target(drafted, cache=t_cache).logits  # (1, k, V): one call
        if check_steps:
            again = copy.deepcopy(saved_t)
            steps = torch.cat(
                [target(drafted[:, i : i + 1], cache=again).logits for i in range(k)], 1
            )
            assert (verified - steps).abs().max() <= TOL and cache_diff(again, t_cache) <= TOL
        # the target's greedy choice at each drafted position
        choices = torch.cat(
            [t_next.argmax(-1, keepdim=True), verified[:, :-1, :vocab].argmax(-1)], dim=1
        )
        agreed = int((choices == drafted)[0].long().cumprod(0).sum())
        rounds += 1
        if agreed == k:
            full += 1
            kept, t_next = drafted, verified[:, -1, :vocab]
        else:  # keep the agreed prefix and the target's own token; undo the rest
            kept = torch.cat([drafted[:, :agreed], choices[:, agreed : agreed + 1]], dim=1)
            t_cache, d_cache = saved_t, saved_d
            t_next = target(kept, cache=t_cache).logits[:, -1, :vocab]
            draft(torch.cat([last, kept[:, :-1]], dim=1), cache=d_cache)
        out, last = torch.cat([out, kept], dim=1), kept[:, -1:]
    return out[:, : prompt.shape[1] + new_tokens], rounds, full


@torch.no_grad()
def test_speculative_decoding_gives_the_targets_greedy_tokens():
    target, prompt, n = build("hybrid"), tokens(1, 6, seed=7), 10  # Mamba-1, -2, -3, attention
    want = ssmkit.generate(target, prompt, max_new_tokens=n, temperature=0)
    # the target as its own draft: every draft is accepted
    same, rounds, full = speculative_greedy(target, target, prompt, n, k=4)
    assert torch.equal(same, want) and full == rounds
    # a draft that disagrees now and then: rejected tails are undone
    draft = perturb_(copy.deepcopy(target), 11)
    got, rounds, full = speculative_greedy(target, draft, prompt, n, k=4)
    assert torch.equal(got, want) and full < rounds
