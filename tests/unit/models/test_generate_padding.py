"""Left-padded batches, and the checks at the door of generate / forward / ModelConfig.

The oracle for padding: each prompt run alone, unpadded. A padded row must give the same logits at
its real positions (fp32, 1e-5) and the same greedy tokens, with and without the cache, for Mamba-1
and Mamba-2. The control shows the test can fail: without the mask the padding changes the logits.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import ssmkit
from ssmkit.models import ModelConfig

CASES = {
    "mamba1": dict(mixer="mamba1", d_state=8),
    "mamba1-bias-falcon": dict(mixer="mamba1", d_state=8, bias=True, mixer_rms_eps=1e-5, d_conv=3),
    # chunk_size 4 < the padding: chunks of padding only, and chunks mixing padding with real tokens
    "mamba2": dict(mixer="mamba2", d_state=8, headdim=16, ngroups=2, chunk_size=4),
    "mamba2-dt-limit": dict(
        mixer="mamba2", d_state=8, headdim=16, chunk_size=5, dt_limit=(0.01, 0.3)
    ),
}


def model_for(case: str):
    torch.manual_seed(0)
    model = ssmkit.build_model(
        ModelConfig(d_model=32, n_layer=2, vocab_size=60, **CASES[case])
    ).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the init (D = 1, norm = 1) so a mis-wired path cannot hide
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def left_padded(prompts: list[torch.Tensor], vocab: int):
    """(batch, longest) ids with RANDOM tokens in the padding (they must not matter) and the
    mask."""
    width = max(len(p) for p in prompts)
    ids = torch.randint(0, vocab, (len(prompts), width), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


PROMPTS = [
    torch.randint(0, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 3, 14, 1, 6)
]


@pytest.mark.parametrize("case", list(CASES))
def test_padded_rows_give_the_logits_of_the_prompt_alone(case):
    model = model_for(case)
    ids, mask = left_padded(PROMPTS, 60)
    width = ids.shape[1]
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        unmasked = model(ids).logits
        for i, p in enumerate(PROMPTS):
            alone = model(p[None]).logits[0]
            real = padded[i, width - len(p) :]
            assert (real - alone).abs().max() < 1e-5, (case, i)
            if len(p) < width:  # the control: the same batch without the mask sees the padding
                assert (unmasked[i, width - len(p) :] - alone).abs().max() > 1e-3, (case, i)
        # a prefill on a fresh cache with the mask leaves the states of the prompt alone
        cache = model.allocate_cache(len(PROMPTS))
        model(ids, cache=cache, attention_mask=mask)
        for i, p in enumerate(PROMPTS):
            own = model.allocate_cache(1)
            model(p[None], cache=own)
            for mine, theirs in zip(cache.layers, own.layers):
                assert (mine.ssm[i] - theirs.ssm[0]).abs().max() < 1e-5
                assert (mine.conv[i] - theirs.conv[0]).abs().max() < 1e-5


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_padded_greedy_generation_equals_each_prompt_alone(case, use_cache):
    model = model_for(case)
    ids, mask = left_padded(PROMPTS, 60)
    width = ids.shape[1]
    out = ssmkit.generate(
        model, ids, max_new_tokens=10, temperature=0, attention_mask=mask, use_cache=use_cache
    )
    # padding kept in front
    assert out.shape == (len(PROMPTS), width + 10) and torch.equal(out[:, :width], ids)
    for i, p in enumerate(PROMPTS):
        alone = ssmkit.generate(
            model, p[None], max_new_tokens=10, temperature=0, use_cache=use_cache
        )
        assert torch.equal(out[i, width - len(p) :], alone[0]), (case, i)


def test_an_all_ones_mask_is_the_plain_path():
    model = model_for("mamba2")
    ids = torch.randint(0, 60, (3, 7))
    plain = ssmkit.generate(model, ids, max_new_tokens=5, temperature=0)
    assert torch.equal(
        ssmkit.generate(
            model,
            ids,
            max_new_tokens=5,
            temperature=0,
            attention_mask=torch.ones_like(ids, dtype=torch.bool),
        ),
        plain,
    )


def test_bad_masks_are_refused():
    """Holes and right padding are accepted (tests/unit/models/test_packed_generation.py); values
    other than 0/1, a wrong shape, a row without a token and a mask after the prefill are not."""
    model = model_for("mamba1")
    ids = torch.randint(0, 60, (2, 5))
    with pytest.raises(ValueError, match="only 0 .padding. and 1"):
        ssmkit.generate(model, ids, 3, attention_mask=torch.full((2, 5), 2))
    with pytest.raises(ValueError, match=r"shape of input_ids \(2, 5\); got \(2, 4\)"):
        ssmkit.generate(model, ids, 3, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="row 1 is all padding"):
        ssmkit.generate(
            model, ids, 3, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
        )
    cache = model.allocate_cache(2)
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="first call on a cache"):
        model(ids[:, :1], cache=cache, attention_mask=torch.ones(2, 1, dtype=torch.long))


# --- 10. the arguments of generate and the ids of forward -----------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_new_tokens=-5), "max_new_tokens must be an int >= 0; got -5"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an int >= 0; got 2.5"),
        (dict(max_new_tokens=True), "max_new_tokens must be an int >= 0; got True"),
        (dict(temperature="0.7"), "temperature='0.7'"),
        (dict(temperature=-1), "temperature=-1"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_k=0), "top_k=0"),
        (dict(top_k=2.0), "top_k=2.0"),
        (dict(top_p=0), "top_p=0"),
        (dict(top_p="0.9"), "top_p='0.9'"),
        (dict(eos_token_id=60), "eos_token_id must be None or a token id in 0..59; got 60"),
    ],
)
def test_generate_options_are_checked_at_the_door(kwargs, message):
    model = model_for("mamba1")
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        ssmkit.generate(
            model, torch.zeros(1, 3, dtype=torch.long), **{"max_new_tokens": 3, **kwargs}
        )


def test_zero_new_tokens_returns_the_prompt():
    model = model_for("mamba1")
    ids = torch.randint(0, 60, (2, 4))
    assert torch.equal(ssmkit.generate(model, ids, max_new_tokens=0), ids)


@pytest.mark.parametrize("bad", [-1, 64, 10**6])
def test_token_ids_outside_the_vocabulary_are_one_clear_error(bad):
    model = model_for("mamba2")  # vocab_size 60, padded to 64 embedding rows
    ids = torch.tensor([[3, bad, 7]])
    expected = (
        rf"token id {bad}, outside the model's vocabulary: "
        rf"valid ids are 0\.\.63 \(vocab_size 60, padded to 64"
    )
    with pytest.raises(ValueError, match=expected):
        ssmkit.generate(model, ids, max_new_tokens=2)
    with pytest.raises(ValueError, match=expected):
        model(ids)
    with pytest.raises(ValueError, match="integer token ids; got dtype torch.float32"):
        model(ids.float())
    model(torch.tensor([[3, 63, 7]]))  # the last embedding row is a valid id


def test_forward_does_not_read_ids_under_torch_compile(monkeypatch):
    """The value check reads the tensor (a GPU sync, a graph break): skipped while compiling."""
    model = model_for("mamba1")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(IndexError):  # the embedding's own error: our check did not run
        model(torch.tensor([[3, 64]]))


# --- 8. ModelConfig float fields ------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("mamba2.A_init_range", (0.0, 16.0)),
        ("mamba2.A_init_range", (-1.0, 16.0)),
        ("mamba2.A_init_range", (16.0, 1.0)),
        ("mamba2.A_init_range", (1.0, math.nan)),
        ("mamba2.A_init_range", (1.0,)),
        ("mamba2.A_init_range", (1.0, math.inf)),
        ("mamba2.dt_min", 0.0),
        ("mamba2.dt_min", -0.001),
        ("mamba2.dt_min", "0.001"),
        ("mamba2.dt_max", 1e-5),
        ("mamba2.dt_init_floor", 0.0),
        ("norm_epsilon", 0.0),
        ("norm_epsilon", -1e-5),
        ("norm_epsilon", math.nan),
        ("mamba2.dt_limit", (-0.1, 1.0)),
        ("mamba2.dt_limit", (0.5, 0.1)),
        ("mamba2.dt_limit", (math.nan, 1.0)),
        ("mamba1.mixer_rms_eps", 0.0),
        ("mamba1.dt_scale", -1.0),
        ("initializer_range", math.inf),
        ("d_model", True),
        ("tie_embeddings", "yes"),
        ("mamba1.dt_rank", 0),
        ("mamba3.A_floor", 0.0),
    ],
)
def test_config_fields_outside_their_range_name_the_field(field, value):
    """Each error names the field, a mixer's as its group's path; the short form (the field given
    flat) names the same path when the model's mixer takes it."""
    group, _, name = field.rpartition(".")
    mixer = group or "mamba2"
    heads = {"headdim": 16} if mixer != "mamba1" else {}
    grouped = {mixer: {**heads, **({name: value} if group else {})}}
    base = dict(d_model=32, n_layer=1, vocab_size=10, mixer=mixer)
    for kwargs in (
        {**base, **grouped, **({} if group else {field: value})},
        {**base, **heads, name: value},
    ):
        with pytest.raises(ValueError, match=rf"^{re.escape(field)} must be") as info:
            ModelConfig(**kwargs)
        assert "\n" not in str(info.value)


def test_config_boundary_values_give_finite_logits():
    """The oracle for the ranges: values at their edges are accepted and give finite logits; the
    values refused above are the ones that would not (log of A <= 0 is NaN, eps 0 divides by
    zero)."""
    for kwargs in (
        dict(A_init_range=(0.5, 0.5), dt_limit=(0.0, 0.1), dt_min=0.01, dt_max=0.01),
        dict(dt_limit=(0.2, 0.2), norm_epsilon=1e-12, dt_scale=0.0),
    ):
        torch.manual_seed(0)
        cfg = ModelConfig(
            d_model=32, n_layer=2, vocab_size=10, mixer="mamba2", headdim=16, chunk_size=4, **kwargs
        )
        model = ssmkit.build_model(cfg)
        assert torch.isfinite(model(torch.randint(0, 10, (2, 9))).logits).all(), kwargs
    cfg = ModelConfig(d_model=32, n_layer=2, vocab_size=10, mixer="mamba2", headdim=16)
    cfg.mamba2.A_init_range = (-2.0, -1.0)  # what the check refuses, slipped past it: NaN
    torch.manual_seed(0)
    assert torch.isnan(ssmkit.build_model(cfg)(torch.randint(0, 10, (2, 9))).logits).any()
