"""Section ``generation``: ssmkit.eval.generation_cost of ssmkit Mamba-1 / Mamba-2 130M and the
matched Llama (KV cache) at prompts 2K and 16K, batch 1 and 8: prefill s, decode tokens/s, peak
memory; 16 new tokens."""

from __future__ import annotations

import gc

from .context import NO_CUDA, Context, free
from .models import FULL_PRESETS, QUICK_PRESETS, build_models


def run(ctx: Context) -> dict:
    if not ctx.cuda and not ctx.quick:
        return {"status": NO_CUDA + " (--quick runs a tiny version on the CPU)"}
    presets = QUICK_PRESETS if ctx.quick else FULL_PRESETS
    prompts, batches, new_tokens = (
        ([16, 64], [1, 2], 2) if ctx.quick else ([2048, 16384], [1, 8], 16)
    )
    models, notes = build_models(ctx, presets, max(prompts) + new_tokens + 8, peers=False)
    for m in models.values():
        m.eval()
    # generation_cost runs gc.collect() twice a call (its memory baseline), slow with transformers
    # imported and three models alive: what exists at this point is frozen out of those
    # collections until the end.
    gc.freeze()
    try:
        return _generation_cells(ctx, models, notes, presets, prompts, batches, new_tokens)
    finally:
        gc.unfreeze()
        models.clear()
        free()


def _generation_cells(
    ctx: Context, models: dict, notes: dict, presets, prompts, batches, new_tokens
) -> dict:
    from ssmkit.eval import generation_cost

    with ctx.autocast():
        for name, m in models.items():  # warm-up: kernels, allocator, autotuning
            generation_cost(m, min(prompts), 1 if ctx.quick else 2, batch=1, device=ctx.device)
    cells, skipped = [], []
    for prompt in prompts:
        for batch in batches:
            if ctx.remaining() < (5 if ctx.quick else 30):
                skipped.append(f"{prompt}x{batch}")
                continue
            row = {"prompt_len": prompt, "batch": batch}
            for name, m in models.items():
                try:
                    with ctx.autocast():
                        cost = generation_cost(
                            m, prompt, new_tokens, batch=batch, device=ctx.device
                        )
                    row[name] = {
                        k: cost[k]
                        for k in (
                            "prefill_s",
                            "decode_tokens_per_s",
                            "peak_mb",
                            "decode_peak_mb",
                            "cache_mb",
                        )
                    }
                except Exception as exc:  # out of memory, a peer's quirk: that cell only
                    row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    free()
            for name in ("ssmkit_mamba1", "ssmkit_mamba2"):
                a, b = row[name].get("decode_tokens_per_s"), row["llama"].get("decode_tokens_per_s")
                row[f"{name}_decode_vs_llama"] = None if not a or not b else a / b
            cells.append(row)
            ctx.log(
                f"  prompt {prompt:>6} x batch {batch}: decode tokens/s "
                + ", ".join(
                    f"{n} {row[n].get('decode_tokens_per_s', float('nan')):,.0f}" for n in models
                )
                + "; prefill s "
                + ", ".join(f"{n} {row[n].get('prefill_s', float('nan')):.3f}" for n in models)
            )
    flat = {}
    for name in ("ssmkit_mamba1", "ssmkit_mamba2"):
        for batch in batches:
            mine = [
                c
                for c in cells
                if c["batch"] == batch and c[name].get("decode_peak_mb") is not None
            ]
            if len(mine) >= 2:
                lo, hi = mine[0][name]["decode_peak_mb"], mine[-1][name]["decode_peak_mb"]
                flat[f"{name}_batch{batch}"] = {
                    "from": mine[0]["prompt_len"],
                    "to": mine[-1]["prompt_len"],
                    "decode_peak_mb": [lo, hi],
                }
    ours_failed = [
        f"{c['prompt_len']}x{c['batch']}/{n}"
        for c in cells
        for n in ("ssmkit_mamba1", "ssmkit_mamba2")
        if "error" in c[n]
    ]
    return {
        "pass": not ours_failed,
        **({"failed": ours_failed} if ours_failed else {}),
        "presets": list(presets),
        "new_tokens": new_tokens,
        "precision": ctx.precision,
        "prefill": "whole prompt at once",
        "cells": cells,
        "decode_memory": flat,
        "notes": notes,
        **({"cells_skipped_for_time": skipped} if skipped else {}),
    }
