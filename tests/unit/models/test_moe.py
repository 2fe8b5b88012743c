"""The mixture-of-experts MLP (ssmkit.models.moe): routing against a per-token loop over the
experts, the load-balancing loss against a hand computation, transformers' function and its closed
form at a uniform router, the LM's loss and aux loss, activation checkpointing, cached generation,
the config's checks, active parameters and FLOPs, and the dense default unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import perturb_
from transformers.models.jamba.modeling_jamba import load_balancing_loss_func

import ssmkit
from ssmkit.eval import flops_per_token
from ssmkit.models import ConfigError, GatedMLP, ModelConfig, SparseMoE, load_balancing_loss

MOE = dict(
    d_model=32,
    n_layer=4,
    vocab_size=100,
    mixer="mamba1",
    d_state=8,
    d_intermediate=48,
    num_experts=4,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    router_aux_loss_coef=0.05,
)


def naive_moe(moe: SparseMoE, x: torch.Tensor, renormalise: bool = False) -> torch.Tensor:
    """Token by token: the softmax over every expert, its k largest, the sum of those experts'
    outputs weighted by their probabilities (Jamba: not renormalised)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for t, token in enumerate(flat):
        p = torch.softmax(moe.router.weight @ token, dim=-1)
        chosen = sorted(range(moe.num_experts), key=lambda e: -p[e].item())[: moe.top_k]
        total = sum(p[e] for e in chosen) if renormalise else 1.0
        for e in chosen:
            out[t] += p[e] / total * moe.experts[e](token)
    return out.reshape(x.shape)


def test_routing_is_the_per_token_loop():
    torch.manual_seed(0)
    moe = perturb_(SparseMoE(d_model=16, d_intermediate=40, num_experts=5, top_k=2), 1).double()
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    got = moe(x)
    torch.testing.assert_close(got, naive_moe(moe, x), atol=1e-12, rtol=1e-10)
    # the weights are Jamba's, not renormalised over the k chosen (Mixtral's): the two differ
    assert (got - naive_moe(moe, x, renormalise=True)).abs().max() > 1e-3
    # fp32, and k = E (every expert, weights summing to 1)
    moe = perturb_(SparseMoE(16, 40, num_experts=3, top_k=3), 2)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(moe(x), naive_moe(moe, x), atol=1e-5, rtol=1e-5)


def test_an_expert_no_token_chose_still_gets_a_gradient():
    """Every expert runs (maybe on no token), so DDP finds no unused parameter."""
    torch.manual_seed(0)
    moe = SparseMoE(8, 16, num_experts=4, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2, 0] = 10.0  # every token with x[0] > 0 goes to expert 2 ...
    x = torch.randn(6, 8).abs()  # ... and every token has x[0] > 0
    moe(x).sum().backward()
    grads = [e.fc1.weight.grad for e in moe.experts]
    assert all(g is not None for g in grads)
    assert [bool(g.abs().sum() > 0) for g in grads] == [False, False, True, False]


def hand_aux(router_logits, E, k, mask=None) -> float:
    """E · Σ_i f_i · P_i, f and P pooled over every layer's tokens (Switch Transformer eqs. 4-6)."""
    counts, probs, rows = [0.0] * E, [0.0] * E, 0.0
    for logits in router_logits:
        for t, row in enumerate(logits.tolist()):
            w = 1.0 if mask is None else float(mask.reshape(-1)[t])
            z = sum(pow(2.718281828459045, v) for v in row)
            p = [pow(2.718281828459045, v) / z for v in row]
            for i in sorted(range(E), key=lambda i: -p[i])[:k]:
                counts[i] += w
            for i in range(E):
                probs[i] += w * p[i]
            rows += w
    return E * sum(c / rows * q / rows for c, q in zip(counts, probs))


def test_aux_loss_by_hand_transformers_and_closed_form():
    torch.manual_seed(0)
    E, k = 5, 2
    layers = [torch.randn(12, E, dtype=torch.float64) for _ in range(3)]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    for m in (None, mask):
        got = load_balancing_loss(layers, E, k, m)
        assert got.item() == pytest.approx(hand_aux(layers, E, k, m), rel=1e-6)  # fp32 sums
        theirs = load_balancing_loss_func(tuple(x.float() for x in layers), E, k, m)
        torch.testing.assert_close(got, theirs.float(), atol=1e-6, rtol=0)
    # a uniform router: P_i = 1/E and Σ_i f_i = k, so the loss is exactly k
    assert load_balancing_loss([torch.zeros(7, E)], E, k).item() == pytest.approx(k, abs=1e-6)
    # all tokens to the same k experts with probability ~1/k each: E · k · (1/k) = E
    peaked = torch.full((9, E), -30.0)
    peaked[:, :k] = 0
    assert load_balancing_loss([peaked], E, k).item() == pytest.approx(E, rel=1e-6)


def test_lm_loss_adds_the_aux_loss_and_returns_the_router_logits():
    torch.manual_seed(0)
    cfg = ModelConfig(**MOE)
    assert cfg.moe_layers == [1, 3]
    model = perturb_(ssmkit.build_model(cfg), 3)
    assert [type(b.mlp) for b in model.backbone.layers] == [GatedMLP, SparseMoE] * 2
    ids = torch.randint(0, 100, (2, 9))
    out = model(ids, labels=ids, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (18, 4)
    aux = load_balancing_loss(out.router_logits, 4, 2)
    torch.testing.assert_close(out.aux_loss, aux, atol=0, rtol=0)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, ce + 0.05 * aux, atol=1e-6, rtol=0)
    chunked = model(ids, labels=ids, loss_chunk_size=5)  # the chunked loss adds it too
    torch.testing.assert_close(chunked.loss, out.loss, atol=1e-6, rtol=0)
    plain = model(ids)  # no labels: no aux loss, nothing kept on the modules
    assert plain.aux_loss is None and plain.router_logits is None
    assert model(ids, labels=ids).router_logits is None
    copy.deepcopy(model)  # no graph tensor left behind (deepcopy refuses non-leaf tensors)


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = perturb_(ssmkit.build_model(ModelConfig(**{**MOE, "n_layer": 2})), 4).train()
    ids = torch.randint(0, 100, (2, 10))
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        model.backbone.gradient_checkpointing = recompute
        out = model(ids, labels=ids)
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-6, rtol=0)
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, atol=1e-6, rtol=1e-5, msg=name)
    router = grads[0][1]["backbone.layers.1.mlp.router.weight"]
    assert router.abs().sum() > 0
    copy.deepcopy(model)


def test_cached_generation_equals_the_full_forward():
    torch.manual_seed(0)
    attn = dict(n_layer=2, attn_every=2, attn_offset=0, attn_cfg=dict(num_heads=4))
    cfg = ModelConfig(**{**MOE, **attn, "expert_layer_period": 1, "expert_layer_offset": 0})
    model = perturb_(ssmkit.build_model(cfg), 5).eval()
    prompt = torch.randint(0, 100, (2, 5))
    cached = ssmkit.generate(model, prompt, max_new_tokens=6, temperature=0, use_cache=True)
    full = ssmkit.generate(model, prompt, max_new_tokens=6, temperature=0, use_cache=False)
    assert torch.equal(cached, full)


def test_dense_default_is_unchanged():
    cfg = ModelConfig(d_model=32, n_layer=2, vocab_size=100, d_intermediate=48)
    assert (cfg.num_experts, cfg.moe_layers) == (1, [])
    model = ssmkit.build_model(cfg, seed=0)
    names = [n for n, _ in model.backbone.layers[1].named_parameters()]
    assert names[-3:] == ["norm2.weight", "mlp.fc1.weight", "mlp.fc2.weight"]  # order kept
    ids = torch.randint(0, 100, (2, 8))
    out = model(ids, labels=ids)
    assert out.aux_loss is None and out.router_logits is None
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, ce, atol=0, rtol=0)
    # the MoE knobs only matter with num_experts > 1: the same seed gives the same weights
    same = ssmkit.build_model(ModelConfig(**{**cfg.to_dict(), "num_experts_per_tok": 1}), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    assert model.num_parameters(active=True) == model.num_parameters()


def test_active_parameters_and_flops_count_k_experts():
    moe = ssmkit.build_model(ModelConfig(**MOE))
    two = ssmkit.build_model(ModelConfig(**{**MOE, "num_experts": 2}))  # E = k: all active
    expert = moe.backbone.layers[1].mlp.expert_numel()
    router_rows = 2 * 32 * 2  # two MoE layers, two more router rows each, d_model 32
    assert moe.num_parameters() == two.num_parameters() + 2 * 2 * expert + router_rows
    assert moe.num_parameters(active=True) == two.num_parameters() + router_rows
    assert flops_per_token(moe, 64) == flops_per_token(two, 64) + 6 * router_rows


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(num_experts=0), "num_experts"),
        (dict(num_experts=2.5), "num_experts"),
        (dict(expert_layer_offset=2), "expert_layer_offset"),
        (dict(expert_layer_period=0), "expert_layer_period"),
        (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
        (dict(d_intermediate=0), "d_intermediate"),
    ],
)
def test_bad_expert_fields_name_the_field(change, field):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**MOE, **change})
    assert err.value.field == field, str(err.value)


def test_zamba2_refuses_experts():
    with pytest.raises(ConfigError, match="num_experts must be 1 for a Zamba2 model"):
        ModelConfig.preset("tiny-zamba2", num_experts=4, d_intermediate=32)


def test_config_round_trips_through_its_dict():
    cfg = ModelConfig(**MOE)
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.moe_layers == [1, 3]
