"""Generation from packed prompts, ignored positions (seq_idx -1) and attention masks with holes.

The oracle throughout: each prompt (or each row's real tokens) run alone, batch 1, unpadded. A
packed prefill must leave in cache row i the states of prompt i alone, give its last logits and
every later step's logits (fp32, 1e-5), and greedy generation must give its tokens, eos included,
for Mamba-1, Mamba-2, Mamba-3 (SISO and MIMO) and hybrids with full and with sliding-window
attention. Controls show each comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from helpers import perturb_

import ssmkit
from ssmkit.models import ModelConfig, attention
from ssmkit.models.generate import _packed

VOCAB = 60
TOL = 1e-5  # fp32
ATTN = dict(num_heads=4, num_heads_kv=2, head_dim=8, rotary_emb_dim=4, d_conv=3)
CASES = {
    "mamba1": dict(mixer="mamba1", d_state=8),
    # chunk_size 4: samples that start and end inside a chunk, and chunks of several samples
    "mamba2": dict(mixer="mamba2", d_state=8, headdim=16, chunk_size=4),
    "mamba3": dict(mixer="mamba3", d_state=8, headdim=16, chunk_size=4),
    "mamba3-mimo": dict(mixer="mamba3", d_state=8, headdim=16, chunk_size=4, is_mimo=True,
                        mimo_rank=2),
    # GQA, partial rotary and attention's own short conv, between two kinds of SSM layer
    "hybrid-attn": dict(layout=["mamba2", "attn", "mamba1"], d_state=8, headdim=16, chunk_size=4,
                        attn_cfg=ATTN),
    # a window shorter than most prompts: the ring buffer wraps during the prefill
    "hybrid-swa": dict(layout=["mamba3", "swa"], d_state=8, headdim=16, chunk_size=4,
                       attn_cfg={**ATTN, "window_size": 3}),
}  # fmt: skip
PROMPTS = [
    torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
    for n in (9, 3, 14, 1, 6)
]


def model_for(case: str, **extra):
    torch.manual_seed(0)
    kw = {**CASES[case], **extra}
    cfg = ModelConfig(d_model=32, n_layer=len(kw.get("layout", [0, 0])), vocab_size=VOCAB, **kw)
    return perturb_(ssmkit.build_model(cfg), seed=1).eval()


def close(a, b, what, tol=TOL):
    diff = (a.float() - b.float()).abs().max().item()
    assert diff <= tol, f"{what}: max |diff| {diff:.2e} > {tol:.0e}"
    return diff


def state_tensors(state):
    """The tensors of one layer's cache entry that the next steps read: a conv state's last d_conv
    - 1 inputs (its first slot is dropped by the next step unread), SSM states; a KV cache by its
    logits (compared by the tests' steps)."""
    if hasattr(state, "tensors"):
        return list(state.tensors())
    if hasattr(state, "ssm"):
        return [state.conv[..., 1:], state.ssm]
    return [] if state.conv is None else [state.conv[..., 1:]]


@pytest.mark.parametrize("case", list(CASES))
def test_packed_prefill_and_steps_are_each_prompt_alone(case):
    """One packed prefill into allocate_cache(5), then 3 batched steps: the logits of every row are
    those of its prompt alone, and its cache row holds that prompt's states."""
    model = model_for(case)
    ids, seq_idx, last = _packed(PROMPTS)
    steps = torch.randint(0, VOCAB, (len(PROMPTS), 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model.allocate_cache(len(PROMPTS))
        out = model(ids, cache=cache, seq_idx=seq_idx, logits_to_keep=last)
        assert out.logits.shape == (1, len(PROMPTS), model.config.padded_vocab_size)
        assert cache.seqlen_offset == max(len(p) for p in PROMPTS)
        packed_states = [[t.clone() for t in state_tensors(s)] for s in cache.layers]
        stepped = [model(steps[:, j : j + 1], cache=cache).logits[:, 0] for j in range(3)]
        for i, p in enumerate(PROMPTS):
            own = model.allocate_cache(1)
            alone = model(p[None], cache=own).logits[0, -1]
            close(out.logits[0, i], alone, f"{case} prompt {i} prefill logits")
            for layer, (mine, theirs) in enumerate(zip(packed_states, own.layers)):
                for a, b in zip(mine, state_tensors(theirs)):
                    close(a[i], b[0], f"{case} prompt {i} layer {layer} state")
            for j in range(3):
                step = model(steps[i : i + 1, j : j + 1], cache=own).logits[0, 0]
                close(stepped[j][i], step, f"{case} prompt {i} step {j} logits")


@pytest.mark.parametrize("case", ["mamba2", "hybrid-attn", "hybrid-swa"])
def test_packed_greedy_generation_is_each_prompt_alone_with_eos(case):
    """Greedy tokens of the packed batch equal each prompt's alone, token for token, with an eos
    that ends one row early (that row stops at it, no padding after), with and without the cache."""
    model = model_for(case)
    alone = [ssmkit.generate(model, p[None], 8, temperature=0)[0] for p in PROMPTS]
    news = [a[len(p) :].tolist() for a, p in zip(alone, PROMPTS)]
    # eos: a token some row first produces after a step or more, and another row never does
    eos = next(
        t
        for n in news
        for k, t in enumerate(n)
        if k and t not in n[:k] and any(t not in m for m in news)
    )
    with_eos = [
        a[: len(p) + n.index(eos) + 1] if eos in n else a for a, p, n in zip(alone, PROMPTS, news)
    ]
    assert any(len(w) < len(a) for w, a in zip(with_eos, alone))  # a row finishes early ...
    assert any(torch.equal(w, a) for w, a in zip(with_eos, alone))  # ... another does not
    for use_cache in (True, False):
        out = ssmkit.generate(
            model, PROMPTS, 8, temperature=0, eos_token_id=eos, use_cache=use_cache
        )
        assert isinstance(out, list) and len(out) == len(PROMPTS)
        for i, (got, want) in enumerate(zip(out, with_eos)):
            assert torch.equal(got, want), (case, use_cache, i)
    # prompts as lists of ints, and max_new_tokens 0 (the prompts back)
    as_lists = ssmkit.generate(model, [p.tolist() for p in PROMPTS], 8, temperature=0)
    assert all(torch.equal(a, b) for a, b in zip(as_lists, alone))
    assert all(torch.equal(a, b) for a, b in zip(ssmkit.generate(model, PROMPTS, 0), PROMPTS))


def test_models_without_per_sample_states_fall_back_to_left_padding():
    """S4D keeps no per-sample states: a list of prompts is generated as a left-padded batch,
    still each prompt's own tokens; a packed prefill into its cache is refused with the reason."""
    torch.manual_seed(0)
    model = perturb_(
        ssmkit.build_model(ModelConfig(d_model=32, n_layer=2, vocab_size=VOCAB, mixer="s4d")), 1
    ).eval()
    out = ssmkit.generate(model, PROMPTS, 5, temperature=0)
    for p, got in zip(PROMPTS, out):
        assert torch.equal(got, ssmkit.generate(model, p[None], 5, temperature=0)[0])
    ids, seq_idx, _ = _packed(PROMPTS)
    with pytest.raises(ValueError, match="its S4D layers have no per-sample states"):
        model(ids, seq_idx=seq_idx, cache=model.allocate_cache(len(PROMPTS)))


# --- seq_idx -1: ignored positions ----------------------------------------------------------------

# Row 0: samples 0 and 1, padding in the middle of sample 1 and at the end; row 1: padding first,
# sample 0, padding between samples 0 and 1 (the row ends with sample 1).
IGNORED = torch.tensor(
    [
        [0, 0, 0, 0, 1, 1, -1, -1, 1, 1, 1, -1],
        [-1, -1, 0, 0, 0, 0, 0, -1, 1, 1, 1, 1],
    ]
)


def ignored_samples():
    """The samples of IGNORED, row-major: (row, positions), each run alone by the oracle."""
    out = []
    for r in range(IGNORED.shape[0]):
        for s in sorted(set(IGNORED[r].tolist()) - {-1}):
            out.append((r, (IGNORED[r] == s).nonzero().reshape(-1)))
    return out


@pytest.mark.parametrize("case", ["mamba1", "mamba3", "hybrid-attn"])
def test_ignored_positions_change_no_state_and_take_no_loss(case):
    model = model_for(case)
    ids = torch.randint(0, VOCAB, IGNORED.shape, generator=torch.Generator().manual_seed(4))
    samples = ignored_samples()
    with torch.no_grad():
        out = model(ids, seq_idx=IGNORED, labels=ids)
        cache = model.allocate_cache(len(samples))
        model(ids, seq_idx=IGNORED, cache=cache)
        loss_sum, count = 0.0, 0
        for i, (r, where) in enumerate(samples):
            own = model.allocate_cache(1)
            alone = model(ids[r, where][None], cache=own, labels=ids[r, where][None])
            close(out.logits[r, where], alone.logits[0], f"{case} sample {i} logits")
            for layer, (mine, theirs) in enumerate(zip(cache.layers, own.layers)):
                for a, b in zip(state_tensors(mine), state_tensors(theirs)):
                    close(a[i], b[0], f"{case} sample {i} layer {layer} state")
            loss_sum += alone.loss * (len(where) - 1)
            count += len(where) - 1
        close(out.loss, loss_sum / count, f"{case} loss")
        # the control: the same ids read as real tokens (their own samples) give other logits
        as_tokens = torch.where(IGNORED < 0, IGNORED.max() + 1, IGNORED).cummax(dim=1).values
        other = model(ids, seq_idx=as_tokens).logits
        r, where = samples[1]  # sample 1 of row 0 has a hole of two positions
        assert (other[r, where] - out.logits[r, where]).abs().max() > 1e-3


def test_bad_seq_idx_values_are_named():
    model = model_for("mamba1")
    ids = torch.randint(0, VOCAB, (2, 6))
    cases = [
        (torch.tensor([[0, 0, -2, 1, 1, 1], [0] * 6]), "row 0 holds -2 at position 2"),
        (torch.tensor([[0, 1, -1, 0, 1, 1], [0] * 6]), r"row 0 decreases at position 3 \(1 -> 0\)"),
        (torch.full((2, 6), -1), "every position -1"),
    ]
    for seq_idx, match in cases:
        with pytest.raises(ValueError, match=match):
            model(ids, seq_idx=seq_idx, cache=model.allocate_cache(2))


# --- attention masks with holes -------------------------------------------------------------------

HOLES = torch.tensor(
    [
        [1, 1, 0, 0, 1, 1, 1, 0, 1, 1],  # holes in the middle, one of two positions
        [0, 1, 1, 1, 1, 0, 1, 1, 0, 0],  # left padding, a hole, right padding
        [0, 0, 0, 1, 1, 1, 1, 1, 1, 1],  # plain left padding
    ]
)


@pytest.mark.parametrize("case", ["mamba1", "mamba3", "hybrid-attn", "hybrid-swa"])
def test_a_mask_with_holes_is_the_row_without_them(case):
    """Logits at the real positions, the cache after the prefill, and greedy generation of a row
    with holes equal those of its real tokens alone; the control: without the mask they differ."""
    model = model_for(case)
    ids = torch.randint(0, VOCAB, HOLES.shape, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = model(ids, attention_mask=HOLES).logits
        unmasked = model(ids).logits
        cache = model.allocate_cache(len(ids))
        model(ids, attention_mask=HOLES, cache=cache)
        steps = [model(ids[:, j : j + 1], cache=cache).logits[:, 0] for j in range(2)]
        for r in range(len(ids)):
            real = HOLES[r].bool()
            own = model.allocate_cache(1)
            alone = model(ids[r, real][None], cache=own).logits[0]
            close(out[r, real], alone, f"{case} row {r} logits")
            assert (unmasked[r, real] - alone).abs().max() > 1e-3, (case, r)  # the control
            for j in range(2):
                step = model(ids[r : r + 1, j : j + 1], cache=own).logits[0, 0]
                close(steps[j][r], step, f"{case} row {r} step {j}")
    generated = ssmkit.generate(model, ids, 6, temperature=0, attention_mask=HOLES)
    assert torch.equal(generated[:, : ids.shape[1]], ids)  # the prompt as given, holes and all
    for r in range(len(ids)):
        alone = ssmkit.generate(model, ids[r, HOLES[r].bool()][None], 6, temperature=0)[0]
        assert torch.equal(generated[r, ids.shape[1] :], alone[-6:]), (case, r)


def test_holes_move_labels_with_their_tokens():
    """The loss of a row with holes is the loss of its real tokens alone: the target of the token
    before a hole is the token after it, and padded positions take no loss (whatever their
    labels)."""
    model = model_for("hybrid-attn")
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    mask = HOLES[:2]
    with torch.no_grad():
        loss = model(ids, attention_mask=mask, labels=ids).loss
        sums, count = 0.0, 0
        for r in range(2):
            real = ids[r, mask[r].bool()][None]
            sums += model(real, labels=real).loss * (real.shape[1] - 1)
            count += real.shape[1] - 1
    close(loss, sums / count, "loss with holes")


# --- the per-sample attention path, and the arguments ---------------------------------------------


def test_long_packed_rows_attend_sample_by_sample(monkeypatch):
    """Above PACKED_MASK_LIMIT a packed call attends one sample at a time: the same logits as the
    block-diagonal mask, full and windowed."""
    for case in ("hybrid-attn", "hybrid-swa"):
        model = model_for(case)
        ids, seq_idx, _ = _packed(PROMPTS)
        with torch.no_grad():
            masked = model(ids, seq_idx=seq_idx).logits
            monkeypatch.setattr(attention, "PACKED_MASK_LIMIT", 0)
            per_sample = model(ids, seq_idx=seq_idx).logits
            monkeypatch.undo()
        close(per_sample, masked, f"{case} per-sample attention")


def test_bad_prompts_and_packed_caches_are_named():
    model = model_for("mamba2")
    ids, seq_idx, last = _packed(PROMPTS)
    bad = [
        ([], "non-empty list"),
        ([PROMPTS[0], torch.tensor([], dtype=torch.long)], "prompt 1 must be a non-empty 1-D"),
        ([torch.zeros(2, 3, dtype=torch.long)], r"prompt 0 .* got shape \(2, 3\)"),
        ([[1, 2, 60 + 4]], "token id 64, outside the model's vocabulary"),
        (["hello"], "prompt 0 must be"),
    ]
    for prompts, match in bad:
        with pytest.raises(ValueError, match=match):
            ssmkit.generate(model, prompts, 3)
    with pytest.raises(ValueError, match="a list of prompts needs none"):
        ssmkit.generate(model, PROMPTS, 3, attention_mask=torch.ones(5, 3))
    with pytest.raises(ValueError, match="the cache has 4 rows but seq_idx packs 5 samples"):
        model(ids, seq_idx=seq_idx, cache=model.allocate_cache(4))
    used = model.allocate_cache(5)
    model(ids, seq_idx=seq_idx, cache=used)
    with pytest.raises(ValueError, match="fills a fresh cache"):
        model(ids, seq_idx=seq_idx, cache=used)
    with pytest.raises(ValueError, match=r"positions must lie in 0\.\.32"):
        model(ids, logits_to_keep=torch.tensor([0, 33]))
    with pytest.raises(ValueError, match="logits_to_keep must be an int >= 0"):
        model(ids, logits_to_keep=-1)
    with pytest.raises(ValueError, match="labels need logits for every position"):
        model(ids, labels=ids, logits_to_keep=last)
