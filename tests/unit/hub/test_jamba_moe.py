"""transformers' Jamba with experts (JambaSparseMoeBlock) <-> ssmkit: logits, greedy generation and
the router's aux loss against JambaForCausalLM; both layouts of the expert weights (one tensor per
expert on disk, transformers 5's fused tensors in memory); ssmkit -> format "jamba" -> transformers
and back; what only format "jamba" can hold."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import perturb_
from transformers import JambaConfig, JambaForCausalLM

import ssmkit
from ssmkit import CheckpointError
from ssmkit.hub.jamba import config_from_jamba, state_from_jamba
from ssmkit.models import ModelConfig, SparseMoE

ATOL = 1e-4
BASE = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,  # ssmkit's experts are 128 wide, the extra units zero
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    router_aux_loss_coef=0.02,
    mamba_d_state=8,
    attn_implementation="eager",
)
CASES = {  # Jamba's attention rule; experts on attention as well as on Mamba layers
    "attn-period4-offset2": dict(attn_layer_period=4, attn_layer_offset=2),
    "experts-every-layer-top1-tied": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=3,
        num_experts_per_tok=1,
        expert_layer_period=1,
        expert_layer_offset=0,
        tie_word_embeddings=True,
    ),
}


def jamba(**kw) -> JambaForCausalLM:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = JambaForCausalLM(JambaConfig(**{**BASE, **kw}))
    return perturb_(model, 2).eval()


@pytest.mark.parametrize("name", list(CASES))
def test_jamba_experts_load_with_transformers_logits_generation_and_aux_loss(tmp_path, name):
    hf = jamba(**CASES[name])
    hf.save_pretrained(tmp_path / "hf")
    model = ssmkit.from_pretrained(tmp_path / "hf").eval()
    c = hf.config
    experts = [i for i, n in enumerate(c.layers_num_experts) if n > 1]
    assert model.config.moe_layers == experts
    assert all(isinstance(model.backbone.layers[i].mlp, SparseMoE) for i in experts)
    ids = torch.randint(0, 100, (2, 11))
    with torch.no_grad():
        want = hf(ids, labels=ids, output_router_logits=True, use_cache=False)
        got = model(ids, labels=ids, output_router_logits=True)
    diff = (got.logits - want.logits).abs().max().item()
    assert diff <= ATOL, f"max |logits diff| {diff:.2e}"
    torch.testing.assert_close(got.aux_loss, want.aux_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=0)  # CE + coef · aux
    for ours, theirs in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    prompt = torch.randint(1, 100, (2, 4))
    ours = ssmkit.generate(model, prompt, max_new_tokens=5, temperature=0)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(ours, theirs)


def test_fused_expert_tensors_load_too():
    """transformers 5 holds the experts fused in memory (experts.gate_up_proj (E, 2h, d), gate
    first; experts.down_proj (E, d, h)); its save writes one tensor per expert. Both load."""
    hf = jamba(**CASES["attn-period4-offset2"])
    state = hf.state_dict()
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in state
    cfg = config_from_jamba(hf.config.to_dict())
    model = ssmkit.build_model(cfg).eval()
    model.load_state_dict(state_from_jamba(state, cfg))
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(ids, use_cache=False).logits, atol=ATOL, rtol=0
        )
    bad = dict(state)
    bad["model.layers.1.feed_forward.experts.down_proj"] = state[
        "model.layers.1.feed_forward.experts.down_proj"
    ][:3]
    with pytest.raises(CheckpointError, match=r"experts\.down_proj has shape \(3, 32, 64\)"):
        state_from_jamba(bad, cfg)


def jamba_like(**kw) -> ModelConfig:
    """An ssmkit model Jamba's format holds: Mamba-1 with Δ/B/C norms, one epsilon, no biases."""
    return ModelConfig(
        **{
            "d_model": 48,
            "n_layer": 4,
            "vocab_size": 90,
            "mixer": "mamba1",
            "d_state": 8,
            "attn_every": 4,
            "attn_offset": 2,
            "attn_cfg": dict(num_heads=4, qkv_proj_bias=False, out_proj_bias=False),
            "d_intermediate": 128,
            "mixer_rms_eps": 1e-6,
            "mixer_rms_weights": True,
            "norm_epsilon": 1e-6,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.01,
            **kw,
        }
    )


def test_ssmkit_experts_save_as_jamba_and_come_back(tmp_path):
    model = perturb_(ssmkit.build_model(jamba_like(), seed=0), 3).eval()
    model.save_pretrained(tmp_path / "j")  # experts: the natural format is Jamba's
    written = json.loads((tmp_path / "j" / "config.json").read_text())
    assert written["model_type"] == "jamba"
    assert [written[k] for k in ("num_experts", "num_experts_per_tok")] == [4, 2]
    assert [written[k] for k in ("expert_layer_period", "expert_layer_offset")] == [2, 1]
    hf = JambaForCausalLM.from_pretrained(tmp_path / "j").eval()
    assert hf.config.layers_num_experts == [1, 4, 1, 4]
    ids = torch.randint(0, 90, (2, 12))
    with torch.no_grad():
        want = model(ids, labels=ids)
        theirs = hf(ids, labels=ids, output_router_logits=True, use_cache=False)
    torch.testing.assert_close(theirs.logits, want.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(theirs.aux_loss, want.aux_loss, atol=1e-6, rtol=0)
    again = ssmkit.from_pretrained(tmp_path / "j")
    mine, back = model.state_dict(), again.state_dict()
    assert mine.keys() == back.keys() and all(torch.equal(mine[k], back[k]) for k in mine)
    assert again.config.router_aux_loss_coef == 0.01


def test_only_the_jamba_format_holds_experts(tmp_path):
    model = ssmkit.build_model(jamba_like())
    with pytest.raises(CheckpointError, match=r"num_experts=4 .* save format='jamba'"):
        model.save_pretrained(tmp_path / "x", format="mamba_ssm")
    with pytest.raises(CheckpointError, match="MLPs"):
        model.save_pretrained(tmp_path / "x", format="hf")
    plain = ssmkit.build_model(jamba_like(mixer_rms_eps=None, mixer_rms_weights=False))
    with pytest.raises(CheckpointError, match="mixer_rms_weights is false"):
        plain.save_pretrained(tmp_path / "x")  # natural format jamba: says what it lacks
    assert not (tmp_path / "x").exists()


def test_expert_config_errors_name_the_field(tmp_path):
    hf = jamba(**CASES["attn-period4-offset2"])
    hf.save_pretrained(tmp_path / "j")
    cfg = json.loads((tmp_path / "j" / "config.json").read_text())
    for change, field in [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"expert_layer_offset": 2}, "expert_layer_offset"),
        ({"num_experts": None}, "num_experts"),
    ]:
        (tmp_path / "j" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CheckpointError, match=f"'{field}'"):
            ssmkit.from_pretrained(tmp_path / "j")
    (tmp_path / "j" / "config.json").write_text(json.dumps({**cfg, "num_experts": 1}))
    with pytest.raises(CheckpointError, match=r"unexpected weights .*mlp\.experts"):
        ssmkit.from_pretrained(tmp_path / "j")  # dense config, expert weights


def test_a_config_declaring_more_experts_than_the_weights_hold_is_refused_at_once(tmp_path):
    """A valid layer count but 10**6 experts: building them even on the meta device took hours."""
    import time

    ssmkit.build_model(jamba_like(), seed=0).save_pretrained(tmp_path / "j")
    ssmkit.from_pretrained(tmp_path / "j")  # imports warm: the 2 s below time the check
    cfg = json.loads((tmp_path / "j" / "config.json").read_text())
    (tmp_path / "j" / "config.json").write_text(json.dumps({**cfg, "num_experts": 1_000_000}))
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="'num_experts' declares 1,000,000 experts, but the"):
        ssmkit.from_pretrained(tmp_path / "j")
    assert time.monotonic() - start < 2
