"""Checkpoint interop: transformers' own Mamba / Mamba2 models and mamba_ssm's layout as oracles."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from fake_checkpoints import write_mamba_ssm_checkpoint
from helpers import MAMBA_SSM_CONFIG_FIELDS, perturb_
from transformers import (
    AutoModelForCausalLM,
    FalconMambaConfig,
    FalconMambaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
)

import ssmkit
from ssmkit import CheckpointError
from ssmkit.models import ModelConfig

ATOL = 1e-4


HF_CASES = {
    "mamba-tied": lambda: MambaForCausalLM(
        MambaConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            state_size=8,
            expand=2,
            time_step_rank=3,
        )
    ),
    "mamba-untied-d16": lambda: MambaForCausalLM(
        MambaConfig(
            vocab_size=96,
            hidden_size=24,
            num_hidden_layers=3,
            state_size=16,
            expand=3,
            conv_kernel=3,
            tie_word_embeddings=False,
        )
    ),
    "falcon-mamba": lambda: FalconMambaForCausalLM(
        FalconMambaConfig(
            vocab_size=80, hidden_size=32, num_hidden_layers=2, state_size=8, mixer_rms_eps=1e-5
        )
    ),
    "mamba2-groups": lambda: Mamba2ForCausalLM(
        Mamba2Config(
            vocab_size=101,
            hidden_size=32,
            num_hidden_layers=2,
            state_size=16,
            head_dim=16,
            num_heads=4,
            n_groups=2,
            chunk_size=8,
        )
    ),
    "mamba2-tied-limit": lambda: Mamba2ForCausalLM(
        Mamba2Config(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            state_size=8,
            head_dim=8,
            num_heads=8,
            n_groups=1,
            chunk_size=5,
            tie_word_embeddings=True,
            time_step_limit=(0.01, 0.2),
        )
    ),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_transformers_checkpoints_load_with_equal_logits_and_generations(tmp_path, name):
    torch.manual_seed(0)
    hf = perturb_(HF_CASES[name](), 1).eval()
    hf.save_pretrained(tmp_path / "ckpt")
    model = ssmkit.from_pretrained(tmp_path / "ckpt").eval()
    ids = torch.randint(
        0, hf.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)
    ours = ssmkit.generate(model, ids[:, :6], max_new_tokens=10, temperature=0)
    assert torch.equal(ours, hf_greedy(hf, ids[:, :6], 10))


@torch.no_grad()
def hf_greedy(hf, ids, n):
    """Greedy decoding with transformers' full forward at every step. (Its cached `generate` is not
    the oracle: in transformers 5.24, Mamba2 with n_groups > 1 decodes differently from its own
    full forward, while ssmkit's cached and full paths agree with that full forward.)"""
    for _ in range(n):
        ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_falcon_mamba_round_trip_and_no_mamba_ssm_layout(tmp_path):
    hf = perturb_(HF_CASES["falcon-mamba"](), 6).eval()
    hf.save_pretrained(tmp_path / "src")
    model = ssmkit.from_pretrained(tmp_path / "src")
    assert model.config.mamba1.mixer_rms_eps == 1e-5
    model.save_pretrained(tmp_path / "dst")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert type(back).__name__ == "FalconMambaForCausalLM"
    ids = torch.randint(0, 80, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)
    with pytest.raises(CheckpointError, match="mixer_rms_eps"):
        model.save_pretrained(tmp_path / "ms", format="mamba_ssm")


def test_sharded_and_bin_checkpoints(tmp_path):
    hf = perturb_(HF_CASES["mamba-untied-d16"](), 3).eval()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    hf.config.save_pretrained(tmp_path / "bin")  # transformers 5 writes only safetensors:
    torch.save(
        hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin"
    )  # the .bin layout of older ones
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert (tmp_path / "bin" / "pytorch_model.bin").exists()
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        want = hf(ids).logits
        for sub in ("sharded", "bin"):
            torch.testing.assert_close(
                ssmkit.from_pretrained(tmp_path / sub)(ids).logits, want, atol=ATOL, rtol=0
            )


def test_bin_shards_dtype_and_unrepresentable_fields(tmp_path):
    hf = perturb_(HF_CASES["mamba-tied"](), 7).eval()
    folder = tmp_path / "bin-shards"
    hf.config.save_pretrained(folder)
    state = hf.state_dict()
    names = sorted(state)
    shards = {
        "pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
        "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, folder / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    model = ssmkit.from_pretrained(folder, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.backbone.embedding.weight
    ids = torch.randint(0, 100, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits.float(), hf(ids).logits, atol=0.1, rtol=0.05
        )  # bf16
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu2"}))
    with pytest.raises(CheckpointError, match="'hidden_act'.* must be one of: gelu, .*'gelu2'"):
        ssmkit.from_pretrained(folder)
    write_mamba_ssm_fixture(tmp_path / "ms", "Mamba2")
    ms_cfg = json.loads((tmp_path / "ms" / "config.json").read_text())
    ms_cfg["ssm_cfg"]["mystery_knob"] = 3
    (tmp_path / "ms" / "config.json").write_text(json.dumps(ms_cfg))
    with pytest.raises(
        CheckpointError, match=r"ssm_cfg fields \['mystery_knob'\] cannot be represented"
    ):
        ssmkit.from_pretrained(tmp_path / "ms")
    ms_cfg["ssm_cfg"].pop("mystery_knob")
    (tmp_path / "ms" / "config.json").write_text(json.dumps({**ms_cfg, "attn_layer_idx": [1]}))
    with pytest.raises(CheckpointError, match=r"'attn_cfg\.causal' is missing"):
        ssmkit.from_pretrained(tmp_path / "ms")


def test_convert_offers_every_format():
    from ssmkit.cli import CONVERT_FORMATS
    from ssmkit.hub.layouts import FORMATS

    assert CONVERT_FORMATS == list(FORMATS)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mamba2"])
@pytest.mark.parametrize("tie", [True, False])
def test_ssmkit_to_transformers_and_mamba_ssm_round_trips(tmp_path, preset, tie):
    torch.manual_seed(0)
    model = perturb_(
        ssmkit.build_model(
            ModelConfig.preset(preset, n_layer=2, vocab_size=250, tie_embeddings=tie)
        ),
        4,
    )
    model.eval()
    ids = torch.randint(0, 250, (2, 17))
    out = model.save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, atol=ATOL, rtol=0)
    model.save_pretrained(tmp_path / "ms", format="mamba_ssm")
    assert set(json.loads((tmp_path / "ms" / "config.json").read_text())) == MAMBA_SSM_CONFIG_FIELDS
    back = ssmkit.from_pretrained(tmp_path / "ms")
    assert back.config == model.config
    mine, theirs = model.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    again = ssmkit.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(
            again(ids).logits[..., :250], model(ids).logits[..., :250], atol=0, rtol=0
        )


def write_mamba_ssm_fixture(folder, layer):
    """A tiny Mamba1 or Mamba2 checkpoint in mamba_ssm's layout (tests/fake_checkpoints.py)."""
    cfg = {"layer": layer, "d_state": 8}
    if layer == "Mamba2":
        cfg.update(headdim=16, ngroups=2, chunk_size=8)
    return write_mamba_ssm_checkpoint(folder, cfg)


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_mamba_ssm_layout_fixture_loads(tmp_path, layer):
    state = write_mamba_ssm_fixture(tmp_path / "ms", layer)
    model = ssmkit.from_pretrained(tmp_path / "ms")
    assert model.config.mixer == layer.lower() and model.config.padded_vocab_size == 56
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert model.lm_head.weight is model.backbone.embedding.weight
    ids = torch.randint(0, 50, (1, 12))
    assert torch.isfinite(model(ids).logits).all()


def test_tokenizer_files_travel_along(tmp_path):
    write_mamba_ssm_fixture(tmp_path / "src", "Mamba1")
    (tmp_path / "src" / "tokenizer.json").write_text('{"fake": true}')
    ssmkit.from_pretrained(tmp_path / "src").save_pretrained(tmp_path / "dst")
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == '{"fake": true}'


def test_errors_are_clear_and_nothing_is_half_written(tmp_path, monkeypatch):
    hf = HF_CASES["mamba-tied"]()
    hf.save_pretrained(tmp_path / "good")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    blob = (tmp_path / "good" / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        ssmkit.from_pretrained(bad)
    cfg = json.loads((tmp_path / "good" / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        ssmkit.from_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "state_size": 4}))
    (bad / "model.safetensors").write_bytes(blob)
    with pytest.raises(
        CheckpointError, match=r"A_log has shape \(64, 8\), the config implies \(64, 4\)"
    ):
        ssmkit.from_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="'num_hidden_layers' declares 3 layers, but the"):
        ssmkit.from_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(CheckpointError, match="unknown layout"):
        ssmkit.from_pretrained(bad)
    with pytest.raises(CheckpointError, match="pass a local directory"):
        ssmkit.from_pretrained("state-spaces/this-model-is-not-cached")
    with pytest.raises(CheckpointError, match="neither a checkpoint directory"):
        ssmkit.from_pretrained(tmp_path / "missing")
    # a crash while writing leaves the previous checkpoint whole and no temporary directory behind
    model = ssmkit.from_pretrained(tmp_path / "good")
    model.save_pretrained(tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(tmp_path / "out")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "good", "out"]
    with pytest.raises(ValueError, match="valid formats: hf, mamba_ssm"):
        model.save_pretrained(tmp_path / "x", format="gguf")


def test_convert_command(tmp_path):
    HF_CASES["mamba2-groups"]().save_pretrained(tmp_path / "hf")

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "ssmkit.cli", *a], capture_output=True, text=True
        )

    ok = run("convert", str(tmp_path / "hf"), str(tmp_path / "ms"), "--to", "mamba_ssm")
    assert ok.returncode == 0 and "mamba_ssm layout" in ok.stdout, ok.stderr
    assert json.loads((tmp_path / "ms" / "config.json").read_text())["ssm_cfg"]["layer"] == "Mamba2"
    bad = run("convert", str(tmp_path / "nothing"), str(tmp_path / "x"), "--to", "hf")
    assert bad.returncode == 1
    assert "nothing: no such directory; expected a model directory" in bad.stderr
