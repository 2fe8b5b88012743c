"""Chapter 01, the prototype: what notebooks/01_prototype_130m.ipynb calls beyond the Trainer:
Mamba-1, Mamba-2 and Mamba-3 side by side (section 1.6): the same width, depth, recipe and tokens,
only the mixer differs.

    p = PARAMETERS.check(globals())
    rows, runs = compare_mixers(cfg, train_dir, val_dir, out_dir)  # cfg: the notebook's run
    markdown_table(rows)               # params, val loss, tokens/s per mixer
    plots.plot_curves(runs, y="loss")  # the training losses, token by token

Each mixer's model is :meth:`ssmkit.ModelConfig.with_mixer` of the run's: the same width, depth and
everything shared; its own state size, as its paper and mamba_ssm pair them (Mamba-1 16; Mamba-2 and
Mamba-3 64 below d_inner 1024, else mamba_ssm's 128), heads of 32 channels (64 from d_inner 1024)
and chunks of 64; the blocks then hold about the same number of parameters (each row says how many).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ... import checks
from ...models import MAMBA_MIXERS
from ...train.config import CHOICES
from ..params import (
    ALLOW_CPU,
    DEVICE,
    Param,
    Parameters,
    check_data,
    check_out_dir,
    check_overrides,
    check_run_config,
    check_tokenizer,
)

__all__ = ["PARAMETERS", "compare_mixers", "comparison_tokens"]

# fmt: off
PARAMETERS = Parameters(
    Param("config",     "cpu-tiny",    check_run_config,
          'run config (configs/<config>.yaml) or a model preset: "cpu-tiny-mamba2", '
          '"cpu-tiny-mamba3" for Mamba-2 / Mamba-3 blocks; GPU node: "mamba-130m"'),
    Param("data",       "stdlib-docs", check_data,
          'training text: the embedded corpus (offline); GPU node: "slimpajama"'),
    Param("tokenizer",  "gpt2",        check_tokenizer,
          '"gpt2" (the plan\'s), or "bpe-8192": a byte-level BPE trained on `data`'),
    Param("max_tokens", 250_000,       checks.integer,
          "training tokens for each model; the plan: 10_000_000_000", minimum=1, whole_floats=True),
    DEVICE,
    ALLOW_CPU,
    Param("precision",  "fp32",        checks.choice,
          '"fp32" on CPU; "bf16" on A100/H100 (autocast, fp32 master weights)',
          valid=CHOICES["precision"]),
    Param("evals",      6,             checks.integer,
          "validation points per run: the resolution of the loss curves",
          minimum=1, whole_floats=True),
    Param("baseline",   True,          checks.boolean,
          "also train the matched Transformer++ (Llama) on the same tokens"),
    Param("overrides",  {},            check_overrides,
          'more TrainConfig keys for the run, e.g. {"micro_batch": 4, "lr": 1e-3}; a recipe\'s '
          "keys (-f params/gpu-a100.yaml) arrive here"),
    Param("out_dir",    "../runs/lab/01_prototype_130m", check_out_dir,
          "figures, metrics.json, checkpoints (relative: from notebooks/)"),
    Param("seed",       0,             checks.integer,
          "model initialisation and data order", minimum=0, whole_floats=True),
)
# fmt: on

NAMES = {"mamba1": "Mamba-1", "mamba2": "Mamba-2", "mamba3": "Mamba-3", "s4d": "S4D"}


def comparison_tokens(cfg, share: int = 4, cap: int = 24 * 1024) -> int:
    """The tokens each mixer trains on: a ``share``-th of the run's, at most ``cap``, whole batches
    (at least one): 6 steps of the CPU recipe, one on CI's."""
    total = cfg.total_steps() * cfg.batch_tokens
    return max(1, min(cap, total // share) // cfg.batch_tokens) * cfg.batch_tokens


def compare_mixers(
    cfg, data, val_data, out_dir, tokens: int | None = None, mixers=MAMBA_MIXERS, callbacks=()
) -> tuple[list[dict], dict]:
    """Train one model per mixer (seeded alike, same tokens in the same order, ``cfg``'s recipe,
    evaluated at the end) for ``tokens`` tokens each (default :func:`comparison_tokens`); their
    Trainer runs go to ``out_dir/<mixer>``. Returns rows (``model``, ``mixer``, ``d_state``,
    ``params``, ``non_embedding``, ``val_loss``, ``val_ppl``, ``train_tok_s``, ``seconds``) and each
    run's records, keyed by name."""
    from ...data import TokenLoader
    from ...eval import summarize_run
    from ...models import build_model, parameter_report
    from ...train import Trainer

    tokens = comparison_tokens(cfg) if tokens is None else tokens
    steps = max(1, tokens // cfg.batch_tokens)
    vocab = TokenLoader(data, cfg.seq_len, 1).index["vocab_size"]
    base = cfg.model_config(vocab_size=vocab)
    rows, runs = [], {}
    for mixer in mixers:
        model_cfg = base.with_mixer(mixer)  # the one rule for "the same model, another mixer"
        # the run's config says exactly which model it trained (its config.yaml, its checkpoints)
        over = {k: v for k, v in model_cfg.to_dict().items() if k != "vocab_size"}
        run = dataclasses.replace(
            cfg,
            model_overrides=over,
            max_steps=steps,
            max_tokens=None,
            eval_every=0,
            log_every=1,
            warmup_steps=min(cfg.warmup_steps, steps // 10),
            ckpt_every=0,
            out_dir=str(Path(out_dir) / mixer),
            overwrite=True,
        )
        model = build_model(model_cfg, seed=cfg.seed)
        start = time.perf_counter()
        trainer = Trainer(
            model, run, data=data, val_data=val_data, callbacks=list(callbacks), name=NAMES[mixer]
        )
        runs[NAMES[mixer]] = history = trainer.fit()
        size = parameter_report({NAMES[mixer]: model})[0]
        summary = summarize_run(history)
        rows.append(
            {
                "model": NAMES[mixer],
                "mixer": mixer,
                "d_state": model_cfg.mixer_cfg(mixer).d_state,
                "params": size["params"],
                "non_embedding": size["non_embedding"],
                "val_loss": summary["val_loss"],
                "val_ppl": summary["val_ppl"],
                "train_tok_s": summary["train_tok_s"],
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    return rows, runs
