"""Models against outside oracles and second paths.

* transformers' ``MambaMixer`` / ``Mamba2Mixer`` and ``MambaForCausalLM`` / ``Mamba2ForCausalLM``
  (pure-PyTorch fallbacks) with the same weights copied in by name: fp32, max abs diff <= 1e-4;
* the recurrent cache against re-running the full forward (generation, chunked prefill);
* configs, presets and their errors.
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM
from transformers.models.mamba.modeling_mamba import MambaMixer
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

import ssmkit
from ssmkit.models import InferenceCache, Mamba1, Mamba2, ModelConfig

ATOL = 1e-4  # fp32, max abs difference against transformers


def hf_mamba1_config(cfg: ModelConfig) -> MambaConfig:
    m = cfg.mamba1
    return MambaConfig(
        vocab_size=cfg.padded_vocab_size,
        hidden_size=cfg.d_model,
        state_size=m.d_state,
        num_hidden_layers=cfg.n_layer,
        expand=m.expand,
        conv_kernel=m.d_conv,
        time_step_rank=m.dt_rank_value(cfg.d_model),
        layer_norm_epsilon=cfg.norm_epsilon,
        use_bias=m.bias,
        use_conv_bias=m.conv_bias,
        tie_word_embeddings=cfg.tie_embeddings,
        residual_in_fp32=cfg.residual_in_fp32,
        use_associative_scan=False,
    )


def hf_mamba2_config(cfg: ModelConfig) -> Mamba2Config:
    m = cfg.mamba2
    return Mamba2Config(
        vocab_size=cfg.padded_vocab_size,
        hidden_size=cfg.d_model,
        state_size=m.d_state,
        num_hidden_layers=cfg.n_layer,
        expand=m.expand,
        conv_kernel=m.d_conv,
        head_dim=m.headdim,
        num_heads=m.nheads(cfg.d_model),
        n_groups=m.ngroups,
        chunk_size=m.chunk_size,
        layer_norm_epsilon=cfg.norm_epsilon,
        use_bias=m.bias,
        use_conv_bias=m.conv_bias,
        tie_word_embeddings=cfg.tie_embeddings,
        residual_in_fp32=cfg.residual_in_fp32,
    )


def perturb_(module: torch.nn.Module, seed: int):
    """Move every parameter off its init (D = 1, norm = 1, ...) so a mis-wired one cannot hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


MAMBA1_CASES = [
    dict(d_model=32, d_state=16, expand=2, d_conv=4),
    dict(d_model=48, d_state=8, expand=1, d_conv=3, dt_rank=5),
    dict(d_model=24, d_state=4, expand=3, d_conv=2, bias=True, conv_bias=False),
]
MAMBA2_CASES = [
    dict(d_model=32, d_state=16, headdim=16, ngroups=1, chunk_size=8),
    dict(d_model=48, d_state=8, headdim=8, ngroups=3, chunk_size=16, d_conv=3),
    dict(d_model=32, d_state=32, headdim=32, ngroups=2, chunk_size=64, expand=4),
]


MIXER_CASES = [("mamba1", c) for c in MAMBA1_CASES] + [("mamba2", c) for c in MAMBA2_CASES]
TWINS = {
    "mamba1": (Mamba1, MambaMixer, hf_mamba1_config),
    "mamba2": (Mamba2, Mamba2Mixer, hf_mamba2_config),
}


@pytest.mark.parametrize(
    "mixer,case",
    MIXER_CASES,
    ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())),
)
@pytest.mark.parametrize("seqlen", [1, 37])
def test_mixer_matches_transformers(mixer, case, seqlen):
    ours_cls, theirs_cls, hf_config = TWINS[mixer]
    cfg = ModelConfig(n_layer=1, vocab_size=64, mixer=mixer, **case)
    ours = ours_cls(cfg.d_model, cfg.mixer_cfg())
    perturb_(ours, 0)
    theirs = theirs_cls(hf_config(cfg), layer_idx=0).eval()
    theirs.load_state_dict(ours.state_dict())  # same names, strict
    x = torch.randn(3, seqlen, cfg.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=ATOL, rtol=0)


def to_hf_state_dict(model) -> dict:
    """ssmkit (mamba_ssm names) -> transformers names: only the embedding differs."""
    return {
        k.replace("backbone.embedding.", "backbone.embeddings."): v
        for k, v in model.state_dict().items()
    }


def hf_twin(model):
    cfg = model.config
    hf = (
        MambaForCausalLM(hf_mamba1_config(cfg))
        if cfg.mixer == "mamba1"
        else Mamba2ForCausalLM(hf_mamba2_config(cfg))
    )
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf.eval()


LM_CASES = [
    dict(mixer="mamba1", d_model=32, n_layer=3, vocab_size=100, d_state=8),
    dict(mixer="mamba1", d_model=32, n_layer=2, vocab_size=100, d_state=16, tie_embeddings=False),
    dict(
        mixer="mamba2",
        d_model=32,
        n_layer=3,
        vocab_size=100,
        d_state=16,
        headdim=16,
        ngroups=2,
        chunk_size=16,
    ),
    dict(
        mixer="mamba2",
        d_model=32,
        n_layer=2,
        vocab_size=100,
        d_state=8,
        headdim=8,
        chunk_size=5,
        tie_embeddings=False,
    ),
]


@pytest.mark.parametrize(
    "case", LM_CASES, ids=lambda c: f"{c['mixer']}-tie{c.get('tie_embeddings', True)}"
)
def test_lm_logits_and_greedy_generation_match_transformers(case):
    torch.manual_seed(0)
    model = ssmkit.build_model(ModelConfig(**case))
    perturb_(model, 1)
    model.eval()
    hf = hf_twin(model)
    ids = torch.randint(0, case["vocab_size"], (2, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids, labels=ids)
        ref = hf(ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=0)
    ours = ssmkit.generate(model, ids[:, :7], max_new_tokens=12, temperature=0)
    # ssmkit never samples them
    padding_rows = list(range(case["vocab_size"], model.config.padded_vocab_size))
    theirs = hf.generate(
        ids[:, :7],
        max_new_tokens=12,
        do_sample=False,
        min_new_tokens=12,
        suppress_tokens=padding_rows,
        attention_mask=torch.ones_like(ids[:, :7]),
        pad_token_id=0,
    )
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mamba2"])
def test_cached_generation_equals_full_recompute(preset):
    torch.manual_seed(0)
    model = ssmkit.build_model(ModelConfig.preset(preset, n_layer=2))
    perturb_(model, 3)
    prompt = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(4))
    fast = ssmkit.generate(model, prompt, max_new_tokens=40, temperature=0)
    slow = ssmkit.generate(model, prompt, max_new_tokens=40, temperature=0, use_cache=False)
    assert fast.shape == (3, 51)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mamba2"])
def test_cache_prefill_in_pieces_and_steps_match_full_forward(preset):
    """Logits of a prefill in two chunks, then single steps, equal one full forward."""
    torch.manual_seed(0)
    model = ssmkit.build_model(ModelConfig.preset(preset, n_layer=2)).eval()
    perturb_(model, 5)
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_cache(2)
        parts = [model(ids[:, :50], cache=cache).logits, model(ids[:, 50:85], cache=cache).logits]
        parts += [model(ids[:, t : t + 1], cache=cache).logits for t in range(85, 90)]
    assert cache.seqlen_offset == 90
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=0)


def test_cache_memory_is_constant_in_length():
    model = ssmkit.build_model("tiny")
    cache = model.allocate_cache(1)
    before = cache.nbytes()
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 300)), cache=cache)
        for _ in range(5):
            model(torch.randint(0, 256, (1, 1)), cache=cache)
    assert cache.nbytes() == before
    assert isinstance(cache, InferenceCache) and cache.seqlen_offset == 305


def test_sampling_options():
    torch.manual_seed(0)
    model = ssmkit.build_model("tiny")
    prompt = torch.randint(0, 256, (4, 5))
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    a = ssmkit.generate(
        model, prompt, max_new_tokens=8, temperature=0.9, top_k=5, top_p=0.9, generator=g()
    )
    b = ssmkit.generate(
        model, prompt, max_new_tokens=8, temperature=0.9, top_k=5, top_p=0.9, generator=g()
    )
    assert torch.equal(a, b) and a.shape == (4, 13) and int(a.max()) < 256
    # top_k=1 is greedy; eos stops a row and pads it
    greedy = ssmkit.generate(model, prompt, max_new_tokens=8, temperature=0)
    assert torch.equal(ssmkit.generate(model, prompt, max_new_tokens=8, top_k=1), greedy)
    eos = int(greedy[0, 6])
    stopped = ssmkit.generate(model, prompt, max_new_tokens=8, temperature=0, eos_token_id=eos)
    assert (stopped[0, 6:] == eos).all()
    with pytest.raises(ValueError, match="top_p"):
        ssmkit.generate(model, prompt, max_new_tokens=2, top_p=1.5)


def test_nucleus_keeps_smallest_set_reaching_p():
    from ssmkit.models import sample_next

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {
        int(sample_next(logits, top_p=0.8, generator=torch.Generator().manual_seed(s)))
        for s in range(200)
    }
    assert seen == {0, 1}


def test_padded_vocab_and_parameter_names_follow_mamba_ssm():
    cfg = ModelConfig.preset("mamba-130m")
    assert (cfg.d_model, cfg.n_layer, cfg.mamba1.d_state) == (768, 24, 16)
    assert cfg.padded_vocab_size == 50280
    assert ModelConfig.preset("mamba2-130m").padded_vocab_size == 50288
    model = ssmkit.build_model(ModelConfig(d_model=16, n_layer=1, vocab_size=10))
    names = set(model.state_dict())
    expected = {
        "backbone.embedding.weight",
        "backbone.norm_f.weight",
        "lm_head.weight",
        "backbone.layers.0.norm.weight",
    }
    expected |= {
        f"backbone.layers.0.mixer.{n}"
        for n in (
            "in_proj.weight",
            "conv1d.weight",
            "conv1d.bias",
            "x_proj.weight",
            "dt_proj.weight",
            "dt_proj.bias",
            "A_log",
            "D",
            "out_proj.weight",
        )
    }
    assert names == expected
    assert model.backbone.embedding.weight.shape == (16, 16)
    assert model.lm_head.weight is model.backbone.embedding.weight


@pytest.mark.parametrize(
    "name,params",
    [
        ("mamba-130m", 129.1e6),
        ("mamba2-130m", 128.9e6),
        ("mamba-370m", 371.5e6),
    ],
)
def test_preset_parameter_counts(name, params):
    """Parameter counts of the official checkpoints (tied embeddings counted once), built on
    meta."""
    with torch.device("meta"):
        model = ssmkit.build_model(name)
    assert abs(model.num_parameters() - params) / params < 0.01


def test_initialisation_follows_mamba_ssm():
    cfg = ModelConfig(d_model=64, n_layer=4, vocab_size=32)
    torch.manual_seed(0)
    mixer = ssmkit.build_model(cfg).backbone.layers[0].mixer
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias)
    assert dt.min() >= cfg.mamba1.dt_min * 0.999 and dt.max() <= cfg.mamba1.dt_max * 1.001
    torch.testing.assert_close(
        mixer.A_log.exp()[0], torch.arange(1, 17, dtype=torch.float32)
    )  # S4D-real
    assert torch.equal(mixer.D, torch.ones(128))
    bound = 1 / 128**0.5 / cfg.n_layer**0.5  # kaiming_uniform(a=√5) / √n_layer
    assert (
        mixer.out_proj.weight.abs().max() <= bound
        and mixer.out_proj.weight.abs().max() > 0.8 * bound
    )
    m2 = ssmkit.build_model(
        ModelConfig(d_model=64, n_layer=2, vocab_size=32, mixer="mamba2", headdim=16)
    )
    A = -m2.backbone.layers[0].mixer.A_log.exp()
    assert ((A <= -1) & (A >= -16)).all()
    assert all(
        getattr(p, "_no_weight_decay", False) for p in (mixer.A_log, mixer.D, mixer.dt_proj.bias)
    )


def test_config_errors_name_what_is_valid():
    with pytest.raises(ValueError, match="valid presets: tiny"):
        ModelConfig.preset("mamba-9b")
    with pytest.raises(ValueError, match="valid mixers: mamba1, mamba2"):
        ModelConfig(mixer="transformer")
    with pytest.raises(ValueError, match="valid keys: d_model"):
        ModelConfig.from_dict({"d_modle": 3})
    with pytest.raises(ValueError, match="headdim"):
        ModelConfig(d_model=40, mixer="mamba2", headdim=64)
    with pytest.raises(ValueError, match="ngroups"):
        ModelConfig(d_model=64, mixer="mamba2", headdim=32, ngroups=3)
    with pytest.raises(ValueError, match="layout has 2 entries but n_layer=3"):
        ModelConfig(n_layer=3, layout=["mamba1", "mamba2"])
    with pytest.raises(ValueError, match="input_ids must be"):
        ssmkit.build_model("tiny")(torch.zeros(5, dtype=torch.long))


def test_layout_mixes_mixers_and_config_round_trips():
    cfg = ModelConfig(
        d_model=32,
        n_layer=3,
        vocab_size=50,
        layout=["mamba1", "mamba2", "mamba1"],
        headdim=16,
        d_state=8,
    )
    model = ssmkit.build_model(cfg)
    kinds = [type(layer.mixer).__name__ for layer in model.backbone.layers]
    assert kinds == ["Mamba1", "Mamba2", "Mamba1"]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    ids = torch.randint(0, 50, (2, 12))
    assert torch.equal(
        ssmkit.generate(model, ids, 6, temperature=0),
        ssmkit.generate(model, ids, 6, temperature=0, use_cache=False),
    )


def test_training_reduces_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    for preset in ("tiny", "tiny-mamba2"):
        model = ssmkit.build_model(ModelConfig.preset(preset, n_layer=2))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ids = torch.randint(0, 256, (4, 64))
        first = model(ids, labels=ids).loss.item()
        for _ in range(30):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert loss.item() < 0.7 * first, preset


def test_mamba2_step_applies_dt_limit_like_the_chunked_scan():
    """mamba_ssm's step ignores dt_limit; ssmkit clamps Δ in the step too, so both paths agree."""
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny-mamba2", n_layer=2, dt_limit=(0.02, 0.05))
    model = ssmkit.build_model(cfg).eval()
    perturb_(model, 8)
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_cache(2)
        steps = torch.cat(
            [model(ids[:, :20], cache=cache).logits]
            + [model(ids[:, t : t + 1], cache=cache).logits for t in range(20, 30)],
            dim=1,
        )
        unclamped = ssmkit.build_model(ModelConfig.preset("tiny-mamba2", n_layer=2))
        unclamped.load_state_dict(model.state_dict())
        other = unclamped.eval()(ids).logits
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=0)
    assert (other - full).abs().max() > 1e-3  # the limit really changes the model


@pytest.mark.parametrize("extra", ["plain", "packed", "left padding", "layer checkpointing"])
def test_mamba2_recomputing_backward_equals_the_plain_one(monkeypatch, extra):
    """Training Mamba-2 on the torch ops recomputes in the backward: the mixer's conv + SiLU and
    gated norm (torch.utils.checkpoint) and the SSD by segments (forced here, segments of 16 steps:
    4 per row). Loss and every parameter's gradient equal the plain autograd path's (fp32, max
    |diff| <= 1e-5 x max(1, max |plain|)), packed rows, left padding and the model's layer
    checkpointing (which nests these recomputations in its own) included."""
    from ssmkit.models import mamba2

    torch.manual_seed(0)
    model = ssmkit.build_model(ModelConfig.preset("tiny-mamba2", n_layer=2, chunk_size=8))
    perturb_(model, 8)
    ids = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(1))
    kw = {}
    if extra == "packed":
        kw["seq_idx"] = torch.tensor([[0] * 16 + [1] * 30 + [2] * 14, [3] * 45 + [4] * 15])
    if extra == "left padding":
        kw["attention_mask"] = (torch.arange(60) >= torch.tensor([[0], [13]])).long()
    model.backbone.gradient_checkpointing = extra == "layer checkpointing"

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, **kw).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    monkeypatch.setattr(mamba2, "_maybe_recomputed", lambda fn, *args, on: fn(*args))
    ssmkit.ops.ssd_recompute(False)
    try:
        plain = loss_and_grads()
        monkeypatch.undo()
        monkeypatch.setattr(sys.modules["ssmkit.ops.ssd"], "RECOMPUTE_SEGMENT", 16)
        ssmkit.ops.ssd_recompute(True)
        lean = loss_and_grads()
    finally:
        ssmkit.ops.ssd_recompute(None)
    for i, (a, b) in enumerate(zip(lean, plain)):
        err = (a - b).abs().max().item()
        assert err <= 1e-5 * max(1.0, b.abs().max().item()), (i, err)
