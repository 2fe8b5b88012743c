"""Mamba-3: the scan's three views agree, generation equals the forward pass, MIMO rank 1 is SISO,
it trains.

Oracles: the step-by-step recurrence (ops.mamba3_reference), which
tests/unit/ops/test_cuda_dispatch.py and the closing note also check against mamba_ssm's own test
references; a second path through the code (the chunked scan, the quadratic form, one-step
generation, a left-padded batch); closed forms (the heavy-tail activation, parameter counts, FLOPs).
Tolerance: fp32, relative 1e-4 of the largest value.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import losses, perturb_, small

import ssmkit
from ssmkit import ops
from ssmkit.models import ModelConfig
from ssmkit.models.config import ConfigError
from ssmkit.ops.tolerances import FP32_REL
from ssmkit.train import Trainer

TOL = FP32_REL  # ssmkit's fp32 bound (1e-4)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def circular(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of two angles, modulo 2π (θ near 0 and near 2π are the same angle)."""
    return float(
        (torch.remainder(a.detach() - b.detach() + math.pi, 2 * math.pi) - math.pi).abs().max()
    )


def scan_inputs(
    seed, L, rank=1, mimo=False, ngroups=1, n=8, S=2, init=False, gate=True, h=4, p=4, b=2
):
    """Leaf tensors (requires_grad) for ops.mamba3_scan: Δ in (0.01, 1), A in (-3, -0.05), λ around
    1/2."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    kw = dict(
        x=rnd(b, L, h, p),
        dt=torch.rand(b, L, h, generator=g) + 0.01,
        A=-3 * torch.rand(b, L, h, generator=g) - 0.05,
        trap=rnd(b, L, h),
        B=rnd(b, L, rank, ngroups, n),
        C=rnd(b, L, rank, ngroups, n),
        angles=2 * rnd(b, L, h, S),
        B_bias=rnd(h, rank, n),
        C_bias=rnd(h, rank, n),
        D=rnd(h),
        z=rnd(b, L, h, p) if gate else None,
    )
    if mimo:
        kw.update(mimo_x=rnd(h, rank, p), mimo_z=rnd(h, rank, p), mimo_o=rnd(h, rank, p))
    if init:
        kw["initial_states"] = (
            2 * math.pi * torch.rand(b, h, S, generator=g),
            rnd(b, h, p, n),
            rnd(b, rank, h, n),
            rnd(b, h, p),
        )
    for k, v in kw.items():
        for t in v if isinstance(v, tuple) else (v,):
            if t is not None:
                t.requires_grad_(True)
    return kw


def leaves(kw):
    return [t for v in kw.values() for t in (v if isinstance(v, tuple) else (v,)) if t is not None]


def run_with_grads(fn, kw, seed, **extra):
    """y, final states and the gradients of every input for the same random cotangents."""
    y, states = fn(**kw, return_final_states=True, **extra)
    g = torch.Generator().manual_seed(seed)
    outs = [y, *states]
    grads = torch.autograd.grad(outs, leaves(kw), [torch.randn(o.shape, generator=g) for o in outs])
    return y, states, grads


SCANS = {  # name: (scan_inputs arguments, chunk sizes to try)
    "siso": (dict(L=29), (4, 8, 64)),
    "siso-one-step": (dict(L=1), (4,)),
    "siso-groups-full-rope-init": (dict(L=23, ngroups=2, S=4, init=True), (5, 64)),
    "siso-no-gate-init": (dict(L=17, gate=False, init=True), (8,)),
    "mimo-rank1": (dict(L=19, rank=1, mimo=True), (4, 8)),
    "mimo-rank2-groups-init": (dict(L=21, rank=2, mimo=True, ngroups=2, init=True), (4, 16)),
    "mimo-rank3-full-rope": (dict(L=13, rank=3, mimo=True, S=4), (5,)),
    "mimo-rank4-init": (dict(L=18, rank=4, mimo=True, init=True), (4, 8)),
}


@pytest.mark.parametrize("case", list(SCANS))
def test_chunked_and_quadratic_equal_the_recurrence_with_gradients(case):
    args, chunks = SCANS[case]
    kw = scan_inputs(1, **args)
    y_ref, s_ref, g_ref = run_with_grads(ops.mamba3_reference, kw, 2)
    views = [(f"chunk {q}", ops.mamba3_chunked, dict(chunk_size=q)) for q in chunks]
    for name, fn, extra in views + [("quadratic", ops.mamba3_quadratic, {})]:
        y, states, grads = run_with_grads(fn, kw, 2, **extra)
        assert rel(y, y_ref) < TOL, (case, name)
        assert circular(states.angle, s_ref.angle) < TOL, (case, name)
        for mine, ref in zip(states[1:], s_ref[1:]):
            assert rel(mine, ref) < TOL, (case, name)
        for i, (mine, ref) in enumerate(zip(grads, g_ref)):
            assert rel(mine, ref) < TOL, (case, name, i)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize(
    "case", ["siso-groups-full-rope-init", "mimo-rank3-full-rope", "mimo-rank4-init"]
)
def test_steps_equal_the_scan(case, backend):
    kw = scan_inputs(3, **SCANS[case][0])
    kw = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    start = kw.pop("initial_states", None)
    y, final = ops.mamba3_chunked(**kw, initial_states=start, return_final_states=True)
    b, L, h, p = kw["x"].shape
    states = [s.clone() for s in start] if start else [torch.zeros(s.shape) for s in final]
    per_step = ("x", "dt", "A", "trap", "B", "C", "angles", "z")
    at = lambda t: {k: v[:, t] if k in per_step and v is not None else v for k, v in kw.items()}  # noqa: E731
    ys = [ops.mamba3_step(states, **at(t), backend=backend) for t in range(L)]
    assert rel(torch.stack(ys, dim=1), y) < TOL
    assert circular(states[0], final.angle) < TOL
    assert all(rel(mine, ref) < TOL for mine, ref in zip(states[1:], final[1:]))


def test_mimo_without_mimo_o_returns_each_rank():
    kw = {k: v.detach() for k, v in scan_inputs(4, L=9, rank=2, mimo=True).items()}
    per_rank = ops.mamba3_scan(**{**kw, "mimo_o": None})
    assert per_rank.shape == (2, 9, 2, 4, 4)
    summed = (per_rank * kw["mimo_o"].transpose(0, 1)).sum(dim=2)
    assert rel(summed, ops.mamba3_scan(**kw)) < TOL


def test_heavy_tail_activation_closed_form():
    a = torch.tensor([-3.0, -1.0, 0.0, 1.0, 2.5], requires_grad=True)
    f = ops.heavy_tail(a)
    assert torch.allclose(f, torch.tensor([0.25, 0.5, 1.0, 2.0, 3.5]))
    f.sum().backward()
    assert torch.allclose(
        a.grad, torch.tensor([1 / 16, 0.25, 1.0, 1.0, 1.0])
    )  # 1/(1-a)² below 0, 1 above
    assert float(ops.heavy_tail(torch.tensor(-50.0))) > 100 * float(
        ops.a_activation(torch.tensor(-50.0), "softplus")
    )
    with pytest.raises(ValueError, match="valid: heavy_tail, softplus"):
        ops.a_activation(a, "relu")
    assert [ops.rope_angles(128, 0.5), ops.rope_angles(128, 1.0), ops.rope_angles(6, 0.5)] == [
        32,
        64,
        1,
    ]


# --------------------------------------------------------------------------------------------
# the mixer and the language model
# --------------------------------------------------------------------------------------------


def model_for(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = ModelConfig.preset(
        "tiny-mamba3",
        d_model=32,
        n_layer=2,
        vocab_size=64,
        d_state=16,
        headdim=8,
        chunk_size=8,
        **overrides,
    )
    return perturb_(
        ssmkit.build_model(cfg), seed + 1
    )  # off the init (biases 1, D = 1) so nothing hides


MODELS = {
    "siso": dict(),
    "siso-softplus-full-rope-groups-norm": dict(
        a_activation="softplus", rope_fraction=1.0, ngroups=2, is_outproj_norm=True
    ),
    "mimo-rank1": dict(is_mimo=True, mimo_rank=1),
    "mimo-rank2-full-rope": dict(is_mimo=True, mimo_rank=2, rope_fraction=1.0),
    "mimo-rank3-groups-norm-softplus": dict(
        is_mimo=True, mimo_rank=3, ngroups=2, is_outproj_norm=True, a_activation="softplus"
    ),
    "mimo-rank4": dict(is_mimo=True, mimo_rank=4),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_model_logits_and_gradients_match_the_reference_backend(monkeypatch, case):
    ids = torch.randint(
        0, 64, (2, 21), generator=torch.Generator().manual_seed(7)
    )  # not a multiple of 8
    out = {}
    for backend in ("reference", "torch"):
        monkeypatch.setenv("SSMKIT_BACKEND", backend)
        model = model_for(**MODELS[case])
        result = model(ids, labels=ids)
        result.loss.backward()
        out[backend] = result.logits, {n: p.grad for n, p in model.named_parameters()}
    (ref_logits, ref_grads), (logits, grads) = out["reference"], out["torch"]
    assert rel(logits, ref_logits) < TOL
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert rel(grads[name], ref_grads[name]) < TOL, name


def test_a_activation_changes_the_model():
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(8))
    heavy, soft = model_for(), model_for(a_activation="softplus")
    soft.load_state_dict(heavy.state_dict())
    with torch.no_grad():
        assert rel(heavy(ids).logits, soft(ids).logits) > 1e-3


@pytest.mark.parametrize("case", ["siso", "mimo-rank3-groups-norm-softplus", "mimo-rank4"])
def test_cache_prefill_in_pieces_and_steps_match_full_forward(case):
    model = model_for(**MODELS[case]).eval()
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_cache(2)
        parts = [model(ids[:, :17], cache=cache).logits, model(ids[:, 17:35], cache=cache).logits]
        parts += [model(ids[:, t : t + 1], cache=cache).logits for t in range(35, 40)]
    assert cache.seqlen_offset == 40 and all(s.seen == 40 for s in cache.layers)
    assert rel(torch.cat(parts, dim=1), full) < TOL
    fast = ssmkit.generate(model, ids[:, :9], max_new_tokens=20, temperature=0)
    slow = ssmkit.generate(model, ids[:, :9], max_new_tokens=20, temperature=0, use_cache=False)
    assert torch.equal(fast, slow)


def test_cache_memory_is_constant_in_length():
    model = model_for(is_mimo=True, mimo_rank=2)
    cache = model.allocate_cache(1)
    before = cache.nbytes()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 100)), cache=cache)
        for _ in range(5):
            model(torch.randint(0, 64, (1, 1)), cache=cache)
    assert cache.nbytes() == before
    layer = cache.layers[0]
    assert (layer.angle.shape, layer.ssm.shape, layer.k.shape, layer.v.shape) == (
        (1, 8, 4),
        (1, 8, 8, 16),
        (1, 2, 8, 16),
        (1, 8, 8),
    )


@pytest.mark.parametrize("case", ["siso", "mimo-rank2-full-rope"])
def test_left_padding_leaves_no_trace(case):
    model = model_for(**MODELS[case]).eval()
    prompts = [
        torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 3, 14)
    ]
    width = 14
    ids = torch.randint(
        0, 64, (3, width), generator=torch.Generator().manual_seed(5)
    )  # random padding
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    with torch.no_grad():
        padded, unmasked = model(ids, attention_mask=mask).logits, model(ids).logits
        for i, p in enumerate(prompts):
            alone = model(p[None]).logits[0]
            assert rel(padded[i, width - len(p) :], alone) < TOL
            if len(p) < width:  # the control: without the mask the padding shows
                assert rel(unmasked[i, width - len(p) :], alone) > 1e-3
    out = ssmkit.generate(model, ids, max_new_tokens=6, temperature=0, attention_mask=mask)
    for i, p in enumerate(prompts):
        alone = ssmkit.generate(model, p[None], max_new_tokens=6, temperature=0)
        assert torch.equal(out[i, width:], alone[0, len(p) :])


def test_mimo_rank_one_is_siso_with_the_state_pairs_reordered():
    """MIMO rotates dimensions (i, i + N/2), SISO (2i, 2i+1); with rank 1 and mimo_x = mimo_z =
    mimo_o = 1 (their init) the two are the same model once B's and C's dimensions (projection rows,
    biases, norm weights) are put in the other order. Loaded without that reordering the logits
    differ: the pairing is part of a checkpoint."""
    siso = model_for(rope_fraction=1.0).eval()
    mimo = model_for(rope_fraction=1.0, is_mimo=True, mimo_rank=1).eval()
    N, G, E = 16, 1, 64
    perm = torch.cat(
        [torch.arange(0, N, 2), torch.arange(1, N, 2)]
    )  # MIMO dim j holds SISO dim perm[j]
    rows = torch.arange(2 * E + 2 * N * G + 3 * 8 + N // 2)
    for start in (2 * E, 2 * E + N * G):  # B's rows, then C's
        rows[start : start + N] = start + perm
    state = dict(siso.state_dict())
    for i in range(2):
        p = f"backbone.layers.{i}.mixer."
        state[p + "in_proj.weight"] = state[p + "in_proj.weight"][rows]
        for name in ("B_bias", "C_bias", "B_norm.weight", "C_norm.weight"):
            state[p + name] = state[p + name][..., perm]
        state.update({p + k: torch.ones(8, 1, 8) for k in ("mimo_x", "mimo_z", "mimo_o")})
    mimo.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert rel(mimo(ids).logits, siso(ids).logits) < TOL
        unordered = {k: v for k, v in siso.state_dict().items()}
        unordered.update({k: v for k, v in state.items() if "mimo_" in k})
        mimo.load_state_dict(unordered)
        assert rel(mimo(ids).logits, siso(ids).logits) > 1e-3


def test_parameters_shapes_init_and_fp32_under_bf16():
    cfg = ModelConfig.preset("tiny-mamba3", is_mimo=True, mimo_rank=2, is_outproj_norm=True)
    mixer = ssmkit.build_model(cfg).backbone.layers[0].mixer
    E, N, H, P, S = 128, 32, 8, 16, 8
    shapes = {k: tuple(v.shape) for k, v in mixer.state_dict().items()}
    assert shapes == {
        "in_proj.weight": (2 * E + 2 * N * 2 + 3 * H + S, 64),
        "dt_bias": (H,),
        "B_bias": (H, 2, N),
        "C_bias": (H, 2, N),
        "B_norm.weight": (N,),
        "C_norm.weight": (N,),
        "mimo_x": (H, 2, P),
        "mimo_z": (H, 2, P),
        "mimo_o": (H, 2, P),
        "D": (H,),
        "norm.weight": (E,),
        "out_proj.weight": (64, E),
    }
    assert torch.equal(mixer.B_bias, torch.ones(H, 2, N))
    assert torch.equal(mixer.mimo_x, torch.full((H, 2, P), 0.5))
    dt = torch.nn.functional.softplus(mixer.dt_bias.detach())
    assert 1e-3 <= float(dt.min()) and float(dt.max()) <= 0.1 + 1e-6
    half = ssmkit.build_model(cfg, dtype=torch.bfloat16)
    kinds = {
        n.split(".")[-1] if "norm" not in n else n: p.dtype
        for n, p in half.backbone.layers[0].mixer.named_parameters()
    }
    assert {k for k, v in kinds.items() if v == torch.float32} == {
        "dt_bias",
        "B_bias",
        "C_bias",
        "mimo_x",
        "mimo_z",
        "mimo_o",
        "D",
    }
    assert half(torch.randint(0, 256, (1, 5))).logits.dtype == torch.bfloat16


def test_preset_sizes_and_flops_closed_forms():
    with torch.device("meta"):
        model = ssmkit.models.MambaLM(ModelConfig.preset("mamba3-130m"))
    d, E, N, H, S, V = 768, 1536, 128, 24, 32, 50288
    per_layer = d * (2 * E + 2 * N + 3 * H + S) + E * d + H + 2 * H * N + 2 * N + H + d
    assert model.num_parameters() == V * d + 24 * per_layer + d == 130_365_312
    from ssmkit.eval import flops_per_token

    tiny = ssmkit.build_model(ModelConfig.preset("tiny-mamba3", is_mimo=True, mimo_rank=2))
    linear = sum(m.weight.numel() for m in tiny.modules() if isinstance(m, torch.nn.Linear))
    q, r, h, n, p = 64, 2, 8, 32, 16
    assert flops_per_token(tiny, 1000) == 6 * linear + 4 * 3 * h * (
        2 * q * r * r * (n + p) + 4 * r * n * p
    )


def test_hybrid_layouts_with_mamba3():
    cfg = ModelConfig(
        d_model=32,
        n_layer=4,
        vocab_size=64,
        layout=["mamba3", "attn", "mamba1", "mamba3"],
        d_state=16,
        headdim=8,
        d_intermediate=48,
        attn_cfg=dict(num_heads=2),
    )
    assert cfg.mixers == ["mamba3", "attn", "mamba1", "mamba3"] and cfg.mamba3.chunk_size == 64
    model = perturb_(ssmkit.build_model(cfg), 2).eval()
    assert type(model.backbone.layers[0].mixer).__name__ == "Mamba3"
    ids = torch.randint(0, 64, (2, 15), generator=torch.Generator().manual_seed(3))
    fast = ssmkit.generate(model, ids, max_new_tokens=8, temperature=0)
    assert torch.equal(
        fast, ssmkit.generate(model, ids, max_new_tokens=8, temperature=0, use_cache=False)
    )
    every = ModelConfig(
        d_model=32,
        n_layer=4,
        vocab_size=64,
        mixer="mamba3",
        d_state=16,
        headdim=8,
        attn_every=2,
        attn_offset=1,
        attn_cfg=dict(num_heads=2),
    )
    assert every.mixers == ["mamba3", "attn", "mamba3", "attn"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rope_fraction", 0.25, "rope_fraction must be one of 0.5, 1.0"),
        ("rope_fraction", True, "rope_fraction must be one of"),
        ("a_activation", "relu", "a_activation='relu' is not valid; valid: heavy_tail, softplus"),
        ("A_floor", 0, "A_floor must be a positive number"),
        ("mimo_rank", 0, "mimo_rank must be a positive integer"),
        ("is_mimo", "yes", "is_mimo must be true or false"),
        ("d_state", 7, "d_state must be even and at least 4 for mamba3"),
        ("bias", True, "bias must be false for mamba3"),
    ],
)
def test_config_errors_name_the_field_and_the_valid_values(field, value, message):
    """Each names the field as the mamba3 group's (bias, which Mamba-3 has not, flat as before),
    given in the group or flat (the short form)."""
    path = field if field == "bias" else f"mamba3.{field}"
    for kwargs in ({field: value}, {"mamba3": {field: value}}):
        if field == "bias" and "mamba3" in kwargs:
            continue
        with pytest.raises(ConfigError, match=message) as err:
            ModelConfig.preset("tiny-mamba3", **kwargs)
        assert err.value.field == path
    with pytest.raises(ValueError, match="valid mixers: mamba1, mamba2, mamba3, attn, swa"):
        ModelConfig(mixer="mamba4")


def test_trainer_loss_falls(tmp_path, shards):
    cfg = small(
        tmp_path,
        shards,
        model="tiny-mamba3",
        max_steps=8,
        model_overrides={"d_model": 32, "n_layer": 2, "d_state": 16, "headdim": 16},
    )
    history = losses(Trainer(config=cfg).fit())
    assert history[-1] < history[0] - 0.3, history
