"""ssmkit.workbook.chapters.ch04_finetune: what notebook 04 (path B, fine-tuning) calls.

The notebook itself runs under papermill in test_notebooks.py; here each function is checked against
an independent count or oracle: the parameters' checks (bad values named), the run configs of LoRA
and full fine-tuning, the plan's peft snippet on transformers (peft's own refusal of out_proj), the
merged export reloaded by transformers (logits equal to ssmkit's, fp32 1e-4), the counted training
state (12 bytes per trainable fp32 parameter) and a fine-tuning comparison on a tiny base.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers import ROOT

import ssmkit
from ssmkit import workbook
from ssmkit.finetune import apply_lora, parameter_counts
from ssmkit.workbook import WorkbookError
from ssmkit.workbook.chapters import ch04_finetune as ft

pytest.importorskip("peft")
pytest.importorskip("transformers")


def params(tmp_path, **kw) -> dict:
    p = dict(
        base="",
        config="cpu-tiny",
        data="stdlib-docs",
        tokenizer="byte",
        max_tokens=1024,
        sft_data="sft-arith",
        sft_steps=2,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_targets="plan",
        device="cpu",
        allow_cpu=False,
        overrides={},
        out_dir=str(tmp_path),
        seed=0,
    )
    p.update(kw)
    return ft.PARAMETERS.check(p)


@pytest.fixture
def base_dir(tmp_path):
    """A tiny Mamba-1 base with the byte vocabulary, saved in mamba_ssm's layout."""
    torch.manual_seed(0)
    model = ssmkit.build_model(ssmkit.ModelConfig(d_model=32, n_layer=2, vocab_size=257, d_state=8))
    return str(ssmkit.hub.save_pretrained(model, tmp_path / "base", format="mamba_ssm"))


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("sft_data", "sft-nonsense", "'sft-arith'"),
        ("sft_data", "sft:/no/such/file.jsonl", "existing file"),
        ("lora_targets", [], "non-empty list"),
        ("lora_targets", "all", "'plan'"),
        ("lora_dropout", 1.0, "lora_dropout"),
        ("lora_r", 0, "lora_r"),
        ("sft_steps", 1.5, "sft_steps"),
        ("base", None, "base must be"),
    ],
)
def test_bad_parameters_are_named(tmp_path, name, value, words):
    with pytest.raises(WorkbookError, match=words):
        params(tmp_path, **{name: value})


def test_lora_and_full_configs_differ_only_in_what_trains_and_the_lr(tmp_path, base_dir):
    p = params(tmp_path, overrides={"micro_batch": 4, "lora": {"r": 99}})
    lora, full = ft.finetune_config(p, base_dir, "lora"), ft.finetune_config(p, base_dir, "full")
    assert (
        lora.lora == {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": None}
        and full.lora is None
    )
    assert lora.base == full.base == base_dir and lora.data == full.data == "sft-arith"
    assert full.lr == pytest.approx(lora.lr * ft.FULL_LR_SHARE)
    assert lora.micro_batch == full.micro_batch == 4  # the recipe's keys reach both ...
    with pytest.raises(
        WorkbookError, match="base is a parameter of this notebook"
    ):  # ... not what trains
        params(tmp_path, overrides={"base": "elsewhere"})
    assert (lora.max_steps, lora.seq_len, lora.out_dir) == (
        2,
        128,
        str(Path(p["out_dir"]) / "lora"),
    )
    named = ft.finetune_config(params(tmp_path, lora_targets=["in_proj"]), base_dir, "lora")
    assert named.lora["target_modules"] == ["in_proj"]
    with pytest.raises(WorkbookError, match="'lora' or 'full'"):
        ft.finetune_config(p, base_dir, "qlora")


def test_base_checkpoint_resolves_a_run_and_passes_a_hub_id(tmp_path, base_dir):
    assert ft.base_checkpoint(params(tmp_path, base=base_dir)) == (str(Path(base_dir)), None)
    assert (
        ft.base_checkpoint(params(tmp_path, base="state-spaces/mamba-130m-hf"))[0]
        == "state-spaces/mamba-130m-hf"
    )


def test_the_plan_snippet_is_refused_by_peft_on_transformers_and_works_without_out_proj(tmp_path):
    torch.manual_seed(0)
    model = ssmkit.build_model(ssmkit.ModelConfig(d_model=32, n_layer=2, vocab_size=257, d_state=8))
    base = ssmkit.hub.save_pretrained(model, tmp_path / "base", format="hf")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        refused, accepted = ft.plan_snippet_on_transformers(str(base), tmp_path)
    assert not [w for w in seen if issubclass(w.category, FutureWarning)]  # no pink box (#25)
    assert refused["model"] == "MambaForCausalLM" and "out_proj" in refused["target_modules"]
    assert refused["result"].startswith("ValueError") and "out_proj" in refused["result"]
    hf_linear = {"in_proj": (32, 128), "x_proj": (64, 2 + 16)}  # (in, out) of each layer's targets
    expected = 2 * sum(16 * (i + o) for i, o in hf_linear.values())  # r = 16 (the plan's), 2 layers
    assert accepted["result"] == f"ok: {expected:,} trainable parameters"


def test_the_merged_export_computes_what_ssmkit_computes_and_the_adapter_refusal_is_reported(
    tmp_path,
):
    torch.manual_seed(0)
    model = ssmkit.build_model(ssmkit.ModelConfig(d_model=32, n_layer=2, vocab_size=257, d_state=8))
    lora = apply_lora(
        model, r=4, alpha=8, dropout=0.0, init_lora_weights=False
    )  # B != 0: it matters
    ids = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        before = lora(ids).logits
    out = ft.export_to_transformers(lora, tmp_path, ids)
    assert out["hf_class"] == "MambaForCausalLM" and out["max_abs_logit_diff"] < 1e-4
    note = out["adapter_for_transformers"]
    assert "out_proj" in note and "export_merged" in note
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out["path"])(ids).logits
    torch.testing.assert_close(theirs, before, rtol=0, atol=1e-4)  # the adapter is in the export
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file() and out["adapter_mb"] > 0


def test_state_mb_counts_gradients_and_adamw_moments_of_what_trains():
    torch.manual_seed(0)
    model = ssmkit.build_model(ssmkit.ModelConfig(d_model=32, n_layer=2, vocab_size=257, d_state=8))
    full = ft.state_mb(model)
    assert full == pytest.approx(12 * parameter_counts(model)["total"] / 2**20)
    lora = apply_lora(model, r=4, alpha=8, dropout=0.0)
    assert ft.state_mb(lora) == pytest.approx(12 * parameter_counts(lora)["trainable"] / 2**20)
    assert ft.state_mb(lora) < 0.2 * full


@pytest.mark.slow
def test_compare_finetuning_trains_both_and_measures_them_the_same_way(tmp_path, base_dir, capsys):
    p = params(tmp_path, sft_steps=3, overrides={"micro_batch": 4})
    val_dir = ft.sft_split(p, "val")
    configs = {
        name: ft.finetune_config(p, base_dir, method)
        for name, method in (("LoRA", "lora"), ("full", "full"))
    }
    capsys.readouterr()
    rows, models = ft.compare_finetuning(base_dir, configs, val_dir, exact_n=2)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert said == [  # a line as each part starts: the cell never sits silent (issue #25)
        "[1/5] fine-tuning LoRA: 3 steps",
        "[2/5] fine-tuning full: 3 steps",
        *(f"[{i}/5] measuring {m}: held-out loss, 2 greedy answers" for i, m in
          ((3, "base"), (4, "LoRA"), (5, "full"))),
    ]  # fmt: skip
    by = {r["model"]: r for r in rows}
    assert list(by) == ["base", "LoRA", "full"] and by["base"]["trainable"] == 0
    base_params = parameter_counts(models["base"])["total"]
    assert by["full"]["trainable"] == base_params and 0 < by["LoRA"]["trainable"] < base_params
    for name in ("LoRA", "full"):
        assert by[name]["val_loss"] < by["base"]["val_loss"], (
            f"{name} did not learn on the SFT data"
        )
        assert by[name]["train_tok_s"] > 0 and by[name]["step_peak_mb"] >= 0
        assert by[name]["state_mb"] == pytest.approx(
            12 * by[name]["trainable"] / 2**20, abs=5e-4
        )  # rounded
    assert all(0 <= r["exact_match"] <= 1 for r in rows)
    assert hasattr(models["LoRA"], "peft_config") and not hasattr(models["full"], "peft_config")


def test_a_model_transformers_has_no_class_for_says_so_and_exports_in_its_own_layout(tmp_path):
    """Mamba-3 (notebook 04 with config cpu-tiny-mamba3): no transformers class, so the plan's
    snippet has nothing to run on (one row saying so) and the merged model goes out in mamba_ssm's
    layout, reloaded by ssmkit with the same logits."""
    torch.manual_seed(0)
    model = ssmkit.build_model(
        ssmkit.ModelConfig(
            d_model=32,
            n_layer=2,
            vocab_size=257,
            mixer="mamba3",
            d_state=16,
            headdim=16,
            chunk_size=8,
        )
    )
    base = ssmkit.hub.save_pretrained(model, tmp_path / "base", format="mamba_ssm")
    (row,) = ft.plan_snippet_on_transformers(str(base), tmp_path)
    assert "transformers has no class" in row["result"] and "mamba3" in row["model"]
    lora = apply_lora(
        ssmkit.from_pretrained(base), r=4, alpha=8, dropout=0.0, init_lora_weights=False
    )
    ids = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        before = lora(ids).logits
    out = ft.export_to_transformers(lora, tmp_path, ids)
    assert (
        out["hf_class"].startswith("ssmkit (mamba_ssm layout") and out["max_abs_logit_diff"] < 1e-4
    )
    with torch.no_grad():
        torch.testing.assert_close(
            ssmkit.from_pretrained(out["path"])(ids).logits, before, rtol=0, atol=1e-4
        )
    assert "no transformers Mamba class" in out["adapter_for_transformers"]


def test_step_memory_leaves_the_weights_as_they_were():
    torch.manual_seed(0)
    model = ssmkit.build_model(
        ssmkit.ModelConfig(d_model=32, n_layer=2, vocab_size=257, d_state=8)
    ).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 257, (2, 16))
    extra = ft.step_memory(model, (x, x, torch.zeros_like(x, dtype=torch.int32)))
    assert extra >= 0 and not model.training and all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_params_file_s_base_reaches_notebook_04_only():
    """`base` is a TrainConfig key too: routed as one, a fine-tuning params file would turn notebook
    01's pretraining into a fine-tuning of that checkpoint. It reaches only the notebook that
    declares it."""
    from ssmkit.workbook.params import route_parameters

    root = ROOT / "notebooks"
    paths = [root / "01_prototype_130m.ipynb", root / "04_lora_finetune.ipynb"]
    declared = {str(p): workbook.declared_parameters(p) for p in paths}
    values, unused = route_parameters(
        declared, {}, {"base": "state-spaces/mamba-130m-hf", "micro_batch": 4}
    )
    first, fourth = (values[str(p)] for p in paths)
    assert "base" not in first.get("overrides", {}) and first["overrides"]["micro_batch"] == 4
    assert "base" in unused[str(paths[0])]
    assert fourth["base"] == "state-spaces/mamba-130m-hf" and "base" not in fourth.get(
        "overrides", {}
    )
