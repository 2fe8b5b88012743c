"""ModelConfig's mixer groups: defaults, checks, the short (flat) form and its migration, presets,
YAML / dict round trips, and with_mixer, the rule for "the same model with another mixer".

Oracles: mamba_ssm's constructor defaults (written out below), the grouped form against the flat
one, and tests/data/compare-rule-configs.json, made with the flat-config ssmkit (its script beside
it): notebook 01's comparison rule applied to the CPU models, each result's flat config, parameter
count and seeded initialisation (sum and sum of squares of every parameter).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import yaml
from helpers import ROOT

import ssmkit
from ssmkit.models import SSM_MIXERS, ConfigError, ModelConfig
from ssmkit.models.config import PRESETS, migrate_flat
from ssmkit.models.ssm_config import Mamba1Config, Mamba2Config, Mamba3Config

COMPARE_RULE = ROOT / "tests" / "data" / "compare-rule-configs.json"


# --- the groups -------------------------------------------------------------------------------


def test_groups_hold_mamba_ssm_defaults():
    """Defaults of mamba_ssm's Mamba / Mamba2 / Mamba3 constructors (Mamba3's chunk is filled in by
    ModelConfig: 64 alone)."""
    assert dataclasses.asdict(Mamba1Config()) == dict(
        d_state=16,
        d_conv=4,
        expand=2,
        dt_rank="auto",
        dt_min=0.001,
        dt_max=0.1,
        dt_init="random",
        dt_scale=1.0,
        dt_init_floor=1e-4,
        conv_bias=True,
        bias=False,
        mixer_rms_eps=None,
        mixer_rms_weights=False,
        activation="silu",  # Mamba.activation, after the conv
    )
    assert dataclasses.asdict(Mamba2Config()) == dict(
        d_state=128,
        d_conv=4,
        expand=2,
        headdim=64,
        ngroups=1,
        chunk_size=256,
        A_init_range=(1.0, 16.0),
        dt_min=0.001,
        dt_max=0.1,
        dt_init_floor=1e-4,
        dt_limit=(0.0, math.inf),
        conv_bias=True,
        bias=False,
        D_has_hdim=False,
        norm_before_gate=False,
    )
    assert dataclasses.asdict(Mamba3Config()) == dict(
        d_state=128,
        expand=2,
        headdim=64,
        ngroups=1,
        chunk_size=None,
        dt_min=0.001,
        dt_max=0.1,
        dt_init_floor=1e-4,
        rope_fraction=0.5,
        A_floor=1e-4,
        a_activation="heavy_tail",
        is_outproj_norm=False,
        is_mimo=False,
        mimo_rank=4,
    )
    cfg = ModelConfig(d_model=128, n_layer=2, vocab_size=100, mixer="mamba3")
    assert cfg.mamba3.chunk_size == 64 and cfg.mixer_cfg() is cfg.mamba3
    assert (cfg.mamba3.d_inner(128), cfg.mamba3.nheads(128)) == (256, 4)
    assert ModelConfig(d_model=100, n_layer=1, vocab_size=10).mamba1.dt_rank_value(100) == 7


def test_unknown_group_keys_list_the_groups_valid_keys():
    with pytest.raises(
        ConfigError,
        match=r"mamba3\.d_conv is not a mamba3 field .* valid keys of "
        r"mamba3: d_state, expand, headdim",
    ) as err:
        ModelConfig(mixer="mamba3", mamba3={"d_conv": 4})
    assert err.value.field == "mamba3.d_conv"
    with pytest.raises(
        ConfigError, match="mamba2 must be a Mamba2Config or a mapping of its fields; got int"
    ):
        ModelConfig(mamba2=3)
    with pytest.raises(
        ValueError,
        match=r"unknown ModelConfig keys \['d_modle'\]; valid keys: "
        r"d_model.*a field of the mixer groups: A_floor",
    ):
        ModelConfig.from_dict({"d_modle": 3})


def test_width_checks_name_the_group_field_only_for_mixers_in_use():
    with pytest.raises(
        ConfigError,
        match=r"^mamba2\.headdim must divide d_inner = expand \* "
        r"d_model = 80",
    ):
        ModelConfig(d_model=40, mixer="mamba2", mamba2={"headdim": 64})
    with pytest.raises(ConfigError, match=r"^mamba3\.ngroups must divide nheads"):
        ModelConfig(d_model=64, mixer="mamba3", mamba3={"headdim": 32, "ngroups": 3})
    ModelConfig(d_model=40, mixer="mamba1", mamba2={"headdim": 64})  # unused group: no width rule


# --- the short form and old configs -----------------------------------------------------------


def test_short_form_equals_the_grouped_form():
    """A group's field given flat sets it in the group of the model's mixer (as mamba_ssm users
    type it)."""
    base = dict(d_model=128, n_layer=4, vocab_size=1000)
    assert ModelConfig(**base, mixer="mamba2", d_state=64, headdim=32) == ModelConfig(
        **base, mixer="mamba2", mamba2=Mamba2Config(d_state=64, headdim=32)
    )
    assert ModelConfig(**base, mixer="mamba1") == ModelConfig(**base, mamba1={})
    assert ModelConfig(128, 4, 1000, 8, "mamba2", d_state=64).mamba2.d_state == 64  # positional
    with pytest.raises(TypeError, match="again as keywords"):
        ModelConfig(128, d_model=64)


def test_a_flat_field_sets_every_group_of_the_layout_as_one_field_did():
    cfg = ModelConfig(
        d_model=32,
        n_layer=3,
        vocab_size=50,
        layout=["mamba2", "mamba3", "mamba1"],
        d_state=8,
        headdim=16,
        chunk_size=16,
    )
    assert (cfg.mamba1.d_state, cfg.mamba2.d_state, cfg.mamba3.d_state) == (8, 8, 8)
    assert (cfg.mamba2.headdim, cfg.mamba3.headdim) == (16, 16)
    assert (cfg.mamba2.chunk_size, cfg.mamba3.chunk_size) == (16, 16)
    assert cfg.ssm_kinds == ["mamba1", "mamba2", "mamba3"]


def test_migration_rules():
    """Flat fields no mixer of the model takes have no effect (as before) but are still checked;
    bias with Mamba-3 is refused (as before); None d_state / chunk_size is the mixer's default; a
    flat field wins over the group's value (it comes later: a preset's groups, then a run's flat
    overrides)."""
    assert migrate_flat(
        {"mixer": "mamba1", "headdim": 32, "chunk_size": None, "d_state": None}
    ) == {"mixer": "mamba1"}
    assert ModelConfig(mixer="mamba1", headdim=32) == ModelConfig(mixer="mamba1")
    with pytest.raises(ConfigError, match=r"^headdim must be a positive integer; got 0") as err:
        ModelConfig(mixer="mamba1", headdim=0)
    assert err.value.field == "headdim"
    with pytest.raises(ConfigError, match="^bias must be false for mamba3"):
        ModelConfig(layout=["mamba1", "mamba3"], n_layer=2, d_model=64, headdim=16, bias=True)
    assert ModelConfig(mixer="mamba2", d_state=None).mamba2.d_state == 128
    assert ModelConfig(
        mixer="mamba2", mamba2={"d_state": 32, "headdim": 16}, d_state=64
    ).mamba2 == Mamba2Config(d_state=64, headdim=16)
    assert migrate_flat({"mixer": "attn", "d_state": 16}) == {"mixer": "attn"}


def test_mamba3_chunk_follows_mamba2_in_a_stack_with_both():
    """As before the groups: one chunk for a stack with Mamba-2 layers (256, or the one given),
    else 64."""
    both = dict(d_model=32, n_layer=2, vocab_size=64, layout=["mamba2", "mamba3"], headdim=16)
    assert ModelConfig(**both).mamba3.chunk_size == 256
    assert ModelConfig(**both, mamba2={"chunk_size": 32}).mamba3.chunk_size == 32
    assert ModelConfig(**both, mamba3={"chunk_size": 8}).mamba3.chunk_size == 8
    assert ModelConfig(**{**both, "layout": ["mamba3", "attn"]}).mamba3.chunk_size == 64


def test_mixer_cfg_needs_a_kind_when_the_layers_have_several():
    cfg = ModelConfig(d_model=32, n_layer=2, vocab_size=64, layout=["mamba1", "mamba2"], headdim=16)
    assert cfg.mixer_cfg("mamba2") is cfg.mamba2
    with pytest.raises(ValueError, match=r"SSM layers are \['mamba1', 'mamba2'\]: name the mixer"):
        cfg.mixer_cfg()
    with pytest.raises(ValueError, match="valid SSM mixers: mamba1, mamba2, mamba3"):
        cfg.mixer_cfg("attn")


# --- presets, YAML, round trips ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_dict_and_yaml(name):
    cfg = ModelConfig.preset(name)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert all(isinstance(cfg.to_dict()[kind], dict) for kind in SSM_MIXERS)


def test_a_group_override_merges_into_the_presets_group():
    cfg = ModelConfig.preset("tiny-mamba2", mamba2={"d_state": 64})
    assert (cfg.mamba2.d_state, cfg.mamba2.headdim, cfg.mamba2.chunk_size) == (64, 16, 64)
    assert ModelConfig.preset("tiny-mamba2", d_state=64) == cfg  # the short form


def test_set_of_a_nested_model_override(tmp_path):
    """``--set model_overrides.mamba2.d_state=64`` nests into model_overrides, beside the YAML's."""
    from ssmkit.train import TrainConfig

    path = tmp_path / "run.yaml"
    path.write_text(
        "model: tiny-mamba2\nmax_steps: 1\nmodel_overrides:\n  d_model: 32\n"
        "  mamba2:\n    headdim: 8\n"
    )
    cfg = TrainConfig.from_yaml(
        path, overrides=["model_overrides.mamba2.d_state=64", "model_overrides.n_layer=2"]
    )
    assert cfg.model_overrides == {
        "d_model": 32,
        "n_layer": 2,
        "mamba2": {"headdim": 8, "d_state": 64},
    }
    model = cfg.model_config(vocab_size=100)
    assert (model.n_layer, model.mamba2.d_state, model.mamba2.headdim, model.mamba2.chunk_size) == (
        2,
        64,
        8,
        64,
    )
    with pytest.raises(ValueError, match=r"model_overrides\.d_model\.x.*d_model is 32, not a "):
        TrainConfig.from_yaml(path, overrides=["model_overrides.d_model.x=1"])
    with pytest.raises(ValueError, match=r"mamba2\.d_sate is not a mamba2 field .*valid keys of"):
        typo = TrainConfig.from_yaml(path, overrides=["model_overrides.mamba2.d_sate=64"])
        typo.model_config(100)


# --- with_mixer: one rule for "the same model with another mixer" -----------------------------


def _used(cfg: ModelConfig) -> dict:
    """What a model is made of: the shared fields and the groups of the mixers its layers use."""
    d = cfg.to_dict()
    return {k: v for k, v in d.items() if k not in SSM_MIXERS or k in cfg.ssm_kinds}


def _source(name: str) -> ModelConfig:
    if name in PRESETS:
        return ModelConfig.preset(name, vocab_size=50257)
    run = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    return ModelConfig.preset(run["model"], vocab_size=50257, **run.get("model_overrides", {}))


def _init_stats(cfg: ModelConfig) -> tuple[int, float, float]:
    torch.manual_seed(0)
    model = ssmkit.build_model(cfg)
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    return model.num_parameters(), float(flat.sum()), float((flat**2).sum())


@pytest.mark.parametrize("key", list(json.loads(COMPARE_RULE.read_text())))
def test_with_mixer_gives_the_models_of_the_comparison_rule(key):
    """notebook 01's mixer comparison made with the flat-config ssmkit: the same configs (their
    flat form read by today's migration) and the same models, seed for seed."""
    old = json.loads(COMPARE_RULE.read_text())[key]
    name, mixer = key.split("/")
    new = _source(name).with_mixer(mixer)
    assert _used(new) == _used(ModelConfig.from_dict(old["config"]))
    params, total, squares = _init_stats(new)
    assert params == old["params"]
    assert total == pytest.approx(old["sum"], rel=1e-9, abs=1e-9)
    assert squares == pytest.approx(old["sum_sq"], rel=1e-9)


@pytest.mark.parametrize("d_model", [64, 128, 768])
def test_with_mixer_keeps_the_blocks_within_ten_percent(d_model):
    base = ModelConfig.preset("tiny-hybrid", d_model=d_model)
    sizes = {}
    for mixer in [
        m for m in SSM_MIXERS if m != "h3"
    ]:  # H3 is refused: tests/unit/models/test_h3.py
        cfg = base.with_mixer(mixer)
        assert cfg.mixers == [mixer, mixer, "attn", mixer] and cfg.attn_cfg == base.attn_cfg
        with torch.device("meta"):
            sizes[mixer] = ssmkit.build_model(cfg).num_parameters(exclude_embeddings=True)
    assert max(sizes.values()) < 1.1 * min(sizes.values()), sizes


def test_with_mixer_keeps_the_shared_knobs_and_swaps_a_layout():
    cfg = ModelConfig(
        d_model=64,
        n_layer=3,
        vocab_size=64,
        layout=["mamba2", "attn", "mamba2"],
        mamba2=dict(expand=4, ngroups=2, dt_max=0.2, headdim=16, d_state=8),
        attn_cfg=dict(num_heads=4),
    )
    m3 = cfg.with_mixer("mamba3")
    assert m3.layout == ["mamba3", "attn", "mamba3"]
    assert m3.mamba3 == Mamba3Config(
        expand=4, ngroups=2, dt_max=0.2, d_state=64, headdim=32, chunk_size=64
    )
    assert m3.mamba2 == cfg.mamba2 and m3.d_model == 64 and m3.attn_cfg == cfg.attn_cfg
    assert cfg.with_mixer("mamba1").mamba1 == Mamba1Config(expand=4, dt_max=0.2)


def test_with_mixer_errors():
    with pytest.raises(
        ValueError,
        match=r"with_mixer\('mamba4'\): valid SSM mixers: mamba1, "
        r"mamba2, mamba3",
    ):
        ModelConfig().with_mixer("mamba4")
    with pytest.raises(ValueError, match="no SSM layer"):
        ModelConfig(mixer="attn", n_layer=2, d_model=64).with_mixer("mamba2")
    with pytest.raises(ValueError, match="Zamba2 model's layers are Mamba-2"):
        ModelConfig.preset("tiny-zamba2").with_mixer("mamba1")
