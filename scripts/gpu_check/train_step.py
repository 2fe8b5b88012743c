"""Section ``train_step``: 130M Mamba-1 and Mamba-2 presets, seq 2048, micro-batch 8, bf16 autocast
with fp32 master weights (as ssmkit's Trainer) and an AdamW step: tokens/s and MFU against
ssmkit.eval.peak_flops(device, "bf16"); beside transformers' MambaForCausalLM / Mamba2ForCausalLM
(the same weights, through save_pretrained(format="hf")) and a matched LlamaForCausalLM (SDPA),
timed round-robin on the same GPU; ratios."""

from __future__ import annotations

import math
import os
import statistics

import torch

from .context import NO_CUDA, Context, free, max_rel, no_tf32, rng
from .models import FULL_PRESETS, QUICK_OVERRIDES, QUICK_PRESETS, build_models

OOM_ERRORS = tuple({getattr(torch, "OutOfMemoryError", RuntimeError), torch.cuda.OutOfMemoryError})


def _same_weights(ctx: Context, ours, theirs, vocab: int) -> float:
    """max |logits(ours) - logits(theirs)| / max |logits(ours)| on one short random sequence,
    fp32."""
    ids = torch.randint(0, vocab, (1, 32), generator=rng(5)).to(ctx.device)
    with torch.no_grad(), no_tf32():
        a = ours(ids).logits[..., :vocab]
        b = theirs(ids).logits[..., :vocab]
    return max_rel(b, a)


def _fit_batch(ctx: Context, name: str, model, make_step, batch: int):
    """Run one step at ``batch`` (the first warm-up), halving the batch on out-of-memory. Returns
    (batch, step, peak MiB of that step or None)."""
    while True:
        oom = False
        step = None
        try:
            step = make_step(batch)
            if ctx.cuda:
                ctx.sync()
                torch.cuda.reset_peak_memory_stats(ctx.device)
                base = torch.cuda.memory_allocated(ctx.device)
            step()
            peak = (
                (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20 if ctx.cuda else None
            )
            return batch, step, peak
        except OOM_ERRORS:
            if batch == 1:
                raise
            oom = True
        if oom:
            del step
            model.zero_grad(set_to_none=True)  # what a backward cut short had accumulated
            free()
            ctx.log(f"  {name}: out of memory at micro-batch {batch}; trying {batch // 2}")
            batch //= 2


def run(ctx: Context) -> dict:
    if not ctx.cuda and not ctx.quick:
        return {"status": NO_CUDA + " (--quick runs a tiny version on the CPU)"}
    from ssmkit.eval import flops_per_token, mfu, peak_flops, time_round_robin
    from ssmkit.eval.loss import lm_loss
    from ssmkit.ops import backend

    presets = QUICK_PRESETS if ctx.quick else FULL_PRESETS
    seq, batch = (64, 2) if ctx.quick else (2048, 8)
    steps, warmup = (1, 1) if ctx.quick else (3, 2)
    models, notes = build_models(ctx, presets, seq, peers=True)
    vocab = models["ssmkit_mamba1"].config.vocab_size
    same = {}
    for ours, peer in (("ssmkit_mamba1", "hf_mamba1"), ("ssmkit_mamba2", "hf_mamba2")):
        try:
            same[peer] = _same_weights(ctx, models[ours], models[peer], vocab)
        except Exception as exc:  # a peer's failure is reported, not fatal
            same[peer] = f"error: {type(exc).__name__}: {exc}"[:300]
    kernels = ctx.cuda and any(
        backend.kernel_import_error(m) is None for m in backend.KERNEL_MODULES.values()
    )
    # transformers' Mamba without mamba_ssm runs a per-token loop holding (batch, d_inner, L, N)
    # fp32 tensors for backward (~6 GB per layer at batch 8 x 2048): it starts at batch 2 and is
    # timed in 2 rounds only
    slow = set() if kernels else {"hf_mamba1"}
    first_batch = {name: (2 if name in slow and not ctx.quick else batch) for name in models}
    flops = {
        name: flops_per_token(
            models[
                "ssmkit_mamba1"
                if name == "hf_mamba1"
                else "ssmkit_mamba2"
                if name == "hf_mamba2"
                else name
            ],
            seq,
        )
        for name in models
    }
    peak = peak_flops(ctx.device, "bf16" if ctx.precision == "bf16" else "fp32")
    opts = {
        name: torch.optim.AdamW(
            m.parameters(),
            lr=1e-4,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            fused=True if ctx.cuda else None,
        )
        for name, m in models.items()
    }
    losses = {}

    def make_step(name):
        model, opt = models[name], opts[name]

        def make(b):
            ids = torch.randint(0, vocab, (b, seq + 1), generator=rng(1)).to(ctx.device)
            x, y = ids[:, :-1], ids[:, 1:]

            def step():
                model.train()
                with ctx.autocast():
                    loss = lm_loss(model, x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[name] = loss.detach()

            return step

        return make

    calls, batches, peaks, errors = {}, {}, {}, {}
    for name in models:
        try:
            batches[name], calls[name], peaks[name] = _fit_batch(
                ctx, name, models[name], make_step(name), first_batch[name]
            )
        except Exception as exc:  # one model failing leaves the others' numbers
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
            ctx.log(f"  {name}: error: {errors[name]}")
            models[name].zero_grad(set_to_none=True)
            free()
    if kernels:  # ssmkit with its kernels (automatic) and, beside it, forced onto its torch path
        for name in ("ssmkit_mamba1", "ssmkit_mamba2"):
            calls[name + "_torch"], batches[name + "_torch"], peaks[name + "_torch"] = (
                _with_backend("torch", calls[name]),
                batches[name],
                None,
            )
            flops[name + "_torch"] = flops[name]
    more = max(warmup - 1, 0)  # _fit_batch's step was the first warm-up; the slow peer gets no more
    seconds = time_round_robin(
        calls,
        steps,
        more,
        skip=lambda n, r: n in slow and r != more,
        on_round=lambda r: ctx.log(f"  round {r + 1}/{steps + more} done ({ctx.elapsed():.0f} s)"),
        device=ctx.device,
    )
    rows = {}
    for name, secs in seconds.items():
        tps = batches[name] * seq / statistics.median(secs)
        loss = losses.get(name.removesuffix("_torch"))
        rows[name] = {
            "micro_batch": batches[name],
            "step_s": statistics.median(secs),
            "tokens_per_s": tps,
            "mfu": mfu(flops[name], tps, peak),
            "flops_per_token": flops[name],
            "peak_mb": peaks.get(name),
            "timed_steps": len(secs),
            "loss": None if loss is None else float(loss),
        }
    rows.update({name: {"error": error} for name, error in errors.items()})

    def ratio(a, b):
        ok = "tokens_per_s" in rows.get(a, {}) and "tokens_per_s" in rows.get(b, {})
        return rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"] if ok else None

    ratios = {
        "ssmkit_mamba1_vs_hf_mamba1": ratio("ssmkit_mamba1", "hf_mamba1"),
        "ssmkit_mamba2_vs_hf_mamba2": ratio("ssmkit_mamba2", "hf_mamba2"),
        "ssmkit_mamba1_vs_llama": ratio("ssmkit_mamba1", "llama"),
        "ssmkit_mamba2_vs_llama": ratio("ssmkit_mamba2", "llama"),
    }
    from ssmkit.models import parameter_report

    params = {
        r["model"]: {k: r[k] for k in ("params", "non_embedding", "layers")}
        for r in parameter_report(models)
    }
    ctx.log(
        f"  {'model':<22}{'params':>13}{'batch':>6}{'step s':>9}{'tokens/s':>11}{'MFU':>8}"
        f"{'peak MB':>9}"
    )
    for name, r in rows.items():
        p = params.get(name.removesuffix("_torch"), {}).get("params", 0)
        if "error" in r:
            ctx.log(f"  {name:<22}{p:>13,}  error: {r['error'][:80]}")
            continue
        shown_mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        shown_peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        ctx.log(
            f"  {name:<22}{p:>13,}{r['micro_batch']:>6}{r['step_s']:>9.3f}"
            f"{r['tokens_per_s']:>11,.0f}{shown_mfu:>8}{shown_peak:>9}"
        )
    ctx.log("  " + ", ".join(f"{k} {'-' if v is None else f'{v:.2f}x'}" for k, v in ratios.items()))
    for name in list(models):
        del models[name]
    opts.clear()
    calls.clear()
    free()
    bad = [n for n, r in rows.items() if r.get("loss") is not None and not math.isfinite(r["loss"])]
    ours_failed = [n for n in errors if n.startswith("ssmkit")]  # a peer's error is only reported
    return {
        "pass": not ours_failed and not bad,
        "presets": list(presets),
        "overrides": QUICK_OVERRIDES if ctx.quick else {},
        "seq_len": seq,
        "precision": ctx.precision,
        "peak_flops": peak,
        "timing": f"median of {steps} round-robin steps after {warmup} warm-up "
        f"({', '.join(sorted(slow)) or 'none'}: 1 timed)",
        "optimizer": "AdamW (fused on CUDA), grad clip 1.0",
        "same_weights_max_rel_logit_diff": same,
        "params": params,
        "models": rows,
        "ratios": ratios,
        "notes": notes,
        **({"nonfinite_loss": bad} if bad else {}),
    }


def _with_backend(name: str, fn):
    """``fn`` with SSMKIT_BACKEND=name for the call (read by ssmkit's ops on every call)."""

    def call():
        old = os.environ.get("SSMKIT_BACKEND")
        os.environ["SSMKIT_BACKEND"] = name
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop("SSMKIT_BACKEND", None)
            else:
                os.environ["SSMKIT_BACKEND"] = old

    return call
