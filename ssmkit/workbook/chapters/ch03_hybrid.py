"""Chapter 03, hybrids: what notebooks/03_hybrid.ipynb calls (stage 3 of the plan: SSM + attention
stacks, Jamba-style).

    p = PARAMETERS.check(globals())
    cfg_h = hybrid_config(cfg, attn_every=4)          # the TrainConfig cfg, its model a hybrid
    layer_pattern(cfg_h)                              # "M M A M" (offset attn_every // 2)
    parameter_split(model)                            # {"ssm": ..., "attention": ..., "mlp": ...}
    rows = ratio_sweep(cfg, task, width=64, depth=8)  # pure SSM, attn_every 8, 4, 2, pure attention
    rows = context_costs(context_models(cfg, 4), [1024, 4096])  # time and memory against length

Models are built with :func:`ssmkit.models.build_model` (``seed=cfg.seed``), trained on a synthetic
task with :func:`ssmkit.train.train_on_task` and as language models with the Trainer; figures with
:func:`ssmkit.plots.plot_panels`.

Jamba's rule (Lieber et al. 2024): layer i of n is attention when ``i % attn_every == attn_offset``,
so ``attn_every=8, attn_offset=4`` puts 3 attention layers among 24 (Jamba's 1:7), ``attn_every=1``
makes every layer attention and ``attn_every=0`` none. Layer letters: M Mamba-1, M2 Mamba-2, M3
Mamba-3, A attention, W sliding-window attention, T a Transformer block (attention + MLP,
transformers' Llama).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ... import checks
from ...models import SSM_MIXERS, build_model
from ...models.config import GROUP_FIELDS
from ...train import train_on_task
from ..cells import pick_device, rounded
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
from ..progress import step_line

__all__ = [
    "PARAMETERS",
    "SWEEP",
    "attention_share",
    "context_costs",
    "context_models",
    "crossovers",
    "extrapolation",
    "hybrid_config",
    "layer_pattern",
    "mixer_comparison",
    "parameter_split",
    "ratio_sweep",
]

# fmt: off
PARAMETERS = Parameters(
    Param("config",          "cpu-tiny",    check_run_config,
          "the SSM run config the hybrid is built from (configs/<config>.yaml); GPU node: "
          '"mamba-130m"'),
    Param("data",            "stdlib-docs", check_data,
          'training text: the embedded corpus (offline); GPU node: "slimpajama"'),
    Param("tokenizer",       "byte",        check_tokenizer,
          '"byte" (257 ids: a small LM head, cheap on a CPU); GPU node: "gpt2"'),
    Param("max_tokens",      131_072,       checks.integer,
          "3.1: training tokens for each of the three models; the plan: 10B",
          minimum=1, whole_floats=True),
    Param("attn_every",      4,             checks.integer,
          "3.1: attention at layer i when i mod attn_every is attn_every // 2; with cpu-tiny's 4 "
          "layers: M M A M (Jamba, and GPU node: 8 -> layer 4)", minimum=1, whole_floats=True),
    Param("sweep_width",     32,            checks.integer,
          "3.2: d_model of every model of the ratio sweep", minimum=1, whole_floats=True),
    Param("sweep_depth",     8,             checks.integer,
          "3.2: their layers (at least 8: attention every 8 layers is 1 of 8)",
          minimum=8, whole_floats=True),
    Param("sweep_steps",     200,           checks.integer,
          "3.2: training steps of each on the recall task (16 sequences a step)",
          minimum=1, whole_floats=True),
    Param("sweep_tokens",    65_536,        checks.integer,
          "3.2: language-model training tokens of each (0: the recall task only)",
          minimum=0, whole_floats=True),
    Param("context_lengths", [256, 1024, 4096, 16384], checks.integers,
          "3.3: lengths timed and evaluated at; GPU: up to 131072", minimum=2, ascending=True),
    DEVICE,
    ALLOW_CPU,
    Param("evals",           4,             checks.integer,
          "3.1: validation points per run", minimum=1, whole_floats=True),
    Param("overrides",       {},            check_overrides,
          'more TrainConfig keys for the runs, e.g. {"micro_batch": 4, "lr": 1e-3}; a recipe\'s '
          "keys arrive here (-f params/gpu-a100.yaml: bf16, ...)"),
    Param("out_dir",         "../runs/lab/03_hybrid", check_out_dir,
          "figures, metrics.json, runs (relative: from notebooks/)"),
    Param("seed",            0,             checks.integer,
          "model initialisation, data order and the recall task's sequences",
          minimum=0, whole_floats=True),
)
# fmt: on

SWEEP = (0, 8, 4, 2, 1)  # attn_every of the ratio sweep: pure SSM, 1/8, 1/4, 1/2, pure attention
LETTERS = {
    "mamba1": "M",
    "mamba2": "M2",
    "mamba3": "M3",
    "s4d": "S",
    "h3": "H3",
    "attn": "A",
    "swa": "W",
}
_CLEARED = {
    "layout": None,
    "attn_layer_idx": None,
}  # one rule names the attention layers: attn_every


def _model_config(of):
    """The ModelConfig of a ModelConfig, a TrainConfig (``model_config()``) or a model
    (``.config``)."""
    from ...models import ModelConfig

    if isinstance(of, ModelConfig):
        return of
    if hasattr(of, "model_config"):
        return of.model_config()
    return of.config


def _mixers(of) -> list[str]:
    """Each layer's mixer; transformers' Llama (no ``mixers``): a Transformer block per layer."""
    cfg = _model_config(of)
    if hasattr(cfg, "mixers"):
        return cfg.mixers
    return ["transformer"] * cfg.num_hidden_layers  # transformers' Llama: attention + MLP blocks


def layer_pattern(of) -> str:
    """The stack as letters, bottom layer first: "M M A M" (M Mamba-1, M2 Mamba-2, M3 Mamba-3, S
    S4D, H3 H3, A attention, W sliding-window attention, T a Transformer block). ``of``: a
    ModelConfig, TrainConfig or model."""
    return " ".join(LETTERS.get(m, "T") for m in _mixers(of))


def attention_share(of) -> float:
    """The fraction of layers that attend (attention, sliding window or Transformer blocks); ``of``
    as in :func:`layer_pattern`."""
    mixers = _mixers(of)
    return sum(m not in SSM_MIXERS for m in mixers) / len(mixers)


def hybrid_config(
    cfg,
    attn_every: int,
    attn_offset: int | None = None,
    *,
    mixer: str | None = None,
    out_dir=None,
    **model_overrides,
):
    """``cfg`` (a :class:`~ssmkit.train.TrainConfig`) with its model made a Jamba-style hybrid:
    layer i is attention when ``i % attn_every == attn_offset`` (default offset ``attn_every // 2``,
    Jamba's 4 of 8), the others the SSM ``mixer`` (default: the run config's; another one by
    :meth:`ssmkit.ModelConfig.with_mixer`'s rule, the one notebook 01 compares mixers with: its own
    state size, heads and chunk for that width, unless ``model_overrides`` gives them).

    ``attn_every=0``: no attention (the pure SSM); ``1``: every layer (a pure attention stack, which
    then gets rotary positions on every head dimension, since no SSM layer gives it order; Jamba's
    attention layers have none). ``model_overrides``: more ModelConfig fields (d_model, n_layer,
    ...).
    The result is checked by building its ModelConfig; ``out_dir`` replaces the run directory."""
    attn_every = checks.integer(attn_every, "attn_every", minimum=0)
    over = {**cfg.model_overrides, **_CLEARED, **model_overrides}
    if mixer is not None:
        base = dataclasses.replace(cfg, model_overrides=over).model_config(vocab_size=256)
        if base.mixer != mixer:
            group = base.with_mixer(mixer).mixer_cfg(mixer).to_dict()
            # the old mixer's knobs given flat go; the caller's own (flat or grouped) win
            over = {k: v for k, v in over.items() if k not in GROUP_FIELDS or k in model_overrides}
            over.update(mixer=mixer, **{mixer: {**group, **(model_overrides.get(mixer) or {})}})
    if attn_every == 0:
        over.update(attn_every=0, attn_offset=0, attn_cfg=None)
    else:
        offset = attn_every // 2 if attn_offset is None else attn_offset
        over.update(
            attn_every=attn_every, attn_offset=checks.integer(offset, "attn_offset", minimum=0)
        )
        if attn_every == 1 and not (over.get("attn_cfg") or {}).get("rotary_emb_dim"):
            base = dataclasses.replace(cfg, model_overrides=over).model_config(vocab_size=256)
            over["attn_cfg"] = {
                **(over.get("attn_cfg") or {}),
                "rotary_emb_dim": base.attn_cfg["head_dim"],
            }
    changes = {"model_overrides": over}
    if out_dir is not None:
        changes["out_dir"] = str(out_dir)
    out = dataclasses.replace(cfg, **changes)
    out.model_config(vocab_size=256)  # a bad combination fails here, not in training
    return out


# --- parameters -----------------------------------------------------------------------------------


def _kind(module) -> str | None:
    """The part of the model a module's parameters count toward, by its class (None: look
    inside)."""
    from torch import nn

    from ...models import Mamba1, Mamba2, Mamba3

    name = type(module).__name__
    if isinstance(module, (Mamba1, Mamba2, Mamba3)):
        return "ssm"
    if "Attention" in name:  # ssmkit's Attention, LlamaAttention
        return "attention"
    if "MLP" in name:  # GatedMLP, LlamaMLP
        return "mlp"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if "Norm" in name:  # RMSNorm, LayerNorm, LlamaRMSNorm
        return "norms"
    return None


def parameter_split(model) -> dict:
    """Parameters by part: ``ssm`` (Mamba mixers), ``attention``, ``mlp``, ``embedding`` (embedding
    and an untied LM head), ``norms``, ``other``, and ``total`` (their sum; tied weights counted
    once, as ``model.num_parameters()``). Works for ssmkit models and transformers' Llama."""
    split = dict.fromkeys(("ssm", "attention", "mlp", "embedding", "norms", "other"), 0)
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        kind = _kind(module)
        params = module.parameters() if kind else module.parameters(recurse=False)
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            head = prefix.split(".")[-1] in ("lm_head", "output")
            split[kind or ("embedding" if head else "other")] += p.numel()
    split["total"] = sum(split.values())
    return split


# --- the ratio sweep ------------------------------------------------------------------------------


def _train_lm(cfg, data, val_data, name: str) -> dict:
    """Train ``cfg.model_config()`` with the Trainer on the prepared shards; its last validation
    loss."""
    from ...data import TokenLoader
    from ...eval import summarize_run
    from ...train import Trainer

    vocab = TokenLoader(data, cfg.seq_len, 1).index["vocab_size"]
    model = build_model(cfg.model_config(vocab_size=vocab), seed=cfg.seed)
    start = time.perf_counter()
    run = summarize_run(Trainer(model, cfg, data=data, val_data=val_data, name=name).fit())
    return {"val_loss": run["val_loss"], "lm_seconds": round(time.perf_counter() - start, 1)}


def ratio_sweep(
    cfg,
    task=None,
    *,
    width: int | None = None,
    depth: int | None = None,
    attn_every=SWEEP,
    mixer: str | None = None,
    steps: int = 100,
    batch: int = 16,
    lr: float | None = None,
    lm_tokens: int = 0,
    data=None,
    val_data=None,
    out_dir=None,
    **model_overrides,
) -> list[dict]:
    """One row per ``attn_every`` (default :data:`SWEEP`: pure SSM, 8, 4, 2, pure attention), every
    model of the same width and depth (``width`` / ``depth``: d_model / n_layer; default the run
    config's), attention at offset ``attn_every // 2`` (:func:`hybrid_config`; ``mixer`` and
    ``model_overrides`` go there too).

    With ``task``: each model (with the task's vocabulary, seeded by ``cfg.seed``) trains on it,
    :func:`ssmkit.train.train_on_task` (``steps``, ``batch``, ``lr``: default ``cfg.lr``), giving
    ``task_loss``, ``task_acc``. With ``lm_tokens`` > 0 and ``data`` / ``val_data`` (prepared
    shards): each model (with the data's vocabulary) also trains as a language model with the
    Trainer and ``cfg``'s recipe for ``lm_tokens`` tokens, one micro-batch per step (warmup: at most
    a tenth of the steps), evaluated once at the end, in ``out_dir/<label>``, giving ``val_loss``.
    Every row: ``label``, ``mixer`` (the SSM's), ``attn_every``, ``layers`` (:func:`layer_pattern`),
    ``attn_share``, ``params`` (task vocabulary)."""
    shape = {k: v for k, v in (("d_model", width), ("n_layer", depth)) if v is not None}
    lr = cfg.lr if lr is None else lr
    rows = []
    for i, every in enumerate(attn_every, 1):
        label = f"attn_every_{every}" + (f"_{mixer}" if mixer else "")
        step_line(i, len(attn_every), f"training {label}")
        run = hybrid_config(cfg, every, mixer=mixer, **shape, **model_overrides)
        ssm = [m for m in _mixers(run) if m in SSM_MIXERS]
        row = {
            "label": label,
            "mixer": ssm[0] if ssm else "none",
            "attn_every": every,
            "layers": layer_pattern(run),
            "attn_share": attention_share(run),
        }
        if task is not None:
            model = build_model(run.model_config(vocab_size=task.vocab_size), seed=run.seed)
            model = model.to(pick_device(cfg.device))
            row["params"] = model.num_parameters()
            fit = train_on_task(model, task, steps, batch, lr, cfg.seed)
            row.update(
                task_loss=round(fit["loss"], 4),
                task_acc=round(fit["accuracy"], 4),
                task_seconds=round(fit["seconds"], 1),
            )
        if lm_tokens:
            if data is None or val_data is None or out_dir is None:
                raise ValueError("ratio_sweep: lm_tokens needs data, val_data and out_dir")
            per_step = cfg.micro_batch * cfg.seq_len
            total = max(1, lm_tokens // per_step)
            lm = dataclasses.replace(
                run,
                max_tokens=total * per_step,
                max_steps=None,
                batch_tokens=per_step,
                eval_every=0,
                warmup_steps=min(cfg.warmup_steps, total // 10),
                out_dir=str(Path(out_dir) / label),
                overwrite=True,
            )
            row.update(_train_lm(lm, data, val_data, label))
        rows.append(row)
    return rows


def mixer_comparison(
    cfg, task=None, *, attn_every: int, rows: list[dict] = (), mixers=("mamba1", "mamba2"), **sweep
) -> list[dict]:
    """The same hybrid (``attn_every``) with each of ``mixers`` around the attention (default
    Mamba-1 and Mamba-2; add "mamba3" for Mamba-3), one :func:`ratio_sweep` row each, in that order;
    a row of ``rows`` with that mixer and ``attn_every`` (a sweep run with the same arguments) is
    reused instead of trained again. Each mixer's layers are sized by
    :meth:`ssmkit.ModelConfig.with_mixer` (its own state size, heads and a chunk of 64 at that
    width; ``sweep``'s model fields win)."""
    unknown = [m for m in mixers if m not in SSM_MIXERS]
    if unknown or not mixers:
        raise ValueError(
            f"mixers={list(mixers)!r} is not valid; valid: a non-empty list of "
            f"{', '.join(SSM_MIXERS)}"
        )
    out = []
    for mixer in mixers:
        done = [r for r in rows if r["attn_every"] == attn_every and r.get("mixer") == mixer]
        out.append(
            dict(done[0])
            if done
            else ratio_sweep(cfg, task, attn_every=(attn_every,), mixer=mixer, **sweep)[0]
        )
    return out


# --- long context ---------------------------------------------------------------------------------


def context_models(
    cfg,
    attn_every: int,
    attn_offset: int | None = None,
    vocab_size: int = 256,
    max_len: int = 4096,
    **hybrid_overrides,
) -> dict:
    """Fresh (untrained) models of ``cfg``'s width and depth for timing: "Mamba" (no attention),
    "Hybrid" (:func:`hybrid_config`, with ``hybrid_overrides``, e.g.
    ``attn_cfg={"window_size": 128}``) and "Transformer++"
    (:func:`~ssmkit.models.matched_transformer` of the Mamba model), with a ``vocab_size``-row
    vocabulary, so that the LM head (the same O(L·V) for all three) does not hide what the mixers
    cost; on ``cfg.device``, seeded by ``cfg.seed``."""
    from ...models import matched_transformer

    device = pick_device(cfg.device)
    mamba = build_model(hybrid_config(cfg, 0).model_config(vocab_size=vocab_size), seed=cfg.seed)
    hybrid = hybrid_config(cfg, attn_every, attn_offset, **hybrid_overrides)
    mixed = build_model(hybrid.model_config(vocab_size=vocab_size), seed=hybrid.seed)
    llama = matched_transformer(mamba, max_len=max_len)
    return {
        name: m.to(device)
        for name, m in (("Mamba", mamba), ("Hybrid", mixed), ("Transformer++", llama))
    }


def _checkpointing(model, on: bool) -> None:
    """Activation checkpointing on or off: ssmkit's ``backbone.gradient_checkpointing``;
    transformers' ``activation_checkpointing_enable()`` / ``_disable()``
    (``gradient_checkpointing_*`` before 5.x)."""
    backbone = getattr(model, "backbone", None)
    if hasattr(backbone, "gradient_checkpointing"):
        backbone.gradient_checkpointing = on
        return
    verb = "enable" if on else "disable"
    switch = getattr(model, f"activation_checkpointing_{verb}", None) or getattr(
        model, f"gradient_checkpointing_{verb}"
    )
    switch()


def context_costs(
    models: dict,
    lengths,
    new_tokens: int = 16,
    steps: int = 1,
    warmup: int = 0,
    checkpoint_from: int = 32768,
) -> list[dict]:
    """Per model and length L (ascending), batch 1: a training step (forward + backward, no
    optimizer: :func:`ssmkit.eval.long_context.train_step_cost`) and greedy generation of
    ``new_tokens`` after an L-token prompt (:func:`~ssmkit.eval.long_context.generation_cost`).
    Lengths outer, models inner, so a machine's drift hits all models alike; each model first runs
    one untimed 64-token step. From ``checkpoint_from`` tokens on, every model trains with
    activation checkpointing (each block recomputed in the backward pass), as long windows need (row
    key ``checkpointed``).

    Rows: ``model``, ``seq_len``, ``train_tok_s`` (tokens/s), ``train_peak_mb`` (extra peak MiB of
    the step), ``prefill_s``, ``decode_tok_s`` (tokens/s after the prompt), ``cache_mb`` (the
    generation cache at the end: SSM states, attention keys and values), ``gen_peak_mb``; None where
    unmeasurable."""
    from ...eval.long_context import generation_cost, train_step_cost

    lengths = [checks.integer(n, "length", minimum=2) for n in lengths]
    if lengths != sorted(lengths):
        raise ValueError(f"context lengths must be ascending; got {lengths}")
    for model in models.values():
        train_step_cost(model, 64, steps=1, warmup=0)
        model.zero_grad(set_to_none=True)
    rows = []
    for length in lengths:
        for name, model in models.items():
            _checkpointing(model, length >= checkpoint_from)
            try:
                train = train_step_cost(model, length, steps=steps, warmup=warmup)
            finally:
                model.zero_grad(set_to_none=True)  # the gradients go before the next model runs
                _checkpointing(model, False)
            gen = generation_cost(model, length, new_tokens=new_tokens)
            rows.append(
                {
                    "model": name,
                    "seq_len": length,
                    "train_tok_s": round(train["tokens_per_s"], 1),
                    "train_peak_mb": rounded(train["peak_mb"]),
                    "prefill_s": round(gen["prefill_s"], 3),
                    "decode_tok_s": round(gen["decode_tokens_per_s"], 1),
                    "cache_mb": round(gen["cache_mb"], 3),
                    "gen_peak_mb": rounded(gen["peak_mb"]),
                    "checkpointed": length >= checkpoint_from,
                }
            )
    return rows


def crossovers(rows: list[dict], ssm: str = "Mamba", attn: str = "Transformer++") -> dict:
    """For each measure of :func:`context_costs`: the length from which ``ssm`` beats ``attn`` at
    every longer length measured (:func:`ssmkit.eval.long_context.crossover`), or None (still behind
    at the longest). Higher is better for the rates, lower for memory and prefill time."""
    from ...eval.long_context import crossover

    by = {(r["model"], r["seq_len"]): r for r in rows}
    lengths = sorted({r["seq_len"] for r in rows})
    return {
        key: crossover(
            lengths,
            [by.get((ssm, n)) for n in lengths],
            [by.get((attn, n)) for n in lengths],
            key=key,
            higher_is_better=key.endswith("tok_s"),
        )
        for key in ("train_tok_s", "train_peak_mb", "prefill_s", "decode_tok_s", "cache_mb")
    }


def extrapolation(models: dict, val_dir, lengths, max_windows: int = 4) -> list[dict]:
    """Validation loss of each (trained) model on windows of each length
    (:func:`ssmkit.eval.long_context.length_extrapolation`); rows ``model``, ``seq_len``, ``loss``,
    ``ppl``, ``windows``, ``note`` (a length longer than the split is skipped with a note)."""
    from ...eval.long_context import length_extrapolation

    rows = []
    for name, model in models.items():
        for row in length_extrapolation(model, val_dir, lengths, max_windows=max_windows):
            rows.append(
                {
                    "model": name,
                    **row,
                    "loss": rounded(row["loss"], 4),
                    "ppl": rounded(row["ppl"], 2),
                }
            )
    return rows
