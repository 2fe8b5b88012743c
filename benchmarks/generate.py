"""Generation benchmark (CPU): prefill latency, decode tokens/s and peak memory of greedy generation
for ssmkit Mamba-1, Mamba-2 and a Jamba-style hybrid against a transformers Llama with its KV cache.

For each prompt length P (default 512, 2048, 8192) and batch size (default 1 and 8): a random prompt
of (batch, P) tokens is prefilled through the generation cache in chunks of --prefill-chunk
positions, then --new-tokens greedy one-token steps follow (ssmkit.eval.generation_cost, the same
loop for every model).

* prefill s     wall time of the prompt (the cache filled);
* decode tok/s  batch x new tokens / decode seconds: the per-token cost a chat or a sampler pays;
* decode MB     extra peak RSS while decoding, over the memory before the call: the
                cache and one step's activations (resolution ~1 MB: RSS is
                page-granular and glibc reuses freed heap pages);
* peak MB       extra peak RSS of the whole call (chunked prefill + decode);
* cache MB      the cache's bytes at the end (SSM states; keys and values).

Models, all d_model 256, vocab 1000, tied embeddings (seed 0): Mamba-1 (4 layers, d_state 16),
Mamba-2 (4 layers, d_state 64, headdim 32), hybrid (4 layers, Mamba-1 with full causal attention at
layer 2, 8 heads of 32), and transformers' LlamaForCausalLM (SDPA, DynamicCache) sized by
ssmkit.models.matched_transformer to Mamba-1's non-embedding parameters. Every model runs one
generation per round, round-robin in one process: drift hits all alike and the ratios hold when
absolute times don't.

Targets (issue "Speed II"), printed as PASS / FAIL lines: decode tokens/s at batch 8 >= 2x Llama's
at a 2K prompt and >= 4x at 8K, for Mamba-1 and Mamba-2; their decode memory flat in the prompt
length (within 5% from the shortest to the longest prompt, or within the 1 MB resolution).

    .venv/bin/python benchmarks/generate.py [--prompts 512,2048,8192] [--batches 1,8] \
        [--new-tokens 32] [--rounds 2] [--prefill-chunk 1024] [--threads N] [--quick] [--json-only]

On a busy machine use --threads 1. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ["HF_HUB_OFFLINE"] = "1"  # no hub downloads; must precede the transformers import
import torch
from long_context import (
    fmt,
    ratio,
)  # the sibling benchmark's table helpers (benchmarks/ is on sys.path)

from ssmkit.eval.long_context import fix_mmap_threshold, generation_cost
from ssmkit.models import ModelConfig, build_model, matched_transformer, parameter_report

D_MODEL, N_LAYER, VOCAB = 256, 4, 1000
PROMPTS, BATCHES = [512, 2048, 8192], [1, 8]
QUICK_PROMPTS = [512, 2048]
# fmt: off
CONFIGS = {
    "mamba1": dict(mixer="mamba1", mamba1=dict(d_state=16)),
    "mamba2": dict(mixer="mamba2", mamba2=dict(d_state=64, headdim=32)),
    "hybrid": dict(mixer="mamba1", mamba1=dict(d_state=16), attn_every=4, attn_offset=2,
                   attn_cfg=dict(num_heads=8)),
}
# fmt: on
MODELS = [*CONFIGS, "llama"]
SSMS = ["mamba1", "mamba2"]
DECODE_TARGETS = {2048: 2.0, 8192: 4.0}  # prompt length -> decode tokens/s vs Llama at batch 8
TARGET_BATCH = 8
FLAT_TOLERANCE, FLAT_RESOLUTION_MB = 0.05, 1.0


def build_models(max_len: int) -> dict:
    models = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        models[name] = build_model(
            ModelConfig(d_model=D_MODEL, n_layer=N_LAYER, vocab_size=VOCAB, **cfg)
        )
    torch.manual_seed(0)
    models["llama"] = matched_transformer(models["mamba1"], max_len=max_len)
    return models


def bench(
    models: dict, prompt: int, batch: int, new_tokens: int, chunk: int | None, rounds: int, log
) -> dict:
    """Round-robin generation_cost calls: per model the median of each time and memory over the
    rounds."""
    runs = {n: [] for n in models}
    for r in range(rounds):
        for n, m in models.items():
            runs[n].append(generation_cost(m, prompt, new_tokens, batch=batch, prefill_chunk=chunk))
        log(
            f"  prompt {prompt} x batch {batch}, round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {runs[n][-1]['decode_tokens_per_s']:.0f} tok/s" for n in models)
        )
    out = {}
    for n, rs in runs.items():
        row = dict(rs[0])
        for key in ("prefill_s", "decode_s"):
            row[key] = statistics.median(x[key] for x in rs)
        row["decode_tokens_per_s"] = batch * new_tokens / row["decode_s"]
        for key in ("peak_mb", "decode_peak_mb"):
            row[key] = (
                None if any(x[key] is None for x in rs) else statistics.median(x[key] for x in rs)
            )
        out[n] = row
    return out


def print_table(title, cells, rows, key, spec=",.0f", ratios=True):
    print(f"\n{title}")
    head = f"{'prompt':>7}{'batch':>6}" + "".join(f"{n:>10}" for n in MODELS)
    if ratios:
        head += "".join(f"{n + '/llama':>14}" for n in CONFIGS)
    print(head)
    for (prompt, batch), row in zip(cells, rows):
        line = f"{prompt:>7}{batch:>6}" + "".join(fmt(row[n][key], spec) for n in MODELS)
        if ratios:
            line += "".join(
                fmt(ratio(row[n][key], row["llama"][key]), ".2f", 13) + "x" for n in CONFIGS
            )
        print(line)


def targets(cells, rows) -> dict:
    by_cell = dict(zip(cells, rows))
    decode = {}
    for prompt, want in DECODE_TARGETS.items():
        row = by_cell.get((prompt, TARGET_BATCH))
        got = {
            n: None
            if row is None
            else ratio(row[n]["decode_tokens_per_s"], row["llama"]["decode_tokens_per_s"])
            for n in SSMS
        }
        ok = None if None in got.values() else all(v >= want for v in got.values())
        decode[f"decode_{want:g}x_llama_at_{prompt}"] = {
            "pass": ok,
            "prompt": prompt,
            "batch": TARGET_BATCH,
            "target": want,
            "ratios": got,
        }
    flat = {}
    for batch in sorted({b for _, b in cells}):
        mine = sorted((p, by_cell[(p, b)]) for p, b in cells if b == batch)
        if len(mine) < 2:
            continue
        (lo, first), (hi, last) = mine[0], mine[-1]
        models = {}
        for n in SSMS:
            a, b = first[n]["decode_peak_mb"], last[n]["decode_peak_mb"]
            change = None if a is None or b is None else b - a
            models[n] = {
                "decode_peak_mb_shortest": a,
                "decode_peak_mb_longest": b,
                "change_mb": change,
                "flat": None
                if change is None
                else abs(change) <= max(FLAT_TOLERANCE * max(a, b), FLAT_RESOLUTION_MB),
            }
        oks = [v["flat"] for v in models.values()]
        flat[f"batch_{batch}"] = {
            "pass": None if None in oks else all(oks),
            "from": lo,
            "to": hi,
            "models": models,
        }
    return {"decode_speed": decode, "decode_memory_flat": flat}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", help="comma-separated prompt lengths (default 512,2048,8192)")
    p.add_argument(
        "--batches", help=f"comma-separated batch sizes (default {','.join(map(str, BATCHES))})"
    )
    p.add_argument(
        "--quick", action="store_true", help=f"prompts {','.join(map(str, QUICK_PROMPTS))}"
    )
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated after each prompt")
    p.add_argument("--rounds", type=int, default=2, help="round-robin rounds per cell")
    p.add_argument(
        "--prefill-chunk", type=int, default=1024, help="prefill chunk; 0: the whole prompt"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = p.parse_args()
    if args.prompts and args.quick:
        p.error("give --prompts or --quick, not both")
    try:
        prompts = (
            QUICK_PROMPTS
            if args.quick
            else [int(x) for x in args.prompts.split(",")]
            if args.prompts
            else PROMPTS
        )
        batches = [int(x) for x in args.batches.split(",")] if args.batches else BATCHES
    except ValueError:
        p.error("--prompts and --batches take comma-separated integers")
    prompts, batches = sorted(set(prompts)), sorted(set(batches))
    if (
        prompts[0] < 1
        or batches[0] < 1
        or args.new_tokens < 1
        or args.rounds < 1
        or args.prefill_chunk < 0
    ):
        p.error(
            "need prompts >= 1, batches >= 1, --new-tokens >= 1, --rounds >= 1, "
            "--prefill-chunk >= 0"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk = args.prefill_chunk or None
    log = (lambda _: None) if args.json_only else (lambda s: print(s, flush=True))

    t_start = time.perf_counter()
    fix_mmap_threshold()  # before the models exist, so their tensors never sit in the heap
    models = build_models(max(prompts) + args.new_tokens + 1)
    params = {r["model"]: r for r in parameter_report(models)}
    log(
        "params: "
        + ", ".join(
            f"{n} {r['params']:,} ({r['non_embedding']:,} non-emb, {r['layers']} layers)"
            for n, r in params.items()
        )
    )
    log("warm-up: one short generation per model and batch size")
    for batch in batches:
        bench(models, min(prompts), batch, 4, chunk, 1, lambda _: None)
    cells = [(prompt, batch) for prompt in prompts for batch in batches]
    rows = [
        bench(models, prompt, batch, args.new_tokens, chunk, args.rounds, log)
        for prompt, batch in cells
    ]
    goals = targets(cells, rows)
    wall = time.perf_counter() - t_start

    if not args.json_only:
        print(
            f"\n== generation, CPU, {torch.get_num_threads()} threads, fp32, d_model {D_MODEL}, "
            f"vocab {VOCAB}, {args.new_tokens} new tokens, "
            f"prefill chunk {chunk or 'whole prompt'}; "
            f"median of {args.rounds} round-robin rounds =="
        )
        for n, r in params.items():
            print(
                f"  {n:<7} {r['params']:>10,} params, {r['non_embedding']:>10,} non-embedding, "
                f"{r['layers']} layers"
            )
        print_table("decode tokens/s", cells, rows, "decode_tokens_per_s")
        print_table("prefill seconds", cells, rows, "prefill_s", ".2f")
        print_table(
            "decode: extra peak MB (cache + one step)", cells, rows, "decode_peak_mb", ".1f"
        )
        print_table("whole call: extra peak MB", cells, rows, "peak_mb", ".1f")
        print_table("cache MB", cells, rows, "cache_mb", ".2f", ratios=False)
        verdict = lambda ok: "n/a " if ok is None else "PASS" if ok else "FAIL"  # noqa: E731
        print()
        for name, g in goals["decode_speed"].items():
            shown = ", ".join(
                f"{n} {'n/a' if v is None else f'{v:.2f}x'}" for n, v in g["ratios"].items()
            )
            print(
                f"{verdict(g['pass'])} decode tokens/s at prompt {g['prompt']}, "
                f"batch {g['batch']} >= "
                f"{g['target']:g}x Llama's: {shown}"
            )
        for name, g in goals["decode_memory_flat"].items():
            shown = ", ".join(
                f"{n} {v['decode_peak_mb_shortest']:.1f} -> {v['decode_peak_mb_longest']:.1f} MB"
                if v["change_mb"] is not None
                else f"{n} n/a"
                for n, v in g["models"].items()
            )
            print(
                f"{verdict(g['pass'])} decode memory flat from prompt {g['from']} "
                f"to {g['to']} ({name}; "
                f"{100 * FLAT_TOLERANCE:.0f}% or {FLAT_RESOLUTION_MB:g} MB): {shown}"
            )
        print(f"wall time {wall:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "generate",
                "device": "cpu",
                "threads": torch.get_num_threads(),
                "dtype": "float32",
                "prompts": prompts,
                "batches": batches,
                "new_tokens": args.new_tokens,
                "prefill_chunk": chunk,
                "rounds": args.rounds,
                "models": {
                    n: {
                        **{k: v for k, v in r.items() if k != "model"},
                        "config": CONFIGS.get(n, "matched_transformer(mamba1)"),
                    }
                    for n, r in params.items()
                },
                "results": [
                    {"prompt": p_, "batch": b, **{n: row[n] for n in MODELS}}
                    for (p_, b), row in zip(cells, rows)
                ],
                "targets": goals,
                "wall_s": round(wall, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
