"""The exercises of notebooks/00_setup.ipynb: the loss of a fresh model, and the 6ND compute rule.

Each judge recomputes the truth with ssmkit itself (the model config a preset builds, the parameter
count :func:`~ssmkit.workbook.chapters.ch00_setup.run_config_info` gives) and returns a hint that
says what is off, never the number.
"""

from __future__ import annotations

import math

from . import close, exercise

A100_FLOPS = 100e12  # 00's assumption: 100 TFLOP/s sustained (a good A100 in bf16)
DAY = 86_400  # seconds


@exercise(
    "00.1",
    "the loss of a fresh model",
    ("logits_per_position", "uniform_loss"),
    wrong={"logits_per_position": 50257, "uniform_loss": math.log(50257)},
)
def _(logits_per_position, uniform_loss, preset="mamba-130m", tokenizer="gpt2"):
    from ..data import vocab_size
    from ..models import ModelConfig

    cfg = ModelConfig.preset(preset, vocab_size=vocab_size(tokenizer))
    if logits_per_position == cfg.vocab_size != cfg.padded_vocab_size:
        return (
            "logits_per_position: that is the tokenizer's size; the embedding and the output layer "
            "have a few more rows (ModelConfig.pad_vocab_size_multiple)"
        )
    if logits_per_position != cfg.padded_vocab_size:
        return "logits_per_position: count the rows of the output layer (model.config has them)"
    if close(uniform_loss, math.log10(cfg.padded_vocab_size)) or close(
        uniform_loss, math.log2(cfg.padded_vocab_size)
    ):
        return "uniform_loss: the cross-entropy is in nats, a natural logarithm"
    if not close(uniform_loss, math.log(cfg.padded_vocab_size), rel=1e-5):
        return (
            "uniform_loss: a uniform guess gives the right token probability 1/V, "
            "for V the number of logits"
        )
    return None


@exercise("00.2", "tokens in a day of an A100", ("tokens_per_day",), wrong={"tokens_per_day": 1e9})
def _(tokens_per_day, config="cpu-tiny"):
    from ..workbook.chapters.ch00_setup import run_config_info

    flops = run_config_info(config, max_tokens=1)["train_flops"]  # per token: 6N
    want = A100_FLOPS * DAY / flops
    if close(tokens_per_day, 3 * want, rel=1e-3):
        return "that counts the forward pass only (2N per token); the backward pass costs twice it"
    if close(tokens_per_day, want / DAY, rel=1e-3):
        return "that is tokens per second; a day has more of them"
    if not close(tokens_per_day, want, rel=1e-3):
        return (
            "a day at 100 TFLOP/s is 8.64e18 FLOPs; training costs 6 FLOPs per parameter and token "
            "(use the parameters of `config`)"
        )
    return None
