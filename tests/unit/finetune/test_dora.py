"""DoRA (Liu et al. 2024; peft's ``use_dora``) on ssmkit models.

Oracles: peft's own DoRA forward (its wrapper called as a module) for what ssmkit's raw read of
dt_proj computes, values and gradients, with and without live dropout; peft's ``merge_and_unload``
(merged == unmerged); transformers' MambaForCausalLM / Mamba2ForCausalLM with peft's
``PeftModel.from_pretrained`` on a local directory for the saved adapter's meaning. Tolerance: fp32
1e-5 (1e-6 where both sides compute the same products; the gradients 1e-5 relative as well, the
magnitude's being a sum over positions).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import perturb_

import ssmkit
from ssmkit.finetune import (
    adapter_for_transformers,
    apply_lora,
    export_for_transformers,
    load_adapter,
    merge,
    save_adapter,
    trainable_share,
)
from ssmkit.models import lora_aware
from ssmkit.ops import backend

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

V = 48
ATOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is fastest on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(mixer="mamba1", seed=0, **kw) -> ssmkit.MambaLM:
    torch.manual_seed(seed)
    cfg = ssmkit.ModelConfig(
        d_model=32, n_layer=2, vocab_size=V, mixer=mixer, d_state=8, headdim=16, chunk_size=8, **kw
    )
    return perturb_(ssmkit.build_model(cfg), seed + 1)


def dora(model, targets=("in_proj", "x_proj", "dt_proj", "out_proj"), dropout=0.0, **kw):
    """A DoRA adapter that changes the model: B random, the magnitudes moved off their init (where
    m = ‖W + ΔW‖ makes the scale 1)."""
    torch.manual_seed(5)
    lora = apply_lora(
        model,
        r=4,
        alpha=8,
        dropout=dropout,
        target_modules=list(targets),
        init_lora_weights=False,
        use_dora=True,
        **kw,
    )
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return lora


def ids(seed=1, n=10):
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def test_the_raw_read_of_dt_proj_computes_peft_s_dora_values_and_gradients():
    """lora_aware.linear_no_bias(x, dt_proj) == peft's DoRA forward minus the bias, and the
    gradients of A, B and the magnitude agree: in eval mode (the weight form, the norm detached)
    and in training mode with live dropout (the same RNG draws: peft's dropout form)."""
    lora = dora(tiny(), ["dt_proj"], dropout=0.3)
    dt_proj = lora.base_model.model.backbone.layers[0].mixer.dt_proj
    assert lora_aware.is_dora(dt_proj, "default")
    params = [
        dt_proj.lora_A["default"].weight,
        dt_proj.lora_B["default"].weight,
        dt_proj.lora_magnitude_vector["default"].weight,
    ]
    x = torch.randn(3, 5, dt_proj.in_features, generator=torch.Generator().manual_seed(2))
    for mode in ("eval", "train"):
        getattr(lora, mode)()
        results = []
        for fn in (
            lambda: lora_aware.linear_no_bias(x, dt_proj),
            lambda: dt_proj(x) - dt_proj.bias,
        ):
            torch.manual_seed(7)
            y = fn()
            grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1])).sum(), params)
            results.append((y, grads))
        (ours, ours_g), (theirs, theirs_g) = results
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        for a, b in zip(ours_g, theirs_g):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # sums of ~10 terms
    lora.eval()
    w0 = dt_proj.base_layer.weight
    delta = 2.0 * dt_proj.lora_B["default"].weight @ dt_proj.lora_A["default"].weight  # alpha / r
    m = dt_proj.lora_magnitude_vector["default"].weight
    want = (m / torch.linalg.norm(w0 + delta, dim=1))[:, None] * (w0 + delta)  # DoRA's eq. 5
    torch.testing.assert_close(lora_aware.weight(dt_proj), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["torch", "cuda"])
def test_every_dora_parameter_gets_a_gradient(name, monkeypatch, fake_kernels):  # noqa: F811
    if name == "cuda":  # the kernel stand-ins of tests/fake_kernels.py
        monkeypatch.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
    else:
        monkeypatch.setenv("SSMKIT_BACKEND", name)
    lora = dora(tiny(), dropout=0.1).train()
    x = ids()
    lora(x, labels=x).loss.backward()
    trainable = [(n, p) for n, p in lora.named_parameters() if p.requires_grad]
    kinds = trainable_share(lora)["by_kind"]
    assert set(kinds) == {"lora_A", "lora_B", "lora_magnitude_vector"}
    assert sum(".lora_magnitude_vector." in n for n, _ in trainable) == 2 * 4  # per adapted Linear
    assert [n for n, p in trainable if p.grad is None or not p.grad.any()] == []


def test_dora_trains_a_tiny_task():
    """Memorising one batch: the loss drops by a third in 15 AdamW steps; the magnitudes move."""
    lora = dora(tiny(seed=3), dropout=0.0).train()
    mags = {n: p.detach().clone() for n, p in lora.named_parameters() if "magnitude" in n}
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=2e-2)
    x = ids(9, n=16)
    losses = []
    for _ in range(15):
        loss = lora(x, labels=x).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.67 * losses[0], losses
    assert all(
        (p - mags[n]).abs().max() > 1e-3 for n, p in lora.named_parameters() if "magnitude" in n
    )


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2"])
def test_merged_equals_unmerged(mixer):
    """Every Linear target (dt_proj's raw read included) and a tied embedding (untied first)."""
    targets = ["in_proj", "out_proj", "embedding"] + (
        ["x_proj", "dt_proj"] if mixer == "mamba1" else []
    )
    lora = dora(tiny(mixer), targets).eval()
    x = ids(2)
    with torch.no_grad():
        unmerged = lora(x).logits
        with lora.disable_adapter():
            plain = lora(x).logits
        merged = merge(lora)
        assert isinstance(merged, ssmkit.MambaLM)
        diff = max_diff(merged(x).logits, unmerged)
    assert diff <= ATOL, f"merged vs unmerged {diff:.2e}"
    assert max_diff(unmerged, plain) > 1e-2  # the adapter matters


def test_dora_saves_in_peft_s_format_and_loads_back(tmp_path):
    base = tiny()
    base.save_pretrained(tmp_path / "base")
    lora = dora(base).eval()
    save_adapter(lora, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["peft_type"] == "LORA"
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    mags = sorted(k for k in tensors if "lora_magnitude_vector" in k)
    assert len(mags) == 8 and all(k.endswith(".lora_magnitude_vector") for k in mags)
    dt = "base_model.model.backbone.layers.0.mixer.dt_proj.lora_magnitude_vector"
    assert tensors[dt].shape == (base.backbone.layers[0].mixer.d_inner,)  # one per output row
    x = ids(3)
    with torch.no_grad():
        want = lora(x).logits
        ours = load_adapter(ssmkit.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
        theirs = peft.PeftModel.from_pretrained(
            ssmkit.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
        )
        torch.testing.assert_close(ours(x).logits, want, rtol=0, atol=0)
        torch.testing.assert_close(theirs.eval()(x).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2"])
def test_a_dora_adapter_loads_onto_transformers_with_peft_and_ssmkit_s_logits(tmp_path, mixer):
    """Mamba-2: the adapter (in_proj, out_proj folded) as it is; Mamba-1: dt_proj and out_proj
    folded into the exported base by export_for_transformers, in_proj and x_proj a DoRA adapter
    that peft loads onto MambaForCausalLM."""
    base = tiny(mixer)
    lora = dora(
        base, ["in_proj", "out_proj"] + (["x_proj", "dt_proj"] if mixer == "mamba1" else [])
    ).eval()
    x = ids(4)
    with torch.no_grad():
        want = lora(x).logits[..., :V]
    base_dir, adapter_dir = export_for_transformers(
        lora, tmp_path / "hf-base", tmp_path / "hf-adapter"
    )
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["use_dora"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
        hf_lora = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    assert type(hf).__name__ == {"mamba1": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}[mixer]
    with torch.no_grad():
        theirs = hf_lora(x).logits[..., :V]
    assert max_diff(theirs, want) <= ATOL, f"{mixer}: {max_diff(theirs, want):.2e}"
    if mixer == "mamba2":  # no folded module needed when the targets are in_proj only
        base2 = tiny(mixer).save_pretrained(tmp_path / "b2", format="hf")
        only_in = dora(tiny(mixer), ["in_proj"]).eval()
        save_adapter(only_in, tmp_path / "a2")
        adapter_for_transformers(
            tmp_path / "a2", tmp_path / "a2-hf", only_in.get_base_model().config
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf2 = peft.PeftModel.from_pretrained(
                transformers.AutoModelForCausalLM.from_pretrained(base2), tmp_path / "a2-hf"
            ).eval()
        with torch.no_grad():
            assert max_diff(hf2(x).logits[..., :V], only_in(x).logits[..., :V]) <= ATOL


def test_what_dora_cannot_do_is_refused_clearly():
    with pytest.raises(ValueError, match="depthwise causal conv"):
        apply_lora(tiny(), target_modules=["conv1d"], use_dora=True)
    with pytest.raises(ValueError, match="lora_bias=True is not supported for DoRA"):
        apply_lora(tiny(), target_modules=["in_proj"], use_dora=True, lora_bias=True)
    with pytest.raises(ValueError, match="use_dora must be true or false; got 'yes'"):
        apply_lora(tiny(), use_dora="yes")
