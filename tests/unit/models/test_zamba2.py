"""Zamba2: logits parity with transformers' Zamba2ForCausalLM both ways, cached generation, left
padding, gradients, and the config checks (ssmkit/models/zamba2*.py, ssmkit/hub/zamba2.py)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from ssmkit.hub.layouts import CheckpointError
from ssmkit.hub.zamba2 import (
    config_from_zamba2,
    config_to_zamba2,
    state_from_zamba2,
    state_to_zamba2,
)
from ssmkit.models import MambaLM, ModelConfig, generate
from ssmkit.models.zamba2_blocks import HybridState
from ssmkit.models.zamba2_config import TINY_ZAMBA2, check_zamba2

transformers = pytest.importorskip("transformers")
from transformers import Zamba2Config, Zamba2ForCausalLM  # noqa: E402

VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models here are tiny: one thread is fastest, and spares the per-op thread wake-ups that
    cost milliseconds each on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_config(**kw) -> Zamba2Config:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=5,
        mamba_d_state=8,
        mamba_d_conv=4,
        n_mamba_heads=4,
        num_attention_heads=4,
        chunk_size=16,
        intermediate_size=48,
        adapter_rank=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
        attn_implementation="eager",
    )
    return Zamba2Config(**{**base, **kw})


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0):
    """Weights far from the init (which makes attention uniform and logits tiny), Δ partly below
    time_step_min so its clamp matters; the same rules for transformers' names and ours."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=gen)
        if name.endswith("A_log"):
            continue
        elif name.endswith("dt_bias"):
            p.copy_(torch.rand(p.shape, generator=gen) * 10 - 9)  # softplus: 1e-4 .. 1.3
        elif "norm" in name and p.dim() == 1:
            p.copy_(1 + 0.2 * r)
        elif p.dim() >= 2:
            p.copy_(r / math.sqrt(p[0].numel()))
        else:  # D, biases
            p.copy_(0.3 * r)


def hf_model(cfg: Zamba2Config, seed: int = 0) -> Zamba2ForCausalLM:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Zamba2ForCausalLM(cfg).eval()
    randomize(model, seed)
    return model


def ours_from(hf: Zamba2ForCausalLM) -> MambaLM:
    cfg = config_from_zamba2(hf.config.to_dict())
    model = MambaLM(cfg).eval()
    model.load_state_dict(state_from_zamba2(hf.state_dict(), cfg))
    return model


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4):
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"max |diff| {err}"


def tiny(seed: int = 0, fields: dict | None = None, **z) -> MambaLM:
    """A small ssmkit Zamba2 with random weights: GQA, RoPE, two blocks, adapters on q/k/v and MLP;
    ``fields``: ModelConfig overrides, ``z``: zamba2 overrides."""
    zamba2 = dict(
        hybrid_layer_ids=[0, 2, 3],
        num_mem_blocks=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        adapter_rank=4,
        use_shared_attention_adapter=True,
        use_mem_rope=True,
    )
    kw = dict(
        TINY_ZAMBA2,
        d_model=32,
        n_layer=4,
        vocab_size=VOCAB,
        d_state=8,
        headdim=8,
        chunk_size=16,
        zamba2={**zamba2, **z},
        **(fields or {}),
    )
    torch.manual_seed(seed)
    model = MambaLM(ModelConfig(**kw)).eval()
    randomize(model, seed)
    return model


# ---------------------------------------------------------------------------------------------
# (a) transformers -> ssmkit: same logits
# ---------------------------------------------------------------------------------------------

H, M = "hybrid", "mamba"
LAYOUTS = {
    "two-blocks-adapters-rope": dict(
        num_mem_blocks=2, use_shared_attention_adapter=True, use_mem_rope=True
    ),
    "one-block-no-rope-eps": dict(
        num_mem_blocks=1, layers_block_type=[H, M, M, H, M], rms_norm_eps=1e-3
    ),
    "gqa-bias-tanh-groups": dict(
        num_key_value_heads=2,
        add_bias_linear=True,
        hidden_act="gelu_pytorch_tanh",
        mamba_ngroups=2,
        use_mem_rope=True,
        rope_parameters={"rope_theta": 500.0, "rope_type": "default"},
    ),
    "untied": dict(
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        tie_word_embeddings=False,
        layers_block_type=[H, H, M, H, H],
        hidden_act="mish",  # any of transformers' names (ssmkit.ops.ACTIVATIONS)
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers(layout):
    hf = hf_model(hf_config(**LAYOUTS[layout]))
    ours = ours_from(hf)
    ids = torch.randint(0, VOCAB, (3, 21), generator=torch.Generator().manual_seed(1))
    pads = [0, 6, 17]
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    with torch.no_grad():
        close(ours(ids).logits, hf(ids).logits)
        # Left padding: each row's real positions as transformers gives the row alone.
        # (transformers' own padded batch differs with add_bias_linear: in_proj's bias reaches the
        # conv at the padding.)
        padded = ours(ids, attention_mask=mask).logits
        for row, pad in enumerate(pads):
            close(padded[row, pad:], hf(ids[row : row + 1, pad:]).logits[0])


def test_untied_blocks_are_per_layer():
    """transformers ties the shared blocks only with tie_word_embeddings; untied, each hybrid layer
    has its own block."""
    cfg = config_from_zamba2(hf_config(num_mem_blocks=2, tie_word_embeddings=False).to_dict())
    assert cfg.zamba2["num_mem_blocks"] == 3 and not cfg.tie_embeddings
    assert config_from_zamba2(hf_config(num_mem_blocks=2).to_dict()).zamba2["num_mem_blocks"] == 2


def test_load_what_save_pretrained_writes(tmp_path):
    """save_pretrained writes each tied block once: state_from_zamba2 reads that too."""
    from safetensors.torch import load_file

    hf = hf_model(hf_config(num_mem_blocks=2, use_shared_attention_adapter=True))
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert not any(
        k.startswith("model.layers.4.shared_transformer") for k in state
    )  # tied to layer 1
    cfg = config_from_zamba2(hf.config.to_dict())
    ours = MambaLM(cfg).eval()
    ours.load_state_dict(state_from_zamba2(state, cfg))
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        close(ours(ids).logits, hf(ids).logits)


def test_state_from_zamba2_names_missing_weights():
    hf = hf_model(hf_config())
    state = hf.state_dict()
    state.pop("model.layers.3.linear.weight")
    state["model.layers.0.mystery.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.linear\.weight.*mystery"):
        state_from_zamba2(state, config_from_zamba2(hf.config.to_dict()))


# ---------------------------------------------------------------------------------------------
# (b) ssmkit -> transformers: same logits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["tied", "untied", "zero-filled"])
def test_round_trip_to_transformers(variant, tmp_path):
    """ours -> config.json + model.safetensors -> transformers' from_pretrained: same logits, and
    back."""
    from safetensors.torch import save_file

    if variant == "zero-filled":  # weights transformers has and ours lacks: written as zeros
        model = tiny(
            fields=dict(conv_bias=False),
            num_key_value_heads=4,
            use_shared_mlp_adapter=False,
            add_bias_linear=True,
        )
    else:
        model = tiny(fields=dict(tie_embeddings=variant == "tied"), num_key_value_heads=4)
    cfg = model.config
    (tmp_path / "config.json").write_text(json.dumps(config_to_zamba2(cfg)))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(
        state_to_zamba2(state, cfg), str(tmp_path / "model.safetensors")
    )  # refuses shared memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = Zamba2ForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager", output_loading_info=True
        )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        close(hf(ids).logits, model(ids).logits)
        back = MambaLM(config_from_zamba2(hf.config.to_dict())).eval()  # and back again
        back.load_state_dict(state_from_zamba2(hf.state_dict(), back.config))
        close(back(ids).logits, model(ids).logits)


def test_config_errors_name_the_field():
    with pytest.raises(CheckpointError, match="layers_block_type"):
        config_from_zamba2(hf_config(layers_block_type=[M, "attention", M, H, M]).to_dict())
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        config_from_zamba2(
            {
                **hf_config().to_dict(),
                "num_key_value_heads": 2,
                "use_shared_attention_adapter": True,
            }
        )
    with pytest.raises(CheckpointError, match="attention_dropout"):
        config_from_zamba2({**hf_config().to_dict(), "attention_dropout": 0.1})
    with pytest.raises(CheckpointError, match="n_mamba_heads"):
        config_from_zamba2({**hf_config().to_dict(), "n_mamba_heads": 5})
    with pytest.raises(CheckpointError, match="num_mem_blocks"):
        config_from_zamba2({**hf_config().to_dict(), "num_mem_blocks": 0})
    with pytest.raises(CheckpointError, match="model_type"):
        config_from_zamba2({**hf_config().to_dict(), "model_type": "mamba2"})
    model = tiny()
    with pytest.raises(CheckpointError, match="GQA"):
        config_to_zamba2(model.config)
    cfg = ModelConfig(**{**TINY_ZAMBA2, "dt_limit": (0.0, math.inf)})
    with pytest.raises(CheckpointError, match="dt_limit"):
        config_to_zamba2(cfg)


# ---------------------------------------------------------------------------------------------
# (c) cached generation, (d) left padding
# ---------------------------------------------------------------------------------------------


def test_cached_steps_equal_full_forward():
    model = tiny()
    ids = torch.randint(0, VOCAB, (2, 27), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_cache(2)
        assert any(isinstance(s, HybridState) for s in cache.layers) and cache.nbytes() > 0
        steps = [model(ids[:, :19], cache=cache).logits]
        for t in range(19, 27):
            steps.append(model(ids[:, t : t + 1], cache=cache).logits)
    close(torch.cat(steps, dim=1), full)
    prompt = ids[:, :9]
    a = generate(model, prompt, max_new_tokens=8, temperature=0, use_cache=True)
    b = generate(model, prompt, max_new_tokens=8, temperature=0, use_cache=False)
    assert torch.equal(a, b)


def test_left_padding_equals_rows_alone():
    model = tiny()
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (21, 13, 4)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        assert torch.isfinite(batch).all()  # padded queries too
        for i, r in enumerate(rows):
            close(batch[i, width - len(r) :], model(r[None]).logits[0])
    out = generate(model, ids, max_new_tokens=6, temperature=0, attention_mask=mask)
    for i, r in enumerate(rows):
        alone = generate(model, r[None], max_new_tokens=6, temperature=0)
        assert torch.equal(out[i, width - len(r) :], alone[0])


# ---------------------------------------------------------------------------------------------
# (e) gradients, (f) config checks
# ---------------------------------------------------------------------------------------------


def test_backward_reaches_shared_blocks_adapters_and_every_layer():
    model = tiny().train()
    ids = torch.randint(0, VOCAB, (2, 24))
    model(ids, labels=ids).loss.backward()
    groups = {
        "shared.0.attn",
        "shared.1.mlp",
        "adapters.q",
        "adapters.v",
        "adapters.gate_up",
        ".linear.",
    }
    groups |= {f"layers.{i}.mixer." for i in range(model.config.n_layer)}
    for group in groups:
        grads = [p.grad for n, p in model.named_parameters() if group in n]
        assert grads, group
        assert all(
            g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads
        ), group


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_mem_blocks", 0, "zamba2.num_mem_blocks"),
        ("hybrid_layer_ids", [1, 9], "zamba2.hybrid_layer_ids"),
        ("hybrid_layer_ids", [3, 1], "zamba2.hybrid_layer_ids"),
        ("num_attention_heads", 5, "zamba2.num_attention_heads"),
        ("num_key_value_heads", 3, "zamba2.num_key_value_heads"),
        ("hidden_act", "prelu", "zamba2.hidden_act"),
        ("use_mem_rope", "yes", "zamba2.use_mem_rope"),
        ("rope_theta", -1.0, "zamba2.rope_theta"),
        ("adapter_rank", True, "zamba2.adapter_rank"),
        ("heads", 4, "zamba2.heads"),
    ],
)
def test_check_zamba2_names_the_bad_field(field, value, match):
    z = {**TINY_ZAMBA2["zamba2"], field: value}
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        check_zamba2(z, 64, 6)
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        ModelConfig(**{**TINY_ZAMBA2, "zamba2": z})


def test_check_zamba2_fills_defaults():
    z = check_zamba2({"hybrid_layer_ids": [2], "num_attention_heads": 8}, 64, 4)
    assert (
        z["num_key_value_heads"] == 8 and z["intermediate_size"] == 256 and z["num_mem_blocks"] == 1
    )
    with pytest.raises(
        ValueError, match="zamba2.num_attention_heads"
    ):  # 64 does not divide 2 * 20 = 40
        check_zamba2({"hybrid_layer_ids": [2], "num_attention_heads": 64}, 20, 4)
    with pytest.raises(ValueError, match="zamba2.use_mem_rope"):  # head_dim 2 * 12 / 8 = 3 is odd
        check_zamba2(
            {"hybrid_layer_ids": [2], "num_attention_heads": 8, "use_mem_rope": True}, 12, 4
        )


def test_tiny_preset_runs_and_saves():
    cfg = ModelConfig(**TINY_ZAMBA2)
    model = MambaLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 70))  # > chunk_size
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    hf = config_to_zamba2(cfg)
    assert hf["layers_block_type"].count("hybrid") == 3 and hf["model_type"] == "zamba2"
    assert config_from_zamba2(hf).zamba2 == cfg.zamba2
