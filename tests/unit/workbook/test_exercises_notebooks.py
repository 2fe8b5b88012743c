"""The exercises of notebooks/00-04 (ssmkit.exercises.nbNN_*): each judge accepts the right
answer, computed here by a second path (a model's own tensors, the Trainer's schedule, the
planner's terms, peft's merge), and refuses its declared ``wrong`` answer with a hint."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ssmkit
from ssmkit import exercises
from ssmkit.workbook.cells import train_config


def judge(id, **kwargs):
    return exercises.verdict(id, **kwargs)


def refuses_wrong(id, **context):
    ex = exercises.exercises()[id]
    state, hint = judge(id, **ex.wrong, **context)
    assert state == "wrong" and hint and "raised" not in hint, (state, hint)
    return hint


def test_every_notebook_has_its_exercises():
    ids = set(exercises.exercises())
    assert {"00.1", "00.2", "01.1", "01.2", "01.3", "02.1", "02.2", "03.1", "03.2"} <= ids
    assert {"04.1", "04.2"} <= ids


def test_00_1_fresh_loss():
    cfg = ssmkit.ModelConfig.preset("mamba-130m", vocab_size=ssmkit.data.vocab_size("gpt2"))
    torch.manual_seed(0)
    small = ssmkit.build_model(ssmkit.ModelConfig.preset("tiny", vocab_size=cfg.vocab_size))
    rows = small.backbone.embedding.weight.shape[0]  # the output layer's rows, tied
    assert rows == small(torch.zeros(1, 1, dtype=torch.long)).logits.shape[-1]
    assert judge("00.1", logits_per_position=rows, uniform_loss=math.log(rows)) == ("passed", None)
    assert "tokenizer's size" in refuses_wrong("00.1")
    assert "nats" in judge("00.1", logits_per_position=rows, uniform_loss=math.log2(rows))[1]


def test_00_2_tokens_per_day():
    from ssmkit.workbook.chapters.ch00_setup import run_config_info

    model = ssmkit.build_model(train_config("cpu-tiny").model_config())
    n = model.num_parameters()
    assert n == run_config_info("cpu-tiny")["params"]
    right = 100e12 * 86_400 / (6 * n)
    assert judge("00.2", tokens_per_day=right, config="cpu-tiny") == ("passed", None)
    refuses_wrong("00.2", config="cpu-tiny")
    assert "forward" in judge("00.2", tokens_per_day=3 * right, config="cpu-tiny")[1]


@pytest.mark.parametrize("d_model", [64, 96])
def test_01_1_block_params(d_model):
    model = ssmkit.build_model(ssmkit.ModelConfig(d_model=d_model, n_layer=2, vocab_size=16))
    block = model.backbone.layers[1]
    right = sum(w.numel() for w in block.parameters())
    assert judge("01.1", block_params=right, d_model=d_model) == ("passed", None)
    refuses_wrong("01.1", d_model=d_model)
    assert "RMSNorm" in judge("01.1", block_params=right - d_model, d_model=d_model)[1]


def test_01_2_lr_after_warmup():
    """The second path: the learning rate the optimizer holds after the Trainer's scheduler ran."""
    from ssmkit.train.optim import lr_at

    recipe = train_config("mamba-130m")
    w, s = recipe.warmup_steps, recipe.total_steps()
    step = w + (s - w) // 4
    right = lr_at(step, recipe)
    assert recipe.min_lr < right < recipe.lr
    assert judge("01.2", lr_at_step=right, config="mamba-130m", step=step) == ("passed", None)
    refuses_wrong("01.2")
    no_floor = recipe.lr * 0.5 * (1 + math.cos(math.pi * (step - w) / (s - w)))
    assert "min_lr" in judge("01.2", lr_at_step=no_floor, step=step)[1]


def test_01_3_what_a_step_reads():
    """The second path: the data loader's own windows, counted over one step's passes."""
    cfg = train_config("cpu-tiny", max_tokens=20_000, micro_batch=4)
    passes = cfg.batch_tokens // (cfg.micro_batch * cfg.seq_len)
    assert passes * cfg.micro_batch * cfg.seq_len == cfg.batch_tokens
    read = -(-20_000 // cfg.batch_tokens) * cfg.batch_tokens
    ok = judge("01.3", passes_per_step=passes, tokens_read=read, cfg=cfg)
    assert ok == ("passed", None)
    refuses_wrong("01.3", cfg=cfg)
    assert "whole steps" in judge("01.3", passes_per_step=passes, tokens_read=20_000, cfg=cfg)[1]


def test_02_1_state_per_rank():
    from ssmkit.train import plan_memory

    plan = plan_memory("mamba-1.4b", seq_len=2048, micro_batch=8, strategy="ddp", n_gpus=8)
    n = plan.params
    right = {"ddp_bytes": 20 * n, "fsdp_bytes": 16 * n / 8}
    assert judge("02.1", **right) == ("passed", None)
    assert "buckets" in refuses_wrong("02.1")
    assert "no bucket" in judge("02.1", ddp_bytes=20 * n, fsdp_bytes=20 * n / 8)[1]


def test_02_2_accumulation_on_ranks():
    real = train_config("mamba-1.4b")
    accum = real.batch_tokens // (8 * real.micro_batch * real.seq_len)
    assert accum * 8 * real.micro_batch * real.seq_len == real.batch_tokens
    steps = math.ceil(real.max_tokens / real.batch_tokens)
    assert judge("02.2", accum_per_rank=accum, optimizer_steps=steps) == ("passed", None)
    assert "one process" in refuses_wrong("02.2")
    assert "partial" in judge("02.2", accum_per_rank=accum, optimizer_steps=steps - 1)[1]


def test_03_1_attention_layers():
    """The second path: the mixers of a built hybrid's layers."""
    model = ssmkit.build_model(
        ssmkit.ModelConfig(d_model=32, n_layer=24, vocab_size=16, attn_every=8, attn_offset=4)
    )
    layers = model.backbone.layers
    right = [i for i, layer in enumerate(layers) if type(layer.mixer).__name__ == "Attention"]
    assert len(right) == 3
    assert judge("03.1", attn_layers=right, attn_share=len(right) / 24) == ("passed", None)
    assert "offset" in refuses_wrong("03.1")


def test_03_2_cache_bytes():
    """The second path: the cache's tensors after a prefill, counted here."""
    cfg = ssmkit.ModelConfig(d_model=64, n_layer=4, vocab_size=256, attn_every=4, attn_offset=2)
    model = ssmkit.build_model(cfg, seed=1).eval()
    cache = model.allocate_cache(1)
    with torch.inference_mode():
        model(torch.randint(0, 256, (1, 1024)), cache=cache, logits_to_keep=1)
    kv_layer = cache.layers[2]
    kv = 2 * kv_layer.length * kv_layer.k.shape[1] * kv_layer.k.shape[3] * 4
    ssm = sum(s.conv.numel() * 4 + s.ssm.numel() * 4 for i, s in enumerate(cache.layers) if i != 2)
    assert judge("03.2", ssm_bytes=ssm, kv_bytes=kv) == ("passed", None)
    assert "conv" in refuses_wrong("03.2")
    assert "values" in judge("03.2", ssm_bytes=ssm, kv_bytes=kv // 2)[1]


@pytest.fixture(scope="module")
def lora_pair():
    pytest.importorskip("peft")
    from ssmkit import finetune

    base = ssmkit.build_model(ssmkit.ModelConfig(d_model=64, n_layer=2, vocab_size=256), seed=0)
    lora = finetune.apply_lora(copy.deepcopy(base), r=4, alpha=8, dropout=0.0)
    return base, lora


def test_04_1_lora_params(lora_pair):
    base, lora = lora_pair
    trainable = sum(w.numel() for n, w in lora.named_parameters() if "lora_" in n)
    assert judge("04.1", lora_params=trainable, lora_model=lora) == ("passed", None)
    refuses_wrong("04.1", lora_model=lora)
    assert "both factors" in judge("04.1", lora_params=trainable // 2, lora_model=lora)[1]


def test_04_2_merged_weight(lora_pair):
    """The second path: the adapted layer applied to the unit vectors, W + (α/r) B A as columns."""
    from ssmkit import finetune

    base, lora = lora_pair
    lora = copy.deepcopy(lora)
    torch.manual_seed(0)
    for module in lora.modules():
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight)  # a trained B is not 0
    name = "backbone.layers.0.mixer.in_proj"
    layer = lora.get_base_model().get_submodule(name).eval()
    with torch.no_grad():
        right = layer(torch.eye(64)).T  # columns: the outputs of the unit vectors
    merged = finetune.merge(copy.deepcopy(lora))
    assert judge("04.2", merged_weight=right, merged_model=merged, name=name) == ("passed", None)
    refuses_wrong("04.2", merged_model=merged, name=name)
    w = base.get_submodule(name).weight
    assert judge("04.2", merged_weight=w, merged_model=merged, name=name)[0] == "wrong"
