"""An ssmkit LoRA adapter for transformers' Mamba and FalconMamba: the dt_proj adapter their forward
would misread is refused, and the two exports that work give ssmkit's logits.

Oracles: transformers' MambaForCausalLM / FalconMambaForCausalLM (tiny configs built here, weights
moved off their init) with peft's own ``PeftModel.from_pretrained`` on a local directory; ssmkit's
unmerged LoRA model is the reference. The negative control loads the dt_proj adapter onto
transformers anyway (the refusal bypassed) and shows the logits it would give are wrong.
Tolerance: fp32 1e-5.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import perturb_

import ssmkit
from ssmkit.finetune import (
    NOT_FOR_TRANSFORMERS,
    adapter_for_transformers,
    apply_lora,
    export_for_transformers,
    export_merged,
    save_adapter,
)
from ssmkit.finetune.adapters import _to_transformers, _write, read_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ATOL = 1e-5
V = 48
TARGETS = ["in_proj", "x_proj", "dt_proj", "out_proj"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is fastest on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_base(kind: str, folder):
    """transformers' tiny Mamba or FalconMamba, saved to ``folder``; returns ssmkit's load of it."""
    torch.manual_seed(0)
    size = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, time_step_rank=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = (
            transformers.MambaForCausalLM(transformers.MambaConfig(**size))
            if kind == "mamba"
            else transformers.FalconMambaForCausalLM(
                transformers.FalconMambaConfig(**size, mixer_rms_eps=1e-5)
            )
        )
    perturb_(hf, 1).save_pretrained(folder)
    return ssmkit.from_pretrained(folder).eval()


def lora_on(model, targets=TARGETS, **kw):
    """A LoRA whose B is random and large enough that every target moves the logits."""
    torch.manual_seed(2)
    lora = apply_lora(
        model, r=4, alpha=8, dropout=0.0, target_modules=targets, init_lora_weights=False, **kw
    )
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    return lora.eval()


def ids(seed=3):
    return torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(seed))


def hf_load(base_dir, adapter_dir=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
        return hf if adapter_dir is None else peft.PeftModel.from_pretrained(hf, adapter_dir).eval()


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kind", ["mamba", "falcon_mamba"])
def test_a_dt_proj_adapter_is_refused_because_transformers_would_misread_it(tmp_path, kind):
    model = hf_base(kind, tmp_path / "base")
    lora = lora_on(model, ["in_proj", "dt_proj"])
    save_adapter(lora, tmp_path / "adapter")
    with pytest.raises(ValueError) as refused:
        adapter_for_transformers(tmp_path / "adapter", tmp_path / "hf-adapter", model.config)
    message = str(refused.value)
    for words in (
        "['dt_proj']",
        "read dt_proj.weight directly",
        "export_for_transformers",
        "export_merged",
    ):
        assert words in message, message
    assert not (tmp_path / "hf-adapter").exists()
    # the fact behind the refusal: written anyway, peft loads it and transformers ignores it
    saved, tensors = read_adapter(tmp_path / "adapter")
    _write(tmp_path / "forced", *_to_transformers(saved, tensors, str(tmp_path / "base")))
    x = ids()
    with torch.no_grad():
        want = lora(x).logits
        misread = hf_load(tmp_path / "base", tmp_path / "forced")(x).logits
    assert max_diff(misread, want) > 1e-3


@pytest.mark.parametrize("kind", ["mamba", "falcon_mamba"])
def test_both_exports_give_ssmkit_s_logits_on_transformers(tmp_path, kind):
    """export_for_transformers: dt_proj and out_proj folded into the base, in_proj and x_proj left
    as an adapter that peft loads; export_merged: everything merged. The LoRA model is unchanged by
    the first."""
    model = hf_base(kind, tmp_path / "base")
    lora = lora_on(model)
    x = ids()
    with torch.no_grad():
        want = lora(x).logits
    base_dir, adapter_dir = export_for_transformers(
        lora, tmp_path / "hf-base", tmp_path / "hf-adapter"
    )
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == ["in_proj", "x_proj"]
    assert config["base_model_name_or_path"] == str(base_dir)
    saved = read_adapter(adapter_dir)[1]
    assert saved and not any(k in n for n in saved for k in NOT_FOR_TRANSFORMERS)
    with torch.no_grad():
        assert max_diff(lora(x).logits, want) == 0  # the model itself is untouched
        hf_lora = hf_load(base_dir, adapter_dir)
        split = hf_lora(x).logits
        with hf_lora.disable_adapter():
            folded_only = hf_lora(x).logits
    assert max_diff(split, want) <= ATOL, f"split export: {max_diff(split, want):.2e}"
    assert max_diff(folded_only, want) > 1e-3  # the remaining adapter matters
    export_merged(lora, tmp_path / "merged", format="hf")
    with torch.no_grad():
        merged = hf_load(tmp_path / "merged")(x).logits
    assert max_diff(merged, want) <= ATOL, f"merged export: {max_diff(merged, want):.2e}"


def test_an_adapter_on_refused_modules_only_exports_as_the_merged_base(tmp_path):
    model = hf_base("mamba", tmp_path / "base")
    lora = lora_on(model, ["dt_proj", "out_proj"])
    x = ids(4)
    with torch.no_grad():
        want = lora(x).logits
    base_dir, adapter_dir = export_for_transformers(
        lora, tmp_path / "hf-base", tmp_path / "hf-adapter"
    )
    assert adapter_dir is None and not (tmp_path / "hf-adapter").exists()
    with torch.no_grad():
        assert max_diff(hf_load(base_dir)(x).logits, want) <= ATOL
    lora.merge_adapter()
    with pytest.raises(ValueError, match="merged into the weights already"):
        export_for_transformers(lora, tmp_path / "b1", tmp_path / "a1")
    lora.unmerge_adapter()
    with pytest.raises(ValueError, match="no LoRA adapter 'other'"):
        export_for_transformers(lora, tmp_path / "b2", tmp_path / "a2", adapter_name="other")
    with pytest.raises(ValueError, match="no transformers Mamba class"):
        hybrid = ssmkit.build_model(
            ssmkit.ModelConfig(
                d_model=32, n_layer=2, vocab_size=V, attn_layer_idx=[1], attn_cfg=dict(num_heads=4)
            )
        )
        export_for_transformers(apply_lora(hybrid), tmp_path / "b3", tmp_path / "a3")


def test_a_trained_conv_is_folded_into_the_base_too(tmp_path):
    """modules_to_save=["conv1d"] (a full trained copy, which peft refuses on transformers' Mamba):
    the copy becomes the exported base's conv, the in_proj adapter stays an adapter."""
    model = hf_base("mamba", tmp_path / "base")
    lora = lora_on(model, ["in_proj"], modules_to_save=["conv1d"])
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    x = ids(5)
    with torch.no_grad():
        want = lora(x).logits
    base_dir, adapter_dir = export_for_transformers(
        lora, tmp_path / "hf-base", tmp_path / "hf-adapter"
    )
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == ["in_proj"] and not config.get("modules_to_save")
    assert not any("conv1d" in name for name in read_adapter(adapter_dir)[1])
    with torch.no_grad():
        got = hf_load(base_dir, adapter_dir)(x).logits
    assert max_diff(got, want) <= ATOL, f"{max_diff(got, want):.2e}"
    from safetensors.torch import load_file

    conv = lora.base_model.model.backbone.layers[0].mixer.conv1d
    written = load_file(str(base_dir / "model.safetensors"))[
        "backbone.layers.0.mixer.conv1d.weight"
    ]
    assert torch.equal(written, conv.modules_to_save["default"].weight)
    assert not torch.equal(
        written, conv.original_module.weight
    )  # the trained copy, not the original
