"""Hybrid checkpoints: mamba_ssm's layout with attention layers and MLPs (both ways, exactly),
transformers' Jamba (logits parity with JambaForCausalLM both ways, cached generation), the dispatch
to Zamba2, and every refusal naming its field."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import MAMBA_SSM_CONFIG_FIELDS, perturb_
from transformers import JambaConfig, JambaForCausalLM, Zamba2Config, Zamba2ForCausalLM

import ssmkit
from ssmkit import CheckpointError
from ssmkit.hub import config_from_mamba_ssm
from ssmkit.models import ModelConfig, generate

ATOL = 1e-4


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    x, y = a.state_dict(), b.state_dict()
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# --- mamba_ssm hybrids: attention layers (MHA) and GatedMLPs --------------------------------------

MAMBA2 = dict(mixer="mamba2", d_state=16, headdim=16, chunk_size=8)
MS_CASES = {
    "mamba1-attn-mlp": dict(
        mixer="mamba1",
        d_state=8,
        attn_layer_idx=[1, 3],
        attn_cfg=dict(num_heads=4),
        d_intermediate=96,
    ),
    "mamba2-gqa-rotary-conv": dict(
        MAMBA2,
        attn_layer_idx=[2],
        attn_cfg=dict(num_heads=4, num_heads_kv=2, rotary_emb_dim=8, d_conv=4, qkv_proj_bias=False),
    ),
    "mamba1-parallel-mlp-untied": dict(
        mixer="mamba1",
        d_state=8,
        attn_layer_idx=[0, 2],
        d_intermediate=128,
        tie_embeddings=False,
        attn_cfg=dict(
            num_heads=2,
            num_heads_kv=1,
            head_dim=24,
            mlp_dim=100,
            rotary_emb_dim=16,
            rotary_emb_interleaved=True,
            rotary_emb_base=500.0,
            softmax_scale=0.3,
            out_proj_bias=False,
        ),
    ),
    "mamba2-layout-mlp": dict(
        MAMBA2,
        layout=["attn", "mamba2", "mamba2", "attn"],
        d_intermediate=64,
        attn_cfg=dict(num_heads=4, d_conv=3),
    ),
}


@pytest.mark.parametrize("name", list(MS_CASES))
def test_mamba_ssm_hybrids_round_trip_exactly(tmp_path, name):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_layer=4, vocab_size=100, **MS_CASES[name])
    model = perturb_(ssmkit.build_model(cfg), 1).eval()
    model.save_pretrained(tmp_path / "ms", format="mamba_ssm")
    written = json.loads((tmp_path / "ms" / "config.json").read_text())
    assert set(written) == MAMBA_SSM_CONFIG_FIELDS
    assert written["attn_layer_idx"] == model.config.attn_layer_idx
    assert written["d_intermediate"] == model.config.d_intermediate
    assert written["attn_cfg"]["causal"] is True and "window_size" not in written["attn_cfg"]
    back = ssmkit.from_pretrained(tmp_path / "ms").eval()
    assert back.config.mixers == model.config.mixers
    if model.config.layout is None:
        assert back.config == model.config
    assert same_state(back, model)
    ids = torch.randint(0, 100, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=0, rtol=0)
    back.save_pretrained(tmp_path / "again", format="mamba_ssm")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == written


# state-spaces/mamba2attn-2.7b's config.json, shrunk (d_model 2560 -> 64, 64 -> 8 layers, 30 heads
# of 128 -> 3 of 32: heads * head_dim != d_model as there, rotary on half of each head)
MAMBA2ATTN = {
    "d_model": 64,
    "d_intermediate": 0,
    "n_layer": 8,
    "vocab_size": 50,
    "ssm_cfg": {"layer": "Mamba2", "d_state": 16, "headdim": 16, "chunk_size": 8},
    "attn_layer_idx": [1, 3, 7],
    "attn_cfg": {
        "causal": True,
        "d_conv": 4,
        "head_dim": 32,
        "num_heads": 3,
        "out_proj_bias": False,
        "qkv_proj_bias": False,
        "rotary_emb_dim": 16,
    },
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 16,
    "tie_embeddings": True,
}


def write_mamba2attn(folder, config=MAMBA2ATTN) -> dict:
    """The checkpoint as mamba_ssm writes it, shapes from its Mamba2 and MHA modules, not from
    ssmkit."""
    d, g = config["d_model"], torch.Generator().manual_seed(3)
    d_inner, heads, conv_dim = 2 * d, 2 * d // 16, 2 * d + 2 * 16
    qkv = 32 * (3 + 2 * 3)
    shapes = {"backbone.embedding.weight": (64, d), "backbone.norm_f.weight": (d,)}
    for i in range(config["n_layer"]):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (d,)
        if i in config["attn_layer_idx"]:
            shapes.update(
                {
                    p + "mixer.in_proj.weight": (qkv, d),
                    p + "mixer.conv1d.weight": (qkv, 1, 4),
                    p + "mixer.conv1d.bias": (qkv,),
                    p + "mixer.out_proj.weight": (d, 3 * 32),
                }
            )
        else:
            shapes.update(
                {
                    p + "mixer.in_proj.weight": (d_inner + conv_dim + heads, d),
                    p + "mixer.conv1d.weight": (conv_dim, 1, 4),
                    p + "mixer.conv1d.bias": (conv_dim,),
                    p + "mixer.dt_bias": (heads,),
                    p + "mixer.A_log": (heads,),
                    p + "mixer.D": (heads,),
                    p + "mixer.norm.weight": (d_inner,),
                    p + "mixer.out_proj.weight": (d, d_inner),
                }
            )
    state = {k: 0.3 * torch.randn(s, generator=g) for k, s in shapes.items()}
    state["lm_head.weight"] = state["backbone.embedding.weight"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(state, folder / "pytorch_model.bin")
    return state


def test_mamba2attn_layout_loads_generates_causally_and_saves_back(tmp_path):
    state = write_mamba2attn(tmp_path / "ms")
    model = ssmkit.from_pretrained(tmp_path / "ms").eval()
    assert [i for i, m in enumerate(model.config.mixers) if m == "attn"] == [1, 3, 7]
    assert "mamba1" not in model.config.mixers
    loaded = model.state_dict()
    assert loaded.keys() == state.keys() and all(
        torch.equal(loaded[k], v) for k, v in state.items()
    )
    ids = torch.randint(0, 50, (2, 12))
    later = ids.clone()
    later[:, 8:] = (later[:, 8:] + 1) % 50
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.isfinite(logits).all()
        # causal: changing tokens 8.. leaves the logits before them alone (mamba_ssm's MHA would
        # not)
        torch.testing.assert_close(model(later).logits[:, :8], logits[:, :8], atol=0, rtol=0)
    torch.testing.assert_close(
        generate(model, ids[:, :4], 6, temperature=0, use_cache=True),
        generate(model, ids[:, :4], 6, temperature=0, use_cache=False),
        atol=0,
        rtol=0,
    )
    model.save_pretrained(tmp_path / "back", format="mamba_ssm")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("attn_cfg", "ssm_cfg")} == {
        k: v for k, v in MAMBA2ATTN.items() if k not in ("attn_cfg", "ssm_cfg")
    }
    assert (
        MAMBA2ATTN["attn_cfg"].items() <= written["attn_cfg"].items()
    )  # filled in with MHA's defaults
    assert MAMBA2ATTN["ssm_cfg"].items() <= written["ssm_cfg"].items()
    saved = torch.load(tmp_path / "back" / "pytorch_model.bin", weights_only=True)
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], v) for k, v in state.items())


def rewrite(folder, **change):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))


def test_mamba_ssm_refusals_name_the_field(tmp_path):
    write_mamba2attn(tmp_path / "ms")
    attn = MAMBA2ATTN["attn_cfg"]
    for bad, pattern in [
        ({k: v for k, v in attn.items() if k != "causal"}, r"'attn_cfg\.causal' is missing"),
        ({**attn, "causal": False}, r"'attn_cfg\.causal' is False"),
        ({**attn, "window_size": 8}, r"'attn_cfg\.window_size'"),
        ({k: v for k, v in attn.items() if k != "num_heads"}, r"'attn_cfg\.num_heads'"),
        ({**attn, "num_heads_kv": 2}, r"attn_cfg\.num_heads_kv"),
    ]:
        rewrite(tmp_path / "ms", attn_cfg=bad)
        with pytest.raises(CheckpointError, match=pattern) as info:
            ssmkit.from_pretrained(tmp_path / "ms")
        assert "config.json" in str(info.value)
    rewrite(tmp_path / "ms", attn_cfg={**attn, "causal": False})
    with pytest.raises(
        CheckpointError, match="bidirectional"
    ):  # what mamba_ssm's default would build
        ssmkit.from_pretrained(tmp_path / "ms")
    # no attention layer: mamba_ssm never builds its MHA, so an attn_cfg without causal is harmless
    pure = config_from_mamba_ssm({**MAMBA2ATTN, "attn_layer_idx": [], "attn_cfg": {"num_heads": 3}})
    assert pure.attn_cfg is None and pure.mixers == ["mamba2"] * 8

    def model(**kw):
        return ssmkit.build_model(
            ModelConfig(d_model=32, n_layer=2, vocab_size=64, d_state=8, **kw)
        )

    swa = model(layout=["mamba1", "swa"], attn_cfg=dict(num_heads=2, window_size=4))
    windowed = model(attn_layer_idx=[1], attn_cfg=dict(num_heads=2, window_size=4))
    for m in (swa, windowed):
        with pytest.raises(CheckpointError, match="window_size"):
            m.save_pretrained(tmp_path / "x", format="mamba_ssm")
    with pytest.raises(CheckpointError, match="one SSM layer type"):
        model(layout=["mamba1", "mamba2"], headdim=16).save_pretrained(
            tmp_path / "x", format="mamba_ssm"
        )
    hybrid = model(attn_layer_idx=[1], attn_cfg=dict(num_heads=2), d_intermediate=64)
    with pytest.raises(
        CheckpointError,
        match=r"attention layers \(attn_layer_idx\) or MLPs "
        r"\(d_intermediate\).*save format='mamba_ssm'$",
    ):
        hybrid.save_pretrained(tmp_path / "x", format="hf")
    jamba_like = model(
        attn_layer_idx=[1],
        attn_cfg=dict(num_heads=2, qkv_proj_bias=False, out_proj_bias=False),
        d_intermediate=64,
        mixer_rms_eps=1e-6,
        mixer_rms_weights=True,
        norm_epsilon=1e-6,
    )
    with pytest.raises(CheckpointError, match=r"mixer_rms_weights.*save format='jamba'$"):
        jamba_like.save_pretrained(tmp_path / "x", format="hf")
    with pytest.raises(CheckpointError, match="format='jamba'"):
        jamba_like.save_pretrained(tmp_path / "x", format="mamba_ssm")
    assert not (tmp_path / "x").exists()


# --- transformers' Jamba (dense) ------------------------------------------------------------------

JAMBA_BASE = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_experts=1,
    mamba_d_state=8,
    attn_implementation="eager",
)
JAMBA_CASES = {
    "gqa-period2": dict(
        attn_layer_period=2, attn_layer_offset=1, num_key_value_heads=2, mamba_dt_rank=4
    ),
    "mqa-offset0-tied-bias-width100": dict(
        attn_layer_period=3,
        attn_layer_offset=0,
        num_key_value_heads=1,
        intermediate_size=100,
        tie_word_embeddings=True,
        mamba_proj_bias=True,
        mamba_conv_bias=False,
    ),
    "head_dim-eps-conv3-expand3": dict(
        attn_layer_period=4,
        attn_layer_offset=3,
        num_key_value_heads=4,
        head_dim=12,
        rms_norm_eps=1e-5,
        mamba_d_conv=3,
        mamba_expand=3,
    ),
}


def jamba_model(**kw) -> JambaForCausalLM:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = JambaForCausalLM(JambaConfig(**{**JAMBA_BASE, **kw}))
    return perturb_(model, 2).eval()


@pytest.mark.parametrize("name", list(JAMBA_CASES))
def test_jamba_loads_and_saves_with_transformers_logits(tmp_path, name):
    hf = jamba_model(**JAMBA_CASES[name])
    hf.save_pretrained(tmp_path / "hf")
    model = ssmkit.from_pretrained(tmp_path / "hf").eval()
    kinds = {"attention": "attn", "mamba": "mamba1"}
    assert model.config.mixers == [kinds[t] for t in hf.config.layers_block_type]
    assert not model.config.residual_in_fp32 and model.config.mamba1.mixer_rms_weights
    ids = torch.randint(0, 100, (2, 13))
    ids[:, 2] = 0  # pad_token_id: its embedding row is read as any other
    with torch.no_grad():
        want = hf(ids, use_cache=False).logits
        torch.testing.assert_close(model(ids).logits, want, atol=ATOL, rtol=0)
    model.save_pretrained(tmp_path / "back", format="jamba")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == "jamba" and written["num_experts"] == 1
    again = JambaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert again.config.layers_block_type == hf.config.layers_block_type
    with torch.no_grad():
        torch.testing.assert_close(again(ids, use_cache=False).logits, want, atol=ATOL, rtol=0)
    assert same_state(ssmkit.from_pretrained(tmp_path / "back"), model)


def test_ssmkit_hybrid_saves_as_jamba(tmp_path):
    cfg = ModelConfig(
        d_model=48,
        n_layer=5,
        vocab_size=90,
        mixer="mamba1",
        d_state=8,
        attn_layer_idx=[0, 3],
        attn_cfg=dict(num_heads=4, num_heads_kv=2, qkv_proj_bias=False, out_proj_bias=False),
        d_intermediate=200,
        mixer_rms_eps=1e-6,
        mixer_rms_weights=True,
        norm_epsilon=1e-6,
    )
    model = perturb_(ssmkit.build_model(cfg), 3).eval()
    model.save_pretrained(tmp_path / "j", format="jamba")
    written = json.loads((tmp_path / "j" / "config.json").read_text())
    assert (written["attn_layer_period"], written["attn_layer_offset"]) == (3, 0)
    assert (written["intermediate_size"], written["vocab_size"]) == (
        256,
        96,
    )  # the MLP's, embedding's rows
    hf = JambaForCausalLM.from_pretrained(tmp_path / "j").eval()
    ids = torch.randint(0, 90, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(
            hf(ids, use_cache=False).logits, model(ids).logits, atol=ATOL, rtol=0
        )


def test_loaded_jamba_generates_the_same_with_and_without_cache(tmp_path):
    hf = jamba_model(attn_layer_period=2, attn_layer_offset=0, num_key_value_heads=2)
    hf.save_pretrained(tmp_path)
    model = ssmkit.from_pretrained(tmp_path).eval()
    prompt = torch.randint(1, 100, (2, 5))
    cached = generate(model, prompt, max_new_tokens=8, temperature=0, use_cache=True)
    assert torch.equal(
        cached, generate(model, prompt, max_new_tokens=8, temperature=0, use_cache=False)
    )
    with torch.no_grad():  # each cached step's logits are the full forward's
        cache = model.allocate_cache(2)
        steps = [model(prompt, cache=cache).logits]
        steps += [
            model(cached[:, t : t + 1], cache=cache).logits for t in range(5, cached.shape[1])
        ]
        torch.testing.assert_close(torch.cat(steps, dim=1), model(cached).logits, atol=ATOL, rtol=0)
        theirs = hf.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(cached, theirs)


def test_jamba_refusals_name_the_field(tmp_path):
    hf = jamba_model(attn_layer_period=2, attn_layer_offset=1, num_key_value_heads=2)
    hf.save_pretrained(tmp_path / "j")
    cfg = json.loads((tmp_path / "j" / "config.json").read_text())
    for change, field in [
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts": None}, "num_experts"),
        ({"hidden_act": "gelu2"}, "hidden_act"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"attn_layer_offset": 2}, "attn_layer_offset"),
    ]:
        (tmp_path / "j" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CheckpointError, match=f"'{field}'"):
            ssmkit.from_pretrained(tmp_path / "j")
    moe = {k: v for k, v in cfg.items() if k != "num_experts"}  # JambaConfig's default: 16 experts
    (tmp_path / "j" / "config.json").write_text(json.dumps(moe))
    with pytest.raises(CheckpointError, match=r"missing weights .*layers\.1\.mlp\.experts"):
        ssmkit.from_pretrained(tmp_path / "j")  # the config's experts, a dense model's weights
    (tmp_path / "j" / "config.json").write_text(json.dumps(cfg))
    model = ssmkit.from_pretrained(tmp_path / "j")

    def refused(pattern, **change):
        bad = ssmkit.build_model(ModelConfig.from_dict({**model.config.to_dict(), **change}))
        with pytest.raises(CheckpointError, match=pattern):
            bad.save_pretrained(tmp_path / "x", format="jamba")

    attn = model.config.attn_cfg
    refused(r"attn_cfg\.rotary_emb_dim", attn_cfg={**attn, "rotary_emb_dim": 4})
    refused(r"attn_cfg\.qkv_proj_bias", attn_cfg={**attn, "qkv_proj_bias": True})
    refused("window_size", attn_cfg={**attn, "window_size": 4})
    refused("intermediate_size", d_intermediate=0)
    refused("mixer_rms_weights", mixer_rms_weights=False)
    refused("rms_norm_eps", norm_epsilon=1e-5)
    refused(
        "mamba2",
        layout=["mamba2", "attn", "mamba2", "attn"],
        attn_every=0,
        attn_layer_idx=None,
        headdim=16,
    )
    refused(
        r"attn_layer_idx \[0, 1\] is not periodic",
        attn_every=0,
        attn_offset=0,
        attn_layer_idx=[0, 1],
    )
    assert not (tmp_path / "x").exists()


# --- Zamba2: the same dispatch, to ssmkit/hub/zamba2.py -------------------------------------------


def test_zamba2_dispatches_by_model_type_and_format(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = perturb_(
            Zamba2ForCausalLM(
                Zamba2Config(
                    vocab_size=64,
                    hidden_size=32,
                    num_hidden_layers=3,
                    mamba_d_state=8,
                    n_mamba_heads=4,
                    num_attention_heads=4,
                    chunk_size=16,
                    intermediate_size=48,
                    adapter_rank=4,
                    layers_block_type=["mamba", "hybrid", "mamba"],
                )
            ),
            1,
        ).eval()
    hf.save_pretrained(tmp_path / "z")
    model = ssmkit.from_pretrained(tmp_path / "z").eval()
    ids = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model(ids).logits, want, atol=ATOL, rtol=0)
        model.save_pretrained(tmp_path / "back", format="zamba2")
        again = Zamba2ForCausalLM.from_pretrained(tmp_path / "back").eval()
        torch.testing.assert_close(again(ids).logits, want, atol=ATOL, rtol=0)
    for fmt in ("hf", "mamba_ssm", "jamba"):
        with pytest.raises(CheckpointError, match="format='zamba2'"):
            model.save_pretrained(tmp_path / "x", format=fmt)
