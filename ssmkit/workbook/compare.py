"""Mamba-1, Mamba-2 and Mamba-3 side by side: the same width, depth, recipe and tokens, only the mixer differs
(notebooks/01_prototype_130m.ipynb, section 1.6).

    rows, runs = compare_mixers(cfg, train_dir, val_dir, out_dir)   # cfg: the notebook's TrainConfig
    markdown_table(rows)                                             # params, val loss, tokens/s per mixer
    plots.plot_curves(runs, y="loss")                                # the training losses, token by token

Each mixer keeps its own state size, as its paper and mamba_ssm do (Mamba-1 16; Mamba-2 and Mamba-3 64 below
d_model 512, else mamba_ssm's 128), with heads of 32 channels (64 from d_inner 1024) and chunks of 64; the
blocks then hold about the same number of parameters (each row says how many).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ..models import SSM_MIXERS as MIXERS

NAMES = {"mamba1": "Mamba-1", "mamba2": "Mamba-2", "mamba3": "Mamba-3"}
_RESET = {"d_state": None, "headdim": 64, "chunk_size": None}        # a preset's own mixer fields, cleared


def mixer_fields(mixer: str, d_inner: int) -> dict:
    """The ModelConfig fields that make a model of width d_inner a ``mixer`` model of comparable size."""
    if mixer not in MIXERS:
        raise ValueError(f"mixer={mixer!r} is not one of {', '.join(MIXERS)}")
    if mixer == "mamba1":
        return dict(mixer="mamba1", d_state=16)
    big = d_inner >= 1024
    return dict(mixer=mixer, d_state=128 if big else 64, headdim=64 if big else 32, chunk_size=64)


def comparison_tokens(cfg, share: int = 4, cap: int = 24 * 1024) -> int:
    """The tokens each mixer trains on: a ``share``-th of the run's, at most ``cap``, whole batches (at least
    one): 6 steps of the CPU recipe, one on CI's."""
    total = cfg.total_steps() * cfg.batch_tokens
    return max(1, min(cap, total // share) // cfg.batch_tokens) * cfg.batch_tokens


def compare_mixers(cfg, data, val_data, out_dir, tokens: int | None = None, mixers=MIXERS,
                   callbacks=()) -> tuple[list[dict], dict]:
    """Train one model per mixer (seeded alike, same tokens in the same order, ``cfg``'s recipe, evaluated at
    the end) for ``tokens`` tokens each (default :func:`comparison_tokens`); their Trainer runs go to
    ``out_dir/<mixer>``. Returns rows (``model``, ``mixer``, ``d_state``, ``params``, ``non_embedding``,
    ``val_loss``, ``val_ppl``, ``train_tok_s``, ``seconds``) and each run's records, keyed by name."""
    import torch

    from ..data import TokenLoader
    from ..eval import summarize_run
    from ..models import build_model, parameter_report
    from ..train import Trainer

    tokens = comparison_tokens(cfg) if tokens is None else tokens
    steps = max(1, tokens // cfg.batch_tokens)
    vocab = TokenLoader(data, cfg.seq_len, 1).index["vocab_size"]
    base = cfg.model_config(vocab_size=vocab)
    d_inner = base.mixer_cfg(base.ssm_kinds[0]).d_inner(base.d_model)
    rows, runs = [], {}
    for mixer in mixers:
        over = {**cfg.model_overrides, **_RESET, **mixer_fields(mixer, d_inner)}
        run = dataclasses.replace(cfg, model_overrides=over, max_steps=steps, max_tokens=None, eval_every=0,
                                  log_every=1, warmup_steps=min(cfg.warmup_steps, steps // 10), ckpt_every=0,
                                  out_dir=str(Path(out_dir) / mixer), overwrite=True)
        torch.manual_seed(cfg.seed)
        model = build_model(run.model_config(vocab_size=vocab))
        start = time.perf_counter()
        trainer = Trainer(model, run, data=data, val_data=val_data, callbacks=list(callbacks),
                          name=NAMES[mixer])
        runs[NAMES[mixer]] = history = trainer.fit()
        size = parameter_report({NAMES[mixer]: model})[0]
        summary = summarize_run(history)
        rows.append({"model": NAMES[mixer], "mixer": mixer,
                     "d_state": model.config.mixer_cfg(mixer).d_state,
                     "params": size["params"], "non_embedding": size["non_embedding"],
                     "val_loss": summary["val_loss"], "val_ppl": summary["val_ppl"],
                     "train_tok_s": summary["train_tok_s"], "seconds": round(time.perf_counter() - start, 1)})
    return rows, runs
