"""Activations other than SiLU in checkpoints (ssmkit.ops.ACTIVATIONS, transformers' names).

Oracles: transformers' JambaForCausalLM, whose ``hidden_act`` drives its MLPs, its experts and its
Mamba conv (the scan's gate stays SiLU), and MambaForCausalLM / FalconMambaForCausalLM, whose
``hidden_act`` is the conv's. Tiny fp32 models built here (no hub), weights moved off their init;
logits within 1e-5. mamba_ssm's layout (no activation fields of its own) round-trips them through
ssmkit's keys.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import perturb_
from transformers import (
    FalconMambaConfig,
    FalconMambaForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
)

import ssmkit
from ssmkit import CheckpointError
from ssmkit.models import ModelConfig

ATOL = 1e-5
JAMBA = (
    dict(  # attention on layer 1, experts on layers 1 and 3, an MLP 64 wide (ssmkit pads to 128)
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=3,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        attn_implementation="eager",
    )
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is fastest on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def jamba(hidden_act: str) -> JambaForCausalLM:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = JambaForCausalLM(JambaConfig(**JAMBA, hidden_act=hidden_act))
    return perturb_(model, 3).eval()


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "silu", "gelu_pytorch_tanh"])
def test_jamba_with_each_activation_loads_and_saves_with_transformers_logits(tmp_path, act):
    hf = jamba(act)
    hf.save_pretrained(tmp_path / "hf")
    model = ssmkit.from_pretrained(tmp_path / "hf").eval()
    assert model.config.mlp_activation == act and model.config.mamba1.activation == act
    x = ids()
    with torch.no_grad():
        want = hf(x, use_cache=False).logits
        got = model(x).logits
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, f"{act}: max |logits diff| {diff:.2e}"
    model.save_pretrained(tmp_path / "back", format="jamba")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["hidden_act"] == act
    again = JambaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x, use_cache=False).logits, want, rtol=0, atol=ATOL)


def test_the_activation_matters_and_the_cached_step_applies_it_too(tmp_path):
    """gelu's logits are not silu's (the table is read); one cached token at a time gives the full
    forward's logits (the conv's one-step form takes the activation as well)."""
    hf = jamba("gelu")
    hf.save_pretrained(tmp_path / "hf")
    model = ssmkit.from_pretrained(tmp_path / "hf").eval()
    x = ids(2)
    with torch.no_grad():
        full = model(x).logits
        cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "hidden_act": "silu"}))
        assert (ssmkit.from_pretrained(tmp_path / "hf")(x).logits - full).abs().max() > 1e-3
        cache = model.allocate_cache(2)
        steps = [model(x[:, :3], cache=cache).logits]
        steps += [model(x[:, t : t + 1], cache=cache).logits for t in range(3, x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=ATOL)


def test_an_unknown_or_learnable_activation_is_refused_with_the_valid_names(tmp_path):
    jamba("silu").save_pretrained(tmp_path / "j")
    cfg = json.loads((tmp_path / "j" / "config.json").read_text())
    for act, extra in (("gelu2", ""), ("prelu", "learnable parameters")):
        (tmp_path / "j" / "config.json").write_text(json.dumps({**cfg, "hidden_act": act}))
        with pytest.raises(
            CheckpointError,
            match=f"'hidden_act'.*must be one of: gelu, .*relu.*got '{act}'.*{extra}",
        ):
            ssmkit.from_pretrained(tmp_path / "j")
    two = ModelConfig(
        d_model=32,
        n_layer=2,
        vocab_size=50,
        d_intermediate=64,
        attn_every=2,
        attn_offset=1,
        attn_cfg=dict(num_heads=4),
        rms_norm=True,
        norm_epsilon=1e-6,
        mlp_activation="gelu",
        mamba1=dict(mixer_rms_eps=1e-6, mixer_rms_weights=True),  # the conv keeps silu
    )
    with pytest.raises(CheckpointError, match="hidden_act: Jamba has one activation"):
        ssmkit.build_model(two).save_pretrained(tmp_path / "two", format="jamba")


@pytest.mark.parametrize("kind", ["mamba", "falcon_mamba"])
def test_transformers_mamba_with_another_conv_activation_loads_and_saves(tmp_path, kind):
    torch.manual_seed(0)
    size = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, state_size=8, hidden_act="gelu")
    hf = (
        MambaForCausalLM(MambaConfig(**size))
        if kind == "mamba"
        else FalconMambaForCausalLM(FalconMambaConfig(**size, mixer_rms_eps=1e-5))
    )
    hf = perturb_(hf, 4).eval()
    hf.save_pretrained(tmp_path / "hf")
    model = ssmkit.from_pretrained(tmp_path / "hf").eval()
    assert model.config.mamba1.activation == "gelu"
    x = ids(3)
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(model(x).logits, want, rtol=0, atol=ATOL)
    model.save_pretrained(tmp_path / "back", format="hf")
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["hidden_act"] == "gelu" and saved["model_type"] == kind
    with pytest.raises(CheckpointError, match="hidden_act 'gelu' is not supported for mamba2"):
        cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba2"}))
        ssmkit.from_pretrained(tmp_path / "hf")


def test_mamba_ssm_layout_round_trips_the_activations_in_ssmkit_s_own_keys(tmp_path):
    """mamba_ssm's MambaConfig and Mamba have no activation arguments: ssmkit writes its keys only
    when they differ from SiLU (so mamba_ssm refuses them by name), and reads them back."""
    cfg = ModelConfig(
        d_model=32,
        n_layer=2,
        vocab_size=50,
        d_intermediate=64,
        attn_layer_idx=[1],
        attn_cfg=dict(num_heads=4),
        mlp_activation="relu2",
        mamba1=dict(activation="gelu_new"),
    )
    torch.manual_seed(0)
    model = perturb_(ssmkit.build_model(cfg), 5).eval()
    model.save_pretrained(tmp_path / "ms", format="mamba_ssm")
    written = json.loads((tmp_path / "ms" / "config.json").read_text())
    assert written["mlp_activation"] == "relu2" and written["ssm_cfg"]["activation"] == "gelu_new"
    back = ssmkit.from_pretrained(tmp_path / "ms").eval()
    assert back.config.mlp_activation == "relu2" and back.config.mamba1.activation == "gelu_new"
    with torch.no_grad():
        torch.testing.assert_close(back(ids()).logits, model(ids()).logits, rtol=0, atol=0)
    plain = ssmkit.build_model(ModelConfig(d_model=32, n_layer=1, vocab_size=50))
    plain.save_pretrained(tmp_path / "plain", format="mamba_ssm")
    written = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "mlp_activation" not in written and "activation" not in written["ssm_cfg"]
