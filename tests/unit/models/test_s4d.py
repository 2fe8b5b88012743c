"""The S4D mixer (ssmkit.models.s4d) and S4D language models.

Oracles: the recurrence (one token at a time) against the FFT convolution, outputs and gradients;
the kernel of the N/2 kept modes against the full real SSM of size N; each prompt alone against a
padded batch or packed row; generation without the cache; the saved checkpoint loaded back.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import perturb_

import ssmkit
from ssmkit import ops
from ssmkit.data import make_task
from ssmkit.hub.layouts import CheckpointError
from ssmkit.models import ModelConfig, build_model
from ssmkit.models.s4d import S4D, DiagonalSSM
from ssmkit.models.ssm_config import S4DConfig
from ssmkit.train import train_on_task

TOL = 1e-5  # fp32, relative to the largest output


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def mixer(seed=0, **cfg) -> S4D:
    torch.manual_seed(seed)
    layer = S4D(16, S4DConfig(**{"d_state": 8, **cfg}))
    return perturb_(layer, seed + 1)


def stepwise(layer, x: torch.Tensor) -> torch.Tensor:
    """The recurrent mode: one token at a time from a zero state."""
    state = layer.allocate_state(x.shape[0], x.dtype, x.device)
    return torch.cat([layer.step(x[:, t : t + 1], state) for t in range(x.shape[1])], dim=1)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(init="lin", disc="zoh"),
        dict(init="inv", disc="bilinear"),
        dict(init="legs", disc="zoh", expand=1, bias=False),
        dict(init="random", disc="bilinear", d_state=6),
    ],
)
def test_convolution_equals_recurrence_with_gradients(cfg):
    layer = mixer(**cfg)
    x = torch.randn(2, 23, 16, generator=torch.Generator().manual_seed(3))
    w = torch.randn(2, 23, 16)
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


def test_the_kept_modes_give_the_kernel_of_the_real_ssm_of_size_n():
    """S4D keeps N/2 complex modes, one of each conjugate pair: 2·Re of their kernel is the kernel
    of the real SSM with all N (the oracle in float64 from the module's parameters)."""
    torch.manual_seed(0)
    ssm = perturb_(DiagonalSSM(3, 8, "legs", "zoh", 0.01, 0.1), 0).requires_grad_(False)
    A = ssm.A().to(torch.complex128)
    C = torch.view_as_complex(ssm.C.double().contiguous())
    full = [torch.cat([t, t.conj()], -1) for t in (A, torch.ones_like(A), C)]
    Ab, Bb = ops.discretize(full[0], full[1], ssm.log_dt.double().exp(), "zoh")
    K = ops.kernel_by_powers(Ab, Bb, full[2], 30)
    assert float(K.imag.abs().max()) < 1e-12 * float(K.abs().max())
    assert rel(ssm.kernel(30).double(), K.real) < TOL  # the module computes in complex64


def test_initialisation_is_s4ds():
    layer = S4D(16, S4DConfig(d_state=8, init="inv", dt_min=0.01, dt_max=0.02))
    A = layer.ssm.A()
    assert A.shape == (32, 4)  # H = expand · d_model channels, N/2 modes
    assert torch.allclose(A.detach().to(torch.complex128), ops.s4d_init("inv", 8, 32), atol=1e-5)
    dt = layer.ssm.log_dt.exp()
    assert bool((dt >= 0.01 - 1e-6).all() and (dt <= 0.02 + 1e-6).all())
    assert layer.ssm.C.shape == (32, 4, 2)
    with torch.no_grad():  # any value of the parameter keeps A stable
        layer.ssm.log_A_real.normal_(0, 5)
    assert bool((layer.ssm.A().real < 0).all())
    assert {n for n, p in layer.named_parameters() if getattr(p, "_no_weight_decay", False)} == {
        "ssm.log_dt",
        "ssm.log_A_real",
        "ssm.A_imag",
    }


def tiny(**overrides):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny-s4d", d_model=32, n_layer=2, vocab_size=64, **overrides)
    return perturb_(ssmkit.build_model(cfg), 1).eval()


def test_prefill_in_pieces_steps_and_generation_equal_the_full_forward():
    model = tiny()
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_cache(2)
        parts = [model(ids[:, :11], cache=cache).logits, model(ids[:, 11:24], cache=cache).logits]
        parts += [model(ids[:, t : t + 1], cache=cache).logits for t in range(24, 30)]
    assert rel(torch.cat(parts, dim=1), full) < TOL
    before = cache.nbytes()
    with torch.no_grad():
        model(ids[:, :1], cache=cache)
    assert cache.nbytes() == before == 2 * 2 * 64 * 16 * 8  # layers, batch, H, N/2, complex64
    fast = ssmkit.generate(model, ids[:, :7], max_new_tokens=16, temperature=0)
    slow = ssmkit.generate(model, ids[:, :7], max_new_tokens=16, temperature=0, use_cache=False)
    assert torch.equal(fast, slow)


def test_left_padding_and_packed_rows_equal_each_prompt_alone():
    model = tiny()
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


def test_bf16_keeps_the_ssm_parameters_fp32():
    model = tiny().to(torch.bfloat16)
    layer = model.backbone.layers[0].mixer
    kept = {n: p.dtype for n, p in layer.named_parameters()}
    assert kept["in_proj.weight"] == torch.bfloat16
    assert {kept[n] for n in ("D", "ssm.log_dt", "ssm.log_A_real", "ssm.A_imag", "ssm.C")} == {
        torch.float32
    }
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits.float()).all()


def test_train_on_task_lowers_the_loss():
    task = make_task("mqar", vocab_size=17, seq_len=16, num_kv_pairs=2)
    cfg = ModelConfig.preset("tiny-s4d", d_model=32, n_layer=2, vocab_size=17)
    untrained = train_on_task(build_model(cfg, seed=0), task, steps=1, batch=1, lr=1e-9)
    trained = train_on_task(build_model(cfg, seed=0), task, steps=40, batch=16, lr=3e-3)
    assert trained["loss"] < untrained["loss"] - 0.3, (untrained, trained)


def test_saves_in_mamba_ssms_layout_and_loads_back(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["ssm_cfg"] == {"layer": "S4D", **model.config.s4d.to_dict()}
    back = ssmkit.from_pretrained(tmp_path / "m")
    assert back.config == model.config
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    with pytest.raises(CheckpointError, match="transformers has no S4D model"):
        model.save_pretrained(tmp_path / "hf", format="hf")


def test_with_mixer_gives_s4d_layers_of_fair_size():
    base = ModelConfig.preset("tiny-hybrid", d_model=128)
    cfg = base.with_mixer("s4d")
    assert cfg.mixers == ["s4d", "s4d", "attn", "s4d"]
    assert cfg.s4d.d_state == 32 and cfg.s4d.expand == base.mamba1.expand
    assert ModelConfig.preset("tiny", d_model=768).with_mixer("s4d").s4d.d_state == 64
    assert cfg.with_mixer("mamba1").mamba1 == base.mamba1


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("d_state", 7, "s4d.d_state must be even"),
        ("init", "hippo", "s4d.init='hippo' is not valid; valid: legs, lin, inv, random"),
        ("disc", "euler", "s4d.disc='euler' is not valid; valid: zoh, bilinear"),
        ("dt_max", 1e-4, "s4d.dt_max"),
    ],
)
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(d_model=32, n_layer=1, vocab_size=10, mixer="s4d", s4d={field: value})
