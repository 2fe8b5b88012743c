"""Hybrid models: the attention mixer against a plain reference and transformers' Llama attention,
GatedMLP, the layer rules (attn_every / attn_layer_idx / layout), cached generation of every layout,
left padding, the chunked loss and activation checkpointing. fp32 tolerances: 1e-5 unless stated."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import losses, small

from ssmkit.models import MambaLM, ModelConfig, generate
from ssmkit.models.attention import Attention, rotary
from ssmkit.models.cache import KVState
from ssmkit.models.config import ConfigError, check_attn_cfg
from ssmkit.models.lm import chunked_cross_entropy
from ssmkit.models.mlp import GatedMLP, mlp_width
from ssmkit.train import Trainer


def reference_attention(att: Attention, x: torch.Tensor) -> torch.Tensor:
    """mamba_ssm's MHA written out position by position: conv, rotary (by explicit 2x2 rotations),
    GQA by head index, a softmax over the allowed keys, the parallel MLP. x: (batch, L, d_model)."""
    b, L, _ = x.shape
    H, Hkv, d = att.num_heads, att.num_heads_kv, att.head_dim
    proj = x @ att.in_proj.weight.T + (att.in_proj.bias if att.in_proj.bias is not None else 0)
    qkv, mlp = proj[..., : att.qkv_dim], proj[..., att.qkv_dim :]
    if att.d_conv:
        w = att.conv1d.weight[:, 0]  # (qkv_dim, W)
        padded = F.pad(qkv, (0, 0, att.d_conv - 1, 0))
        qkv = sum(padded[:, j : j + L] * w[:, j] for j in range(att.d_conv)) + att.conv1d.bias
    q = qkv[..., : H * d].reshape(b, L, H, d)
    k = qkv[..., H * d : (H + Hkv) * d].reshape(b, L, Hkv, d)
    v = qkv[..., (H + Hkv) * d :].reshape(b, L, Hkv, d)

    def rope(t):  # t: (b, L, heads, d)
        r = att.rotary_dim
        out = t.clone()
        for pos in range(L):
            for i in range(r // 2):
                theta = pos * att.rotary_base ** (-2 * i / r)
                a, c = (2 * i, 2 * i + 1) if att.rotary_interleaved else (i, i + r // 2)
                x0, x1 = t[:, pos, :, a], t[:, pos, :, c]
                out[:, pos, :, a] = x0 * math.cos(theta) - x1 * math.sin(theta)
                out[:, pos, :, c] = x0 * math.sin(theta) + x1 * math.cos(theta)
        return out

    q, k = rope(q), rope(k)
    scale = att.softmax_scale or d**-0.5
    out = torch.zeros(b, L, H, d)
    for h in range(H):
        g = h // (H // Hkv)  # the kv head of this query head
        for t in range(L):
            lo = 0 if att.window is None else max(0, t - att.window + 1)
            scores = (k[:, lo : t + 1, g] @ q[:, t, h, :, None])[..., 0] * scale  # (b, keys)
            out[:, t, h] = (scores.softmax(-1)[..., None] * v[:, lo : t + 1, g]).sum(1)
    out = out.reshape(b, L, H * d)
    if att.mlp_dim:
        up, gate = mlp.chunk(2, dim=-1)
        out = torch.cat([out, up * F.silu(gate)], dim=-1)
    return out @ att.out_proj.weight.T + (att.out_proj.bias if att.out_proj.bias is not None else 0)


ATTN_CASES = {
    "plain": dict(num_heads=4),
    "gqa-rotary": dict(num_heads=4, num_heads_kv=2, rotary_emb_dim=8),
    "mqa-interleaved": dict(
        num_heads=4, num_heads_kv=1, rotary_emb_dim=16, rotary_emb_interleaved=True
    ),
    "conv-mlp-scale": dict(
        num_heads=2,
        head_dim=24,
        d_conv=4,
        mlp_dim=100,
        softmax_scale=0.3,
        qkv_proj_bias=False,
        out_proj_bias=False,
    ),
    "window": dict(num_heads=4, rotary_emb_dim=8, window_size=5),
    "window-long": dict(
        num_heads=4, num_heads_kv=2, window_size=3, d_conv=3
    ),  # L > 2w: the blocked path
}


@pytest.mark.parametrize("case", ATTN_CASES)
def test_attention_equals_the_reference(case):
    torch.manual_seed(0)
    cfg = check_attn_cfg(ATTN_CASES[case], 64)
    att = Attention(64, cfg, window=cfg["window_size"])
    with torch.no_grad():
        for p in att.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 17, 64)
    torch.testing.assert_close(att(x), reference_attention(att, x), atol=1e-5, rtol=1e-5)


def test_attention_equals_transformers_llama_attention():
    """With rotary over the whole head (GPT-NeoX pairing) and no biases, our fused in_proj is
    Llama's q, k, v stacked: the layer's output must match LlamaAttention's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    torch.manual_seed(0)
    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500.0,
        attention_bias=False,
        max_position_embeddings=64,
    )
    hf._attn_implementation = "sdpa"
    theirs = LlamaAttention(hf, layer_idx=0).eval()
    ours = Attention(
        64,
        check_attn_cfg(
            dict(
                num_heads=4,
                num_heads_kv=2,
                rotary_emb_dim=16,
                rotary_emb_base=500.0,
                qkv_proj_bias=False,
                out_proj_bias=False,
            ),
            64,
        ),
    )
    with torch.no_grad():
        qkv = [theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]
        ours.in_proj.weight.copy_(torch.cat(qkv))
        ours.out_proj.weight.copy_(theirs.o_proj.weight)
    x = torch.randn(2, 19, 64)
    pos = torch.arange(19)[None].expand(2, -1)
    cos_sin = LlamaRotaryEmbedding(hf)(x, pos)
    mask = torch.full((19, 19), -torch.inf).triu(1)[None, None]
    expected = theirs(x, position_embeddings=cos_sin, attention_mask=mask)[0]
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)


def test_rotary_is_a_rotation_by_relative_position():
    """q·k after rotary depends only on the distance between the positions (RoFormer's point)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    dots = []
    for shift in (0, 5, 40):
        pq, pk = torch.tensor([[3 + shift]]), torch.tensor([[1 + shift]])
        dots.append((rotary(q, pq, 16, 10000.0, False) * rotary(k, pk, 16, 10000.0, False)).sum())
    torch.testing.assert_close(dots[0], dots[1])
    torch.testing.assert_close(dots[0], dots[2])


def test_gated_mlp_is_value_times_silu_gate_with_mamba_ssm_rounding():
    assert (mlp_width(100), mlp_width(128), mlp_width(129)) == (128, 128, 256)
    torch.manual_seed(0)
    mlp = GatedMLP(32, 100)
    assert mlp.fc1.weight.shape == (256, 32) and mlp.fc2.weight.shape == (32, 128)
    x = torch.randn(3, 32)
    h = x @ mlp.fc1.weight.T
    torch.testing.assert_close(mlp(x), (h[:, :128] * F.silu(h[:, 128:])) @ mlp.fc2.weight.T)


def test_kv_ring_buffer_keeps_exactly_the_last_window():
    s = KVState(1, 1, 2, torch.float32, "cpu", window=3)
    for t in range(7):
        keys, _, key_pos = s.append(torch.full((1, 1, 1, 2), float(t)), torch.zeros(1, 1, 1, 2))
    assert sorted(key_pos.tolist()) == [4, 5, 6] and sorted(keys[0, 0, :, 0].tolist()) == [
        4.0,
        5.0,
        6.0,
    ]
    full = KVState(1, 1, 2, torch.float32, "cpu", capacity=2)
    for t in range(5):
        keys, _, key_pos = full.append(torch.full((1, 1, 1, 2), float(t)), torch.zeros(1, 1, 1, 2))
    assert key_pos.tolist() == [0, 1, 2, 3, 4] and keys[0, 0, :, 0].tolist() == [
        0.0,
        1.0,
        2.0,
        3.0,
        4.0,
    ]


# --- the layer rules ------------------------------------------------------------------------------


def _cfg(**kw):
    return ModelConfig(
        **{"d_model": 64, "n_layer": 8, "vocab_size": 256, "headdim": 16, "d_state": 16, **kw}
    )


def test_attn_every_follows_jambas_rule_and_fills_attn_layer_idx():
    cfg = _cfg(attn_every=4, attn_offset=1)
    assert cfg.attn_layer_idx == [1, 5]
    assert cfg.mixers == [
        "mamba1",
        "attn",
        "mamba1",
        "mamba1",
        "mamba1",
        "attn",
        "mamba1",
        "mamba1",
    ]
    assert _cfg(attn_layer_idx=[1, 5], mixer="mamba2").mixers[1::4] == ["attn", "attn"]
    assert _cfg(mixer="attn").mixers == ["attn"] * 8
    swa = _cfg(attn_every=2, attn_cfg={"window_size": 16})
    assert swa.mixers[0] == "swa" and swa.attn_cfg["window_size"] == 16
    again = ModelConfig.from_dict(cfg.to_dict())  # a saved config reloads to the same layers
    assert again.mixers == cfg.mixers and again.attn_cfg == cfg.attn_cfg


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(attn_every=2, attn_cfg={"causal": False}), "attn_cfg.causal"),
        (dict(attn_every=2, attn_cfg={"num_heads": 3}), "attn_cfg.num_heads"),
        (dict(attn_every=2, attn_cfg={"num_heads": 4, "num_heads_kv": 3}), "attn_cfg.num_heads_kv"),
        (dict(attn_every=2, attn_cfg={"rotary_emb_dim": 7}), "attn_cfg.rotary_emb_dim"),
        (dict(attn_every=2, attn_cfg={"heads": 4}), "attn_cfg"),
        (dict(attn_every=4, attn_offset=4), "attn_offset"),
        (dict(attn_layer_idx=[8]), "attn_layer_idx"),
        (dict(attn_every=4, attn_layer_idx=[0, 3]), "attn_layer_idx"),
        (dict(layout=["mamba1", "swa"] * 4), "attn_cfg.window_size"),
        (dict(d_intermediate=-1), "d_intermediate"),
    ],
)
def test_bad_hybrid_configs_name_the_field(kw, field):
    with pytest.raises(ConfigError) as err:
        _cfg(**kw)
    assert err.value.field == field, str(err.value)


# --- whole models ---------------------------------------------------------------------------------

LAYOUTS = {
    "jamba-mamba1": dict(attn_every=4, attn_offset=2, attn_cfg={"rotary_emb_dim": 8}),
    "mamba2-gqa-mlp": dict(
        mixer="mamba2",
        attn_layer_idx=[1, 6],
        d_intermediate=96,
        attn_cfg={"num_heads_kv": 1, "d_conv": 4, "rotary_emb_dim": 16},
    ),
    "samba-swa": dict(
        layout=["mamba1", "swa"] * 4,
        d_intermediate=64,
        attn_cfg={"window_size": 4, "rotary_emb_dim": 8, "mlp_dim": 64},
    ),
    "mixed": dict(
        layout=["mamba1", "mamba2", "attn", "swa", "mamba2", "attn", "mamba1", "swa"],
        attn_cfg={"window_size": 6},
    ),
    "pure-attention": dict(mixer="attn", attn_cfg={"rotary_emb_dim": 16}),
    "zamba2": dict(
        mixer="mamba2",
        dt_limit=(0.001, float("inf")),
        residual_in_fp32=False,
        zamba2=dict(
            hybrid_layer_ids=[1, 4, 6],
            num_mem_blocks=2,
            num_attention_heads=4,
            intermediate_size=128,
            adapter_rank=8,
            use_mem_rope=True,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def hybrid(request):
    torch.manual_seed(0)
    return MambaLM(_cfg(**LAYOUTS[request.param])).eval()


def test_cached_generation_equals_full_recomputation(hybrid):
    torch.manual_seed(1)
    x = torch.randint(0, 256, (2, 21))
    full = hybrid(x).logits
    cache = hybrid.allocate_cache(2)
    steps = [hybrid(x[:, :9], cache=cache).logits]  # prefill longer than any window
    steps += [hybrid(x[:, t : t + 1], cache=cache).logits for t in range(9, 21)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=1e-4)
    fast = generate(hybrid, x[:, :5], 16, temperature=0)
    assert torch.equal(fast, generate(hybrid, x[:, :5], 16, temperature=0, use_cache=False))


def test_left_padded_batch_equals_each_row_alone(hybrid):
    torch.manual_seed(2)
    a, b = torch.randint(0, 256, (1, 13)), torch.randint(0, 256, (1, 6))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 7, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    out = hybrid(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[0], hybrid(a).logits[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[1, 7:], hybrid(b).logits[0], atol=1e-5, rtol=1e-4)
    padded = generate(hybrid, ids, 8, temperature=0, attention_mask=mask)
    assert torch.equal(padded[1, 7:], generate(hybrid, b, 8, temperature=0)[0])


def test_chunked_loss_and_activation_checkpointing_change_nothing(hybrid):
    """Same loss and the same gradient for every parameter (the chunked loss never holds all
    logits)."""
    torch.manual_seed(3)
    x = torch.randint(0, 256, (2, 24))
    hybrid.train()
    try:

        def loss_and_grads(**kw):
            hybrid.zero_grad()
            out = hybrid(x, labels=x, **kw)
            out.loss.backward()
            return out, [p.grad.clone() for p in hybrid.parameters()]

        plain, g0 = loss_and_grads()
        chunked, g1 = loss_and_grads(loss_chunk_size=7)
        assert chunked.logits is None
        hybrid.backbone.gradient_checkpointing = True
        recomputed, g2 = loss_and_grads()
    finally:
        hybrid.backbone.gradient_checkpointing = False
        hybrid.eval()
    for out, grads in ((chunked, g1), (recomputed, g2)):
        torch.testing.assert_close(out.loss, plain.loss, atol=1e-6, rtol=1e-6)
        for a, b in zip(grads, g0):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_hybrid_init_rescales_every_residual_branch():
    """mamba_ssm: out_proj of every mixer (attention too) and fc2 of every MLP scaled by 1/sqrt(2
    n_layer)."""
    torch.manual_seed(0)
    model = MambaLM(_cfg(attn_every=2, d_intermediate=128))
    for layer in model.backbone.layers:
        for w, fan_in in (
            (layer.mixer.out_proj.weight, layer.mixer.out_proj.in_features),
            (layer.mlp.fc2.weight, layer.mlp.fc2.in_features),
        ):
            limit = (
                1 / math.sqrt(fan_in) / math.sqrt(16)
            )  # kaiming_uniform(a=sqrt(5)) / sqrt(2 * 8)
            assert w.abs().max() <= limit + 1e-7 and w.abs().max() > 0.8 * limit


def test_trainer_long_context_switches_train_the_same_model(tmp_path, shards):
    """activation_checkpointing and loss_chunk_size in the run config: the same losses step for
    step."""
    plain = losses(
        Trainer(config=small(tmp_path / "a", shards, model="tiny-hybrid", max_steps=3)).fit()
    )
    trainer = Trainer(
        config=small(
            tmp_path / "b",
            shards,
            model="tiny-hybrid",
            max_steps=3,
            activation_checkpointing=True,
            loss_chunk_size=24,
        )
    )
    assert trainer.model.backbone.gradient_checkpointing and trainer.model.loss_chunk_size == 24
    assert losses(trainer.fit()) == pytest.approx(plain, abs=1e-5)


CHUNKED_16K = """
import json, torch
from ssmkit.eval.long_context import peak_rss_mb
from ssmkit.models.lm import chunked_cross_entropy
torch.manual_seed(0)
head = torch.nn.Linear(32, 50304, bias=False)
hidden = torch.randn(1, 16384, 32, requires_grad=True)
targets = torch.randint(0, 50304, (1, 16384))
def step():
    loss = chunked_cross_entropy(hidden, head, targets, 1024)
    loss.backward()
    return loss.item()
loss, extra = peak_rss_mb(step)
print(json.dumps({"loss": loss, "extra_mb": extra}))
"""


def test_chunked_loss_never_holds_the_full_logits_at_16k():
    """16,384 positions x a 50,304-row vocabulary: the logits alone are 3.1 GiB in fp32. The chunked
    loss (chunks of 1,024) holds one chunk's logits (~200 MiB with their softmax) in the forward and
    backward. Measured in a fresh process: a long test session's heap would blur a per-call peak."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", CHUNKED_16K], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["extra_mb"] is None:
        pytest.skip("no per-call peak memory on this platform (needs Linux /proc)")
    full_logits_mb = 16384 * 50304 * 4 / 2**20
    extra = result["extra_mb"]
    assert extra < 0.25 * full_logits_mb, (
        f"peak {extra:.0f} MiB; all logits would be {full_logits_mb:.0f}"
    )
    assert math.isfinite(result["loss"])
    torch.manual_seed(0)  # the same value as the plain loss (chunks of 1,024 vs all at once)
    head = torch.nn.Linear(32, 503, bias=False)
    h, t = torch.randn(1, 4096, 32), torch.randint(0, 503, (1, 4096))
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_cross_entropy(h, head, t, 1024), F.cross_entropy(head(h[0]), t[0])
        )


def test_every_model_saves_in_its_natural_format_by_default(tmp_path, shards):
    """save_pretrained() without a format (as the Trainer's checkpoints call it) picks one that
    holds the model: a Trainer run of the hybrid preset leaves a checkpoint from_pretrained loads
    with equal logits."""
    import ssmkit
    from ssmkit.hub.save import natural_format

    kinds = {"tiny": "hf", "tiny-mamba2": "hf", "tiny-hybrid": "mamba_ssm", "tiny-zamba2": "zamba2"}
    assert {name: natural_format(ModelConfig.preset(name)) for name in kinds} == kinds
    assert natural_format(_cfg(d_intermediate=64)) == "mamba_ssm"
    assert (
        natural_format(
            _cfg(mixer_rms_eps=1e-6, mixer_rms_weights=True, d_intermediate=128, attn_every=2)
        )
        == "jamba"
    )
    trainer = Trainer(config=small(tmp_path, shards, model="tiny-hybrid", max_steps=2))
    trainer.fit()
    step = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    loaded = ssmkit.from_pretrained(step / "model").eval()
    x = torch.randint(0, 200, (1, 16))
    torch.testing.assert_close(loaded(x).logits, trainer.model.eval()(x).logits)
    assert loaded.config.mixers == trainer.model.config.mixers
