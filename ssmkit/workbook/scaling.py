"""Stage 2 of the plan, the measuring half of notebooks/02_scale_up.ipynb: Mamba-2 against Mamba-1 training
throughput (2.4), lm-eval scores of the notebook's models (2.5) and a small scaling sweep with a fitted power
law (beyond the plan). The distributed, data and precision sections are in :mod:`.scale_up`.

    rows = mixer_throughput([256, 1024], [16, 64])              # Mamba-2 / Mamba-1 training tokens/s
    rows = mixer_throughput([256], [64], mixers=("mamba1", "mamba2", "mamba3"))    # ... and Mamba-3's
    evaluate_models({"fp32": model}, "offline", tokenizer="byte")   # lm-eval tasks (ssmkit.eval)
    rows = scaling_sweep(cfg, [32, 64, 128], tokens, train_dir, val_dir, out_dir=d)
    fit = fit_power_law([r["compute"] for r in rows], [r["val_loss"] for r in rows])   # L = a * C^-b

Glossary: C = training compute in FLOPs (:func:`ssmkit.eval.flops_per_token` x tokens: 6 per weight per
token plus the scans), L = validation loss in nats/token, N = d_state (the SSM state size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import statistics
import sys
import time
from pathlib import Path

from .. import checks
from ..models import SSM_MIXERS

__all__ = ["evaluate_models", "fit_power_law", "mixer_throughput", "model_compute", "plot_scaling",
           "predict_loss", "scaling_sweep", "score_table"]


# --- 2.4 Mamba-2 against Mamba-1 ------------------------------------------------------------------

MIXERS = SSM_MIXERS                          # the SSM mixers mixer_throughput can time


def mixer_throughput(seq_lens, d_states, *, d_model: int = 128, n_layer: int = 2, vocab_size: int = 257,
                     batch: int = 1, headdim: int = 32, chunk_size: int = 64, steps: int = 3, warmup: int = 1,
                     device: str = "cpu", seed: int = 0, mixers=("mamba1", "mamba2")) -> list[dict]:
    """Training tokens/s (forward + backward, no optimizer: :func:`ssmkit.eval.long_context.make_train_step`)
    of LMs of the same width and depth, one per mixer of ``mixers`` (default Mamba-1 and Mamba-2; any of
    :data:`MIXERS`, e.g. with "mamba3": Mamba-3 SISO), for each sequence length and state size N. The
    models are timed round-robin (:func:`ssmkit.eval.time_round_robin`), so a busy machine slows all
    alike; ``warmup`` untimed rounds, then the median of ``steps``. Mamba-2 and Mamba-3: ``headdim`` P,
    chunk ``chunk_size`` Q. Rows: ``seq_len``, ``d_state``, ``<mixer>_tok_s`` and ``<mixer>_params`` for
    each mixer, ``ratio`` (Mamba-2 / Mamba-1, when both run) and ``mamba3_ratio`` (Mamba-3 / Mamba-2, when
    both run)."""
    import torch

    from ..eval import time_round_robin
    from ..eval.long_context import make_train_step
    from ..models import ModelConfig, build_model

    mixers = tuple(mixers)
    if not mixers or len(set(mixers)) != len(mixers) or any(m not in MIXERS for m in mixers):
        raise ValueError(f"mixers={list(mixers)!r} is not valid; valid: distinct names of "
                         f"{', '.join(MIXERS)}")
    rows = []
    for seq_len in seq_lens:
        for d_state in d_states:
            steps_of, params = {}, {}
            for mixer in mixers:
                extra = {"headdim": headdim, "chunk_size": chunk_size} if mixer != "mamba1" else {}
                torch.manual_seed(seed)
                model = build_model(ModelConfig(d_model=d_model, n_layer=n_layer, vocab_size=vocab_size,
                                                mixer=mixer, d_state=d_state, **extra)).to(device)
                steps_of[mixer] = make_train_step(model, seq_len, batch, seed=seed)
                params[mixer] = model.num_parameters()
            seconds = time_round_robin(steps_of, steps=steps, warmup=warmup, device=device)
            rate = {m: batch * seq_len / statistics.median(s) for m, s in seconds.items()}
            row = {"seq_len": seq_len, "d_state": d_state}
            row.update({f"{m}_tok_s": round(rate[m]) for m in mixers})
            for key, top, bottom in (("ratio", "mamba2", "mamba1"), ("mamba3_ratio", "mamba3", "mamba2")):
                if top in rate and bottom in rate:
                    row[key] = round(rate[top] / rate[bottom], 2)
            row.update({f"{m}_params": params[m] for m in mixers})
            rows.append(row)
    return rows


# --- 2.5 evaluation -------------------------------------------------------------------------------

def evaluate_models(models: dict, tasks, *, tokenizer=None, limit=None, batch_size: int = 8, out_dir=None,
                    device: str = "cpu", seed: int = 0, quiet: bool = True) -> tuple[list[dict], dict]:
    """Each model on lm-eval ``tasks`` (:func:`ssmkit.eval.run_lm_eval`; ``"offline"``: the tasks that ship
    with ssmkit, :data:`ssmkit.eval.OFFLINE_TASKS`; ``"plan"``: the plan's, :data:`ssmkit.eval.PLAN_TASKS`,
    which need the hub or its cache). ``models``: {name: an nn.Module or a model directory}. Results of
    each go to ``out_dir/<name>`` (results.json, results.md). ``quiet``: lm-eval's progress bars and
    log lines hidden (redrawn bars are hundreds of lines in a headless notebook); on an error their last
    lines are printed before it is raised. Returns (rows: one per model, task and metric, with its value
    and stderr; {name: lm-eval's results dict})."""
    from ..eval import OFFLINE_TASKS, PLAN_TASKS, run_lm_eval

    names = {"offline": list(OFFLINE_TASKS), "plan": list(PLAN_TASKS)}.get(tasks, tasks)
    rows, results = [], {}
    for name, model in models.items():
        where = None if out_dir is None else Path(out_dir) / name.replace(" ", "_")
        with _quiet(quiet):
            res = run_lm_eval(model, names, tokenizer=tokenizer, batch_size=batch_size, limit=limit,
                              out_dir=where, device=device, seed=seed)
        results[name] = res
        for task, metrics in res["results"].items():
            for key, value in metrics.items():
                metric, comma, _filter = key.partition(",")            # "acc,none": metric, filter
                if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                    continue
                err = metrics.get(f"{metric}_stderr,{_filter}")
                rows.append({"model": name, "task": task, "metric": metric, "value": round(float(value), 4),
                             "stderr": round(float(err), 4) if isinstance(err, (int, float)) else None})
    return rows, results


def score_table(rows: list[dict], digits: int = 4) -> list[dict]:
    """:func:`evaluate_models`' rows side by side: one row per task and metric, one column per model."""
    out: dict = {}
    for r in rows:
        row = out.setdefault((r["task"], r["metric"]), {"task": r["task"], "metric": r["metric"]})
        row[r["model"]] = round(r["value"], digits)
    return list(out.values())


@contextlib.contextmanager
def _quiet(on: bool):
    """stderr (tqdm bars) captured and lm-eval's loggers at ERROR while on; the capture's tail is printed
    if the body raises."""
    if not on:
        yield
        return
    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm-eval")]
    levels = [lg.level for lg in loggers]
    sink = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with contextlib.redirect_stderr(sink):
            yield
    except BaseException:
        print("\n".join(sink.getvalue().replace("\r", "\n").splitlines()[-20:]), file=sys.stderr)
        raise
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# --- beyond the plan: a scaling sweep -------------------------------------------------------------

def scaling_sweep(cfg, widths, tokens: int, data, val_data, *, out_dir, n_layer: int | None = None,
                  callbacks=()) -> list[dict]:
    """Models of ``cfg``'s recipe at each width (d_model; ``n_layer`` default the preset's), each trained on
    the same ``tokens`` tokens (in the same order) with the Trainer in this process, evaluated once at
    the end, in ``out_dir/d<width>``. Rows: ``d_model``, ``n_layer``, ``params``, ``params_no_emb``,
    ``flops_per_token`` (:func:`ssmkit.eval.flops_per_token`), ``compute`` (= flops_per_token x tokens
    trained), ``tokens``, ``val_loss``, ``seconds``."""
    from ..data import TokenLoader
    from ..eval import flops_per_token
    from ..train import Trainer
    from .hybrid import build_lm

    tokens = checks.integer(tokens, "tokens", minimum=1)
    vocab = TokenLoader(data, cfg.seq_len, 1).index["vocab_size"]
    steps = max(1, tokens // cfg.batch_tokens)
    rows = []
    for width in widths:
        over = {**cfg.model_overrides, "d_model": checks.integer(width, "width", minimum=8)}
        if n_layer is not None:
            over["n_layer"] = n_layer
        run_cfg = dataclasses.replace(cfg, model_overrides=over, max_steps=steps, max_tokens=None,
                                      eval_every=0, warmup_steps=min(cfg.warmup_steps, steps // 10),
                                      overwrite=True, out_dir=str(Path(out_dir) / f"d{width}"))
        model = build_lm(run_cfg, vocab)
        start = time.perf_counter()
        history = Trainer(model, run_cfg, data=data, val_data=val_data, callbacks=list(callbacks),
                          name=f"d_model {width}").fit()
        evals = [r for r in history if r["kind"] == "eval"]
        fpt = flops_per_token(model, cfg.seq_len)
        trained = steps * cfg.batch_tokens
        rows.append({"d_model": width, "n_layer": model.config.n_layer, "params": model.num_parameters(),
                     "params_no_emb": model.num_parameters(exclude_embeddings=True),
                     "flops_per_token": fpt, "compute": fpt * trained, "tokens": trained,
                     "val_loss": round(evals[-1]["val_loss"], 4),
                     "seconds": round(time.perf_counter() - start, 1)})
    return rows


def fit_power_law(x, y) -> dict:
    """Least squares of log y = log a - b log x: the power law y = a * x^-b through points (x, y) > 0 (at
    least two distinct x). Returns ``a``, ``b`` (the exponent, positive when y falls), ``r2`` (of the log-log
    fit) and ``points``."""
    xs, ys = [float(v) for v in x], [float(v) for v in y]
    if len(xs) != len(ys) or len(set(xs)) < 2 or min(xs + ys) <= 0:
        raise ValueError(f"fit_power_law needs >= 2 distinct positive x and positive y of the same length; "
                         f"got x={xs}, y={ys}")
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxx = sum((v - mx) ** 2 for v in lx)
    slope = sum((u - mx) * (v - my) for u, v in zip(lx, ly)) / sxx
    intercept = my - slope * mx
    total = sum((v - my) ** 2 for v in ly)
    resid = sum((v - (intercept + slope * u)) ** 2 for u, v in zip(lx, ly))
    return {"a": math.exp(intercept), "b": -slope, "r2": 1 - resid / total if total else 1.0,
            "points": len(xs)}


def predict_loss(fit: dict, compute: float) -> float:
    """The fitted power law at ``compute``: a * compute^-b."""
    return fit["a"] * float(compute) ** -fit["b"]


def model_compute(preset: str, tokens: int, *, vocab_size: int, seq_len: int) -> dict:
    """Parameters and training compute (:func:`ssmkit.eval.flops_per_token` x ``tokens``) of a model
    preset with ``vocab_size``, counted on the meta device (nothing allocated)."""
    import torch

    from ..eval import flops_per_token
    from ..models import ModelConfig, build_model

    with torch.device("meta"):
        model = build_model(ModelConfig.preset(preset, vocab_size=vocab_size))
    fpt = flops_per_token(model, seq_len)
    return {"preset": preset, "params": model.num_parameters(), "flops_per_token": fpt,
            "compute": fpt * tokens, "tokens": tokens}


def plot_scaling(rows: list[dict], fit: dict, path, *, extra: dict | None = None, title: str | None = None,
                 show: bool | None = None):
    """Validation loss against compute on log-log axes: the sweep's points, the fitted power law, and
    ``extra`` ({"label": (compute, loss)}, e.g. the prediction for 130M) as stars. Saved to ``path``
    (written whole) and shown in a Jupyter kernel. Returns the figure."""

    from matplotlib.figure import Figure

    from ..plots import save_and_show

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.add_subplot()
    xs, ys = [r["compute"] for r in rows], [r["val_loss"] for r in rows]
    ax.loglog(xs, ys, "o", ms=6, label="sweep (d_model " + ", ".join(str(r["d_model"]) for r in rows) + ")")
    lo, hi = min(xs), max([*xs, *(c for c, _ in (extra or {}).values())])
    grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    ax.loglog(grid, [predict_loss(fit, c) for c in grid], "-", lw=1.2,
              label=f"fit: L = {fit['a']:.3g} C^-{fit['b']:.3f} (R² {fit['r2']:.2f})")
    for label, (c, loss) in (extra or {}).items():
        ax.loglog([c], [loss], "*", ms=12, label=f"{label}: {loss:.2f}")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return save_and_show(fig, path, show)
