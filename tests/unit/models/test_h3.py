"""The H3 mixer (ssmkit.models.h3) and H3 language models, hybrids with attention included.

Oracles: the recurrence (one token at a time) against the FFT convolutions, outputs and gradients;
the shift SSM run as an SSM (ssmkit.ops.shift_ssm) against the conv that holds its C; a loop over
positions with an explicit per-head state; each prompt alone against a padded batch or packed row;
generation without the cache; the saved checkpoint loaded back; the Trainer's loss.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import losses, perturb_, small

import ssmkit
from ssmkit import ops
from ssmkit.hub.layouts import CheckpointError
from ssmkit.models import ModelConfig
from ssmkit.models.h3 import H3
from ssmkit.models.ssm_config import H3Config
from ssmkit.train import Trainer

TOL = 1e-5  # fp32, relative to the largest output


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def mixer(seed=0, **cfg) -> H3:
    torch.manual_seed(seed)
    layer = H3(16, H3Config(**{"d_state": 8, "shift_size": 3, **cfg}))
    return perturb_(layer, seed + 1)


def stepwise(layer, x: torch.Tensor) -> torch.Tensor:
    state = layer.allocate_state(x.shape[0], x.dtype, x.device)
    return torch.cat([layer.step(x[:, t : t + 1], state) for t in range(x.shape[1])], dim=1)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),  # head_dim 1, as the H3 code's default
        dict(head_dim=4, init="legs", disc="zoh"),
        dict(head_dim=16, shift_size=1, init="random", d_state=4),
    ],
)
def test_convolution_equals_recurrence_with_gradients(cfg):
    layer = mixer(**cfg)
    x = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(3))
    w = torch.randn(2, 19, 16)
    outs, grads = [], []
    for run in (layer, lambda h: stepwise(layer, h)):
        layer.zero_grad()
        y = run(x)
        (y * w).sum().backward()
        outs.append(y.detach())
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    assert rel(outs[0], outs[1]) < TOL
    for name in grads[0]:
        assert rel(grads[0][name], grads[1][name]) < 1e-4, name


def test_h3_is_the_papers_recurrence_per_head():
    """A loop over positions with the state of each head written out (H3 section 3.1): k̄ = shift
    SSM of k (ssmkit.ops.shift_ssm, C = the conv's taps) + shift_D k; per head the state S_t =
    Ā ∘ S_{t-1} + B̄ (k̄_t v_tᵀ) (every entry N/2 modes), o_t = q_tᵀ (2 Re(C·S_t) + D k̄_t v_tᵀ)."""
    layer = mixer(head_dim=2, shift_size=3)
    H, P, W = layer.nheads, layer.head_dim, layer.shift_size
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        q, k, v = layer.q_proj(x)[0], layer.k_proj(x)[0], layer.v_proj(x)[0]  # (L, d)
        A, B = ops.shift_ssm(W, dtype=torch.float32)
        taps = layer.shift_conv.weight[:, 0].flip(-1)  # C_l = weight[W - 1 - l]
        shift = torch.stack([ops.ssm_recurrent(A, B, taps[c], k[:, c]) for c in range(16)], -1)
        kbar = shift + layer.shift_D * k
        Ab, Bb, C = layer.ssm.discrete()  # (H, N/2)
        S = torch.zeros(H, P, P, C.shape[-1], dtype=torch.complex64)
        out = []
        for t in range(9):
            kh, vh, qh = (z[t].view(H, P) for z in (kbar, v, q))
            kv = kh[:, :, None] * vh[:, None, :]  # (H, P, P)
            S = Ab[:, None, None] * S + Bb[:, None, None] * kv[..., None]
            y = 2 * (C[:, None, None] * S).sum(-1).real + layer.D[:, None, None] * kv
            out.append(torch.einsum("hi,hij->hj", qh, y).reshape(16))
        want = layer.out_proj(torch.stack(out))
        assert rel(layer(x)[0], want) < TOL


def tiny(**overrides):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny-h3", **{"d_model": 32, "vocab_size": 64, **overrides})
    return perturb_(ssmkit.build_model(cfg), 1).eval()


def test_the_preset_is_an_h3_hybrid_with_two_attention_layers():
    cfg = ModelConfig.preset("tiny-h3")
    assert cfg.mixers == ["h3", "attn", "h3", "attn"] and cfg.d_intermediate > 0
    with torch.device("meta"):
        assert ssmkit.build_model(cfg).num_parameters() > 0


def test_prefill_in_pieces_steps_and_generation_equal_the_full_forward():
    model = tiny()
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_cache(2)
        parts = [model(ids[:, :2], cache=cache).logits, model(ids[:, 2:24], cache=cache).logits]
        parts += [model(ids[:, t : t + 1], cache=cache).logits for t in range(24, 30)]
    assert rel(torch.cat(parts, dim=1), full) < TOL
    state = cache.layers[0]
    assert state.ssm.shape == (2, 4, 4, 8, 8) and state.conv.shape == (2, 32, 4)
    fast = ssmkit.generate(model, ids[:, :7], max_new_tokens=16, temperature=0)
    slow = ssmkit.generate(model, ids[:, :7], max_new_tokens=16, temperature=0, use_cache=False)
    assert torch.equal(fast, slow)


def test_left_padding_and_packed_rows_equal_each_prompt_alone():
    model = tiny(layout=["h3", "h3"], n_layer=2, attn_layer_idx=None, d_intermediate=0)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 64, (1, 13), generator=g), torch.randint(0, 64, (1, 6), generator=g)
    ids = torch.cat([a, torch.cat([torch.randint(0, 64, (1, 7), generator=g), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        alone = [model(a).logits[0], model(b).logits[0]]
        out = model(ids, attention_mask=mask).logits
        assert rel(out[0], alone[0]) < TOL and rel(out[1, 7:], alone[1]) < TOL
        assert rel(model(ids).logits[1, 7:], alone[1]) > 1e-3  # the control
        packed = model(torch.cat([a, b], 1), seq_idx=torch.tensor([[0] * 13 + [1] * 6])).logits
        assert rel(packed[0, :13], alone[0]) < TOL and rel(packed[0, 13:], alone[1]) < TOL
    padded = ssmkit.generate(model, ids, 8, temperature=0, attention_mask=mask)
    assert torch.equal(padded[1, 7:], ssmkit.generate(model, b, 8, temperature=0)[0])


def test_saves_in_mamba_ssms_layout_and_loads_back(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["ssm_cfg"] == {"layer": "H3", **model.config.h3.to_dict()}
    assert config["attn_layer_idx"] == [1, 3]
    back = ssmkit.from_pretrained(tmp_path / "m")
    assert back.config == model.config
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    with pytest.raises(CheckpointError, match="transformers has no H3 model"):
        model.save_pretrained(tmp_path / "hf", format="hf")


def test_with_mixer_refuses_h3_and_says_why():
    with pytest.raises(ValueError, match="H3 has no layer of a Mamba layer's size"):
        ModelConfig.preset("tiny").with_mixer("h3")
    with pytest.raises(ValueError, match="H3 has no layer of a Mamba layer's size"):
        ModelConfig.preset("tiny-h3").with_mixer("mamba1")
    with pytest.raises(ValueError, match="h3.head_dim must divide d_model = 64; got 5"):
        ModelConfig(d_model=64, n_layer=1, vocab_size=10, mixer="h3", h3=dict(head_dim=5))


def test_planner_and_flops_cover_h3_and_s4d():
    from ssmkit.eval import flops_per_token
    from ssmkit.train import plan_memory

    for name in ("tiny-h3", "tiny-s4d"):
        cfg = ModelConfig.preset(name)
        plan = plan_memory(cfg, seq_len=256, micro_batch=2, backend="torch", gpu_memory_gb=4)
        assert plan.activations > 0 and plan.max_micro_batch >= 1
        with torch.device("meta"):
            model = ssmkit.build_model(cfg)
        matmuls = 6 * sum(
            m.weight.numel()
            for m in model.modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d))
        )
        assert flops_per_token(model, 256) > matmuls


def test_trainer_loss_falls(tmp_path, shards):
    cfg = small(
        tmp_path,
        shards,
        model="tiny-h3",
        max_steps=8,
        model_overrides={"d_model": 32, "n_layer": 2, "attn_layer_idx": [1], "d_intermediate": 64},
    )
    history = losses(Trainer(config=cfg).fit())
    assert history[-1] < history[0] - 0.3, history
