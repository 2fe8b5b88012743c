"""LoRA with peft on ssmkit models (ssmkit.finetune, ssmkit.models.lora_aware).

Oracles: peft's own forward (its wrapper called as a module) and peft's ``merge_and_unload`` for
what the raw-weight reads must compute; transformers' MambaForCausalLM / Mamba2ForCausalLM with peft
for the adapter's meaning there; a raw ``.weight`` read put back (the bypass this code exists to
prevent) as the negative control that shows the gradient test can fail. Tolerances in fp32: merged
vs unmerged 1e-5 (one summation order changes), ssmkit vs transformers 1e-4 (different scan
implementations).
"""

from __future__ import annotations

import copy
import json
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import ssmkit
from ssmkit.finetune import (
    DEFAULT_TARGETS,
    adapter_for_transformers,
    apply_lora,
    export_merged,
    load_adapter,
    merge,
    parameter_counts,
    save_adapter,
    trainable_share,
)
from ssmkit.models import lora_aware
from ssmkit.ops import backend

peft = pytest.importorskip("peft")

V = 64


def tiny(kind: str, seed: int = 0) -> ssmkit.MambaLM:
    """A 2-layer model of each kind; "hybrid": Mamba-1 + attention (with its qkv conv) + MLPs;
    "zamba2": the tiny Zamba2 preset (Mamba-2 layers, shared attention + MLP blocks with their own
    adapters)."""
    torch.manual_seed(seed)
    if kind == "zamba2":
        return ssmkit.build_model(ssmkit.ModelConfig.preset("tiny-zamba2", vocab_size=V))
    if kind == "hybrid":
        cfg = ssmkit.ModelConfig(
            d_model=32,
            n_layer=2,
            vocab_size=V,
            mixer="mamba1",
            d_state=8,
            attn_layer_idx=[1],
            attn_cfg=dict(num_heads=4, d_conv=4),
            d_intermediate=64,
        )
    else:
        cfg = ssmkit.ModelConfig(
            d_model=32, n_layer=2, vocab_size=V, mixer=kind, d_state=8, headdim=16, chunk_size=8
        )
    return ssmkit.build_model(cfg)


def targets_of(kind: str) -> list[str]:
    """The plan's targets the model has, plus dt_proj, the embedding, the head and the MLPs'."""
    extra = {
        "mamba1": ["x_proj", "dt_proj"],
        "hybrid": ["x_proj", "dt_proj", "fc1", "fc2"],
        "zamba2": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "linear",
            "gate_up_proj",
            "down_proj",
            "up",
            "down",
        ],
    }.get(kind, [])
    return ["in_proj", "out_proj", "embedding", "lm_head", *extra]


def ids(seed=1, b=2, n=12):
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


def lora_of(kind, dropout=0.05, **kw):
    kw.setdefault("target_modules", targets_of(kind))
    return apply_lora(tiny(kind), r=4, alpha=8, dropout=dropout, init_lora_weights=False, **kw)


def zero_grads(model) -> list[str]:
    return [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and (p.grad is None or not p.grad.any())
    ]


def use_backend(name, monkeypatch):
    """Force every op onto ``name``: SSMKIT_BACKEND for reference/torch; for cuda the dispatcher is
    routed to the kernel stand-ins of test_cuda_dispatch (which compute with the reference, autograd
    included)."""
    if name == "cuda":
        monkeypatch.setattr(backend, "select", lambda op, *t, backend=None: backend or "cuda")
    else:
        monkeypatch.setenv("SSMKIT_BACKEND", name)


# --- every LoRA parameter trains, on every backend ------------------------------------------------


@pytest.mark.parametrize("kind", ["mamba1", "mamba2", "mamba3", "hybrid", "zamba2"])
@pytest.mark.parametrize("name", ["reference", "torch", "cuda"])
def test_every_lora_parameter_gets_a_gradient(kind, name, monkeypatch, fake_kernels):  # noqa: F811
    use_backend(name, monkeypatch)
    lora = lora_of(kind)  # the plan's dropout 0.05, in training mode
    wrapped = [n for n, m in lora.named_modules() if lora_aware.is_lora_layer(m)]
    expected = [
        n
        for n, _ in tiny(kind).named_modules()
        if any(n == t or n.endswith("." + t) for t in targets_of(kind))
    ]
    assert sorted(n.removeprefix("base_model.model.") for n in wrapped) == sorted(expected)
    lora(ids(), labels=ids()).loss.backward()
    assert zero_grads(lora) == []
    assert all(
        p.grad is None for n, p in lora.named_parameters() if not p.requires_grad
    )  # base frozen
    called = {c for c, _ in fake_kernels}
    if name == "cuda":  # the kernels did run (with the effective weights)
        assert {
            "mamba1": {"causal_conv1d_fn", "selective_scan_fn"},
            "hybrid": {"causal_conv1d_fn"},
            "mamba2": {"causal_conv1d_fn", "mamba_chunk_scan_combined"},
            "zamba2": {"causal_conv1d_fn", "mamba_chunk_scan_combined"},
            "mamba3": {"mamba3_siso_combined"},
        }[kind] <= called
    else:
        assert called == set()


@pytest.mark.parametrize("name", ["torch", "cuda"])
def test_a_raw_weight_read_would_bypass_the_adapter(name, monkeypatch, fake_kernels):  # noqa: F811
    """The negative control: read dt_proj's weight raw (what the code did before) and its adapter
    gets no gradient at all, while the test above sees every one."""
    use_backend(name, monkeypatch)
    monkeypatch.setattr(lora_aware, "linear_no_bias", lambda x, m: F.linear(x, m.weight))
    lora = lora_of("mamba1", dropout=0.0)
    lora(ids(), labels=ids()).loss.backward()
    want = [
        f"base_model.model.backbone.layers.{i}.mixer.dt_proj.{ab}.default.weight"
        for i in (0, 1)
        for ab in ("lora_A", "lora_B")
    ]
    assert sorted(zero_grads(lora)) == sorted(want)


def test_raw_reads_compute_what_peft_s_own_forward_computes():
    """dt_proj through lora_aware == peft's wrapper called as a module (minus the bias), with live
    dropout (the same RNG draws) and without; the conv weight with an adapter on the embedding only
    is the base's."""
    lora = lora_of("mamba1", dropout=0.3)
    dt_proj = lora.base_model.model.backbone.layers[0].mixer.dt_proj
    x = torch.randn(3, 5, dt_proj.in_features)
    for mode in ("train", "eval"):
        getattr(lora, mode)()
        torch.manual_seed(7)
        got = lora_aware.linear_no_bias(x, dt_proj)
        torch.manual_seed(7)
        want = dt_proj(x) - dt_proj.bias
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    W = (
        dt_proj.base_layer.weight
        + 2.0 * dt_proj.lora_B["default"].weight @ dt_proj.lora_A["default"].weight
    )
    torch.testing.assert_close(
        lora_aware.weight(dt_proj), W, rtol=0, atol=1e-6
    )  # alpha / r = 8 / 4
    with lora.disable_adapter():  # disabled adapters add nothing
        torch.testing.assert_close(
            lora_aware.weight(dt_proj), dt_proj.base_layer.weight, rtol=0, atol=0
        )
    lora.train()
    with pytest.raises(
        ValueError, match="dropout p=0.3 on conv1d"
    ):  # a weight cannot drop its input
        lora_aware.weight(dt_proj, "conv1d")


def test_a_conv_adapter_is_refused_clearly_and_modules_to_save_trains_the_conv(
    monkeypatch, fake_kernels
):  # noqa: F811
    with pytest.raises(ValueError, match="depthwise causal conv .*modules_to_save=\\['conv1d'\\]"):
        apply_lora(tiny("mamba1"), target_modules=["in_proj", "conv1d"])
    # peft itself accepts it when r is a multiple of the channels; the forward then says why it
    # cannot work
    model = tiny("mamba2")
    convs = model.backbone.layers[0].mixer.conv1d.in_channels
    with pytest.warns(UserWarning, match="groups > 1. Merging is not supported"):
        raw = peft.get_peft_model(model, peft.LoraConfig(r=convs, target_modules=["conv1d"]))
    with pytest.raises(ValueError, match="depthwise.*Remove 'conv1d' from target_modules"):
        raw(ids())
    # the way to train the conv: a full copy of it, read raw through peft's wrapper on every backend
    use_backend("cuda", monkeypatch)
    lora = apply_lora(
        tiny("mamba1"),
        r=4,
        target_modules=["in_proj"],
        modules_to_save=["conv1d"],
        init_lora_weights=False,
    )
    lora(ids(), labels=ids()).loss.backward()
    assert zero_grads(lora) == [] and any(
        "conv1d.modules_to_save" in n for n, p in lora.named_parameters() if p.requires_grad
    )


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_the_one_token_step_of_generation_uses_the_adapters_too(kind):
    """The decode step reads dt_proj and the conv weight raw as well: prefill + steps through the
    cache == the merged model on the whole sequence, with adapters on dt_proj and a trained copy of
    the conv."""
    targets = ["in_proj", "out_proj"] + (["x_proj", "dt_proj"] if kind == "mamba1" else [])
    lora = apply_lora(
        tiny(kind),
        r=4,
        alpha=8,
        target_modules=targets,
        modules_to_save=["conv1d"],
        init_lora_weights=False,
    ).eval()
    with torch.no_grad():
        for p in lora.parameters():
            if p.requires_grad and p.dim() == 3:  # move the conv copy off the base's values
                p.add_(0.3 * torch.randn_like(p))
    x = ids(8, n=10)
    model = lora.get_base_model()
    with torch.no_grad():
        whole = copy.deepcopy(lora).merge_and_unload()(x).logits  # peft's merge: the oracle
        cache = model.allocate_cache(x.shape[0])
        steps = [model(x[:, :6], cache=cache).logits]
        steps += [model(x[:, t : t + 1], cache=cache).logits for t in range(6, 10)]
        with lora.disable_adapter():
            plain = model(x).logits
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)
    assert (plain - whole).abs().max() > 1e-2


# --- targets, defaults, counts --------------------------------------------------------------------


def test_default_targets_are_the_plan_s_where_the_model_has_them():
    assert DEFAULT_TARGETS == ("x_proj", "in_proj", "out_proj")
    one = apply_lora(tiny("mamba1"))
    config = one.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (16, 32, 0.05)
    assert config.target_modules == ["x_proj", "in_proj", "out_proj"]
    assert apply_lora(tiny("mamba2")).peft_config["default"].target_modules == [
        "in_proj",
        "out_proj",
    ]


def test_the_trainable_share_counts_r_times_in_plus_out_per_target():
    model = tiny("mamba1")
    shapes = [
        m.weight.shape
        for n, m in model.named_modules()
        if n.endswith(("in_proj", "x_proj", "out_proj"))
    ]
    total = parameter_counts(model)["total"]
    lora = apply_lora(model, r=8)
    share = trainable_share(lora)
    adapter = sum(8 * (out + inp) for out, inp in shapes)
    assert share["trainable"] == adapter and share["total"] == total + adapter
    assert share["share"] == pytest.approx(adapter / (total + adapter))
    assert share["by_kind"] == {
        "lora_A": sum(8 * inp for _, inp in shapes),
        "lora_B": sum(8 * out for out, _ in shapes),
    }


@pytest.mark.parametrize(
    "targets, words",
    [
        (
            ["xproj"],
            "LoRA target 'xproj' matches no module of this model; valid targets: .*dt_proj",
        ),
        (["norm"], "matches \\['RMSNorm'\\] modules; LoRA adapts Linear and Embedding layers"),
        (["x_proj"], "matches no module"),  # Mamba-2 has no x_proj
        ([], "non-empty list of module names"),
    ],
)
def test_targets_that_match_nothing_or_cannot_work_are_errors(targets, words):
    model = tiny("mamba2" if targets == ["x_proj"] else "mamba1")
    with pytest.raises(ValueError, match=words):
        apply_lora(model, target_modules=targets)


def test_other_refusals():
    model = tiny("mamba1")
    lora = apply_lora(model)
    for again in (lora, model):  # the peft model, or its base a second time
        with pytest.raises(ValueError, match="already has LoRA adapters"):
            apply_lora(again)
    with pytest.raises(ValueError, match="dropout \\(lora_dropout\\) must be in \\[0, 1\\)"):
        apply_lora(tiny("mamba1"), dropout=1.0)
    with pytest.raises(ValueError, match="takes an ssmkit model"):
        apply_lora(torch.nn.Linear(2, 2))


# --- merged == unmerged; the tied-embedding trap --------------------------------------------------


@pytest.mark.parametrize("kind", ["mamba1", "mamba2", "mamba3", "hybrid", "zamba2"])
def test_merge_and_unload_gives_the_unmerged_outputs(kind):
    lora = lora_of(kind).eval()
    x = ids(3)
    with torch.no_grad():
        unmerged = lora(x).logits
        base_only = merge(tiny(kind)).eval()(x).logits  # merge of a plain model: itself
        merged = lora.merge_and_unload()
        assert isinstance(merged, ssmkit.MambaLM)
        torch.testing.assert_close(merged(x).logits, unmerged, rtol=0, atol=1e-5)
    assert (unmerged - base_only).abs().max() > 1e-2  # the adapter does change the model


def test_an_adapter_on_a_tied_embedding_unties_the_head_first():
    """Without the untying, merging writes the embedding's update into the shared matrix, so the
    head moves too and merged != unmerged (peft's wrapper on the embedding leaves the head as it
    was)."""
    x = ids(4)
    config = dict(r=4, lora_alpha=8, target_modules=["embedding"], init_lora_weights=False)
    raw = peft.get_peft_model(tiny("mamba1"), peft.LoraConfig(**config)).eval()
    with torch.no_grad():
        before = raw(x).logits
        assert (raw.merge_and_unload()(x).logits - before).abs().max() > 1e-3  # the trap
    model = tiny("mamba1")
    assert model.lm_head.weight is model.backbone.embedding.weight
    lora = apply_lora(model, config=peft.LoraConfig(**config)).eval()  # the same draws of A and B
    head = lora.base_model.model.lm_head.weight
    assert (
        head is not model.backbone.embedding.base_layer.weight and not model.config.tie_embeddings
    )
    with torch.no_grad():
        torch.testing.assert_close(
            lora(x).logits, before, rtol=0, atol=0
        )  # the same function as peft's
        torch.testing.assert_close(lora.merge_and_unload()(x).logits, before, rtol=0, atol=1e-5)


# --- adapters on disk -----------------------------------------------------------------------------


def train_a_few_steps(lora, steps=3, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    lora.train()
    for i in range(steps):
        x = ids(10 + i)
        lora(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return lora.eval()


def test_an_adapter_saves_and_loads_in_peft_s_format(tmp_path):
    base = tiny("mamba1")
    base.save_pretrained(tmp_path / "base")
    lora = train_a_few_steps(apply_lora(base, r=4, target_modules=targets_of("mamba1")))
    save_adapter(lora, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["inference_mode"] is True
    x = ids(5)
    with torch.no_grad():
        want = lora(x).logits
        ours = load_adapter(ssmkit.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
        theirs = peft.PeftModel.from_pretrained(
            ssmkit.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
        )
        torch.testing.assert_close(ours(x).logits, want, rtol=0, atol=0)
        torch.testing.assert_close(theirs.eval()(x).logits, want, rtol=0, atol=0)
    assert not any(p.requires_grad for p in ours.parameters())
    trainable = load_adapter(
        ssmkit.from_pretrained(tmp_path / "base"), tmp_path / "adapter", trainable=True
    )
    assert trainable.training
    assert trainable_share(trainable)["trainable"] == trainable_share(lora)["trainable"]
    with pytest.raises(ValueError, match="does not fit this model: .*shapes"):
        load_adapter(
            ssmkit.build_model(ssmkit.ModelConfig(d_model=48, n_layer=2, vocab_size=V)),
            tmp_path / "adapter",
        )
    with pytest.raises(
        ValueError, match="not a LoRA adapter directory: adapter_config.json is missing"
    ):
        load_adapter(tiny("mamba1"), tmp_path / "base")


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_an_adapter_trained_on_ssmkit_loads_onto_transformers_with_equal_logits(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    base = tiny(kind)
    base.save_pretrained(tmp_path / "hf-base", format="hf")  # transformers' checkpoint of the base
    targets = ["in_proj", "embedding", "lm_head"] + (
        ["x_proj"] if kind == "mamba1" else []
    )  # not dt_proj: transformers reads its weight raw (test_transformers_export.py)
    lora = train_a_few_steps(apply_lora(base, r=4, alpha=8, target_modules=targets))
    save_adapter(lora, tmp_path / "adapter")
    adapter_for_transformers(
        tmp_path / "adapter", tmp_path / "adapter-hf", base.config, str(tmp_path / "hf-base")
    )
    saved = json.loads((tmp_path / "adapter-hf" / "adapter_config.json").read_text())
    assert "embeddings" in saved["target_modules"] and "embedding" not in saved["target_modules"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: tied layer in the adapter
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base")
        hf_lora = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter-hf").eval()
    assert type(hf).__name__ == {"mamba1": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}[kind]
    x = ids(6)
    with torch.no_grad():
        ours, theirs = lora(x).logits[..., :V], hf_lora(x).logits[..., :V]
        with hf_lora.disable_adapter():
            plain = hf_lora(x).logits[..., :V]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    assert (plain - ours).abs().max() > 1e-2  # the adapter is on, and it matters


def test_out_proj_adapters_cannot_go_to_transformers_and_the_message_says_what_to_do(tmp_path):
    from transformers import AutoModelForCausalLM

    base = tiny("mamba1")
    base.save_pretrained(tmp_path / "hf-base", format="hf")
    lora = apply_lora(base)  # the plan's targets: out_proj among them
    save_adapter(lora, tmp_path / "adapter")
    with pytest.raises(
        ValueError,
        match="\\['out_proj'\\].*out_proj: peft .* refuses .*export_for_transformers.*"
        "export_merged",
    ):
        adapter_for_transformers(tmp_path / "adapter", tmp_path / "out", base.config)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base")  # the fact behind the message
    with pytest.raises(ValueError, match="out_proj.*incompatible with Mamba-based models"):
        peft.get_peft_model(hf, peft.LoraConfig(target_modules=["x_proj", "in_proj", "out_proj"]))
    with pytest.raises(ValueError, match="no transformers Mamba class"):
        adapter_for_transformers(tmp_path / "adapter", tmp_path / "out", tiny("hybrid").config)


@pytest.mark.parametrize("fmt", ["hf", "mamba_ssm"])
def test_the_merged_model_exports_and_reloads_equal(tmp_path, fmt):
    lora = train_a_few_steps(lora_of("mamba1", dropout=0.0))
    x = ids(7)
    with torch.no_grad():
        want = lora(x).logits
    export_merged(lora, tmp_path / "merged", format=fmt)
    with torch.no_grad():
        torch.testing.assert_close(
            ssmkit.from_pretrained(tmp_path / "merged")(x).logits, want, rtol=0, atol=1e-5
        )
        if fmt == "hf":
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
            torch.testing.assert_close(hf(x).logits[..., :V], want[..., :V], rtol=0, atol=1e-4)


# --- edited adapter configs, modules_to_save (issue #26) ------------------------------------------


@pytest.mark.parametrize(
    "edit, words",
    [
        ({"r": 4.5}, r"r \(LoRA rank\) must be a positive integer; got 4.5"),
        ({"lora_alpha": "8"}, "lora_alpha must be a positive number; got '8'"),
        ({"lora_alpha": -8}, "lora_alpha must be a positive number; got -8"),
        ({"lora_alpha": 0}, "lora_alpha must be a positive number; got 0"),
        ({"lora_dropout": "x"}, r"lora_dropout must be a number in \[0, 1\); got 'x'"),
        ({"alpha_pattern": {"in_proj": -100}}, r"alpha_pattern\['in_proj'\] must be a positive"),
        ({"rank_pattern": {"in_proj": 2.5}}, r"rank_pattern\['in_proj'\] must be a positive"),
        ({"rank_pattern": [1]}, "rank_pattern must be a mapping of module names"),
    ],
)
def test_an_edited_adapter_config_is_refused_naming_the_file_and_field(tmp_path, edit, words):
    """Fault injected: adapter_config.json edited by hand. peft takes every one of these values
    (before: a TypeError in the forward, or alpha <= 0 loaded as a negated or no-op update)."""
    base = tiny("mamba1")
    save_adapter(apply_lora(base, r=4, target_modules=["in_proj"]), tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(ValueError, match=f"^{path}: {words}") as err:
        load_adapter(tiny("mamba1"), tmp_path / "adapter")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "fault, words",
    [
        ("int64", r"has dtype int64; a LoRA adapter's tensors are floating point"),
        ("int8", r"has dtype int8; a LoRA adapter's tensors are floating point"),
        ("nan", r"holds 1 NaN or infinite value of \d+"),
        ("inf", r"holds 1 NaN or infinite value of \d+"),
    ],
)
def test_an_adapter_with_integer_or_non_finite_tensors_is_refused(tmp_path, fault, words):
    """Fault injected: one tensor of adapter_model.safetensors rewritten as integers (before: cast
    to float without a word) or with a NaN / inf (before: NaN logits)."""
    from safetensors.torch import load_file, save_file

    save_adapter(apply_lora(tiny("mamba1"), r=4, target_modules=["in_proj"]), tmp_path / "a")
    path = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    if fault in ("int64", "int8"):
        tensors[name] = tensors[name].round().to(getattr(torch, fault))
    else:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = float(fault)
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=f"^{path}: (weight )?{re.escape(name)} {words}") as err:
        load_adapter(tiny("mamba1"), tmp_path / "a")
    assert "\n" not in str(err.value)


def test_a_ready_lora_config_gets_the_same_checks():
    """apply_lora(config=...) checks r / lora_alpha as lora_config does (it used to skip them)."""
    config = peft.LoraConfig(r=4, lora_alpha=-1, target_modules=["in_proj"])
    with pytest.raises(ValueError, match="lora_alpha must be a positive number; got -1"):
        apply_lora(tiny("mamba1"), config=config)


def test_modules_to_save_that_match_nothing_are_refused_with_the_valid_names():
    """Fault injected: a misspelt modules_to_save entry (before: accepted, nothing extra
    trained)."""
    with pytest.raises(
        ValueError,
        match=r"modules_to_save entry 'norm_ff' matches no module of this model, so nothing would "
        r"train; did you mean 'norm_f'\? valid names: .*lm_head.*norm_f",
    ):
        apply_lora(tiny("mamba1"), target_modules=["in_proj"], modules_to_save=["norm_ff"])
    with pytest.raises(ValueError, match="'nope' matches no module"):
        apply_lora(tiny("mamba1"), target_modules=["in_proj"], modules_to_save="nope")
    lora = apply_lora(tiny("mamba1"), target_modules=["in_proj"], modules_to_save=["norm_f"])
    assert trainable_share(lora)["by_kind"]["modules_to_save"] == 32  # norm_f's weight
