"""Mamba-3 checkpoints in mamba_ssm's layout, ``ssm_cfg = {"layer": "Mamba3", ...}``: read, written
exactly.

Oracles: a checkpoint written from mamba_ssm's documented names, shapes and defaults
(``modules/mamba3.py``, ``models/config_mamba.py``), not from ssmkit; the round trip (bit-equal
tensors, equal config, equal logits).
"""

from __future__ import annotations

import json

import pytest
import torch
from fake_checkpoints import write_mamba_ssm_checkpoint
from helpers import MAMBA_SSM_CONFIG_FIELDS, perturb_

import ssmkit
from ssmkit import CheckpointError
from ssmkit.models import ModelConfig

# mamba_ssm's Mamba3.__init__ arguments (modules/mamba3.py at the commit that lets MambaLMHeadModel
# build it)
MAMBA3_ARGS = {
    "d_model",
    "d_state",
    "expand",
    "headdim",
    "ngroups",
    "rope_fraction",
    "dt_min",
    "dt_max",
    "dt_init_floor",
    "A_floor",
    "is_outproj_norm",
    "is_mimo",
    "mimo_rank",
    "fuse_pregate_headwise_norm",
    "chunk_size",
    "dropout",
    "layer_idx",
    "n_layer",
    "device",
    "dtype",
}

CASES = {
    "siso": dict(),
    "mimo-norm-full-rope-softplus": dict(
        is_mimo=True,
        mimo_rank=2,
        is_outproj_norm=True,
        rope_fraction=1.0,
        a_activation="softplus",
        ngroups=2,
    ),
    # mamba_ssm's hybrid fields: GatedMLP blocks (d_intermediate) and MHA layers
    "mlp-attention": dict(
        d_intermediate=96, attn_layer_idx=[1], attn_cfg=dict(num_heads=2, causal=True)
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_is_exact(tmp_path, case, tie):
    torch.manual_seed(0)
    cfg = ModelConfig.preset(
        "tiny-mamba3", n_layer=3, vocab_size=250, tie_embeddings=tie, **CASES[case]
    )
    model = perturb_(ssmkit.build_model(cfg), 4).eval()
    out = model.save_pretrained(tmp_path / "ms")  # Mamba-3's natural format is mamba_ssm's
    config = json.loads((out / "config.json").read_text())
    assert set(config) == MAMBA_SSM_CONFIG_FIELDS
    assert config["ssm_cfg"]["layer"] == "Mamba3"
    assert (
        set(config["ssm_cfg"]) - {"layer", "a_activation"} <= MAMBA3_ARGS
    )  # Mamba3(**ssm_cfg) takes them
    assert (config["d_intermediate"], config["attn_layer_idx"]) == (
        cfg.d_intermediate,
        cfg.attn_layer_idx,
    )
    back = ssmkit.from_pretrained(out)
    assert back.config == model.config
    mine, theirs = model.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.randint(0, 250, (2, 13))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    "ssm_cfg, d_intermediate",
    [
        ({"d_state": 16, "headdim": 16}, 0),
        (
            {
                "d_state": 16,
                "headdim": 16,
                "is_mimo": True,
                "mimo_rank": 2,
                "is_outproj_norm": True,
                "ngroups": 2,
                "rope_fraction": 1.0,
                "fuse_pregate_headwise_norm": True,
                "chunk_size": 16,
            },
            0,
        ),
        (
            {"d_state": 16, "headdim": 16, "is_mimo": True, "chunk_size": 16},
            100,
        ),  # MLPs, rank 4 by default
    ],
)
def test_mamba_ssm_checkpoint_loads_with_its_defaults(tmp_path, ssm_cfg, d_intermediate):
    state = write_mamba_ssm_checkpoint(
        tmp_path / "ms",
        {"layer": "Mamba3", **ssm_cfg},
        pad_vocab_size_multiple=16,
        d_intermediate=d_intermediate,
    )
    model = ssmkit.from_pretrained(tmp_path / "ms")
    assert model.config.mixers == ["mamba3", "mamba3"]
    assert model.config.d_intermediate == d_intermediate
    cfg = model.config.mamba3
    # what the file leaves out takes mamba_ssm's Mamba3 defaults
    assert cfg.chunk_size == ssm_cfg.get("chunk_size", 64)
    assert cfg.rope_fraction == ssm_cfg.get("rope_fraction", 0.5)
    assert (cfg.expand, cfg.A_floor, cfg.dt_min, cfg.dt_max) == (2, 1e-4, 1e-3, 0.1)
    assert cfg.a_activation == "heavy_tail"
    assert cfg.mimo_rank == ssm_cfg.get("mimo_rank", 4)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert torch.isfinite(model(torch.randint(0, 50, (1, 12))).logits).all()


def test_defaults_of_a_bare_mamba3_config(tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"d_model": 64, "n_layer": 1, "vocab_size": 10, "ssm_cfg": {"layer": "Mamba3"}})
    )
    from ssmkit.hub import config_from_mamba_ssm

    cfg = config_from_mamba_ssm(json.loads((folder / "config.json").read_text())).mamba3
    got = (
        cfg.d_state,
        cfg.headdim,
        cfg.ngroups,
        cfg.chunk_size,
        cfg.rope_fraction,
        cfg.is_mimo,
        cfg.mimo_rank,
        cfg.is_outproj_norm,
        cfg.dt_init_floor,
    )
    assert got == (128, 64, 1, 64, 0.5, False, 4, False, 1e-4)


def test_bf16_model_saves_its_small_parameters_in_fp32(tmp_path):
    cfg = ModelConfig.preset("tiny-mamba3", is_mimo=True, mimo_rank=2)
    model = ssmkit.build_model(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ms")
    state = torch.load(tmp_path / "ms" / "pytorch_model.bin", weights_only=True)
    dtypes = {
        k.rsplit(".", 1)[-1] if "norm" not in k else "norm": v.dtype
        for k, v in state.items()
        if ".mixer." in k
    }
    kept = {k for k, v in dtypes.items() if v == torch.float32}
    assert kept == {"dt_bias", "B_bias", "C_bias", "D", "mimo_x", "mimo_z", "mimo_o"}
    back = ssmkit.from_pretrained(tmp_path / "ms", dtype="bf16")
    assert back.backbone.layers[0].mixer.B_bias.dtype == torch.float32
    assert back.backbone.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    mine, theirs = model.state_dict(), back.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_what_cannot_be_represented_is_named(tmp_path):
    model = ssmkit.build_model("tiny-mamba3")
    with pytest.raises(
        CheckpointError, match="transformers has no Mamba-3 model; save format='mamba_ssm'"
    ):
        model.save_pretrained(tmp_path / "hf", format="hf")
    with pytest.raises(CheckpointError, match="mixer 'mamba3': Jamba's Mamba layers are Mamba-1"):
        model.save_pretrained(tmp_path / "jamba", format="jamba")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "jamba").exists()
    mixed = ssmkit.build_model(
        ModelConfig(
            d_model=32,
            n_layer=2,
            vocab_size=64,
            layout=["mamba2", "mamba3"],
            d_state=16,
            headdim=16,
        )
    )
    with pytest.raises(CheckpointError, match="one SSM layer type"):
        mixed.save_pretrained(tmp_path / "mixed", format="mamba_ssm")
    for ssm_cfg, message in [
        ({"use_rope": False}, r"ssm_cfg fields \['use_rope'\] cannot be represented"),
        ({"rope_fraction": 0.25}, "field 'ssm_cfg.rope_fraction'.*one of 0.5, 1.0"),
        (
            {"layer": "Mamba4"},
            "ssm_cfg.layer 'Mamba4' is not supported; valid: Mamba1, Mamba2, Mamba3",
        ),
    ]:
        folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "d_model": 32,
                    "n_layer": 1,
                    "vocab_size": 10,
                    "ssm_cfg": {"layer": "Mamba3", **ssm_cfg},
                }
            )
        )
        with pytest.raises(CheckpointError, match=message):
            ssmkit.from_pretrained(folder)
