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

Mixed-length batches (``--mixed``, instead of the table above; issue "Peer parity II"): 16 and 32
concurrent prompts of 64 to 4K tokens (a fixed seeded mix, log-uniform, the shortest and the longest
always in), each continued by --new-tokens greedy tokens, three ways:

* packed   ssmkit.generate(model, [prompts]): the prompts packed into one row without padding
           (seq_idx), one prefill whose per-sample states fill one cache row per prompt, then one
           batched decode;
* padded   ssmkit.generate(model, ids, attention_mask=mask): the same prompts LEFT padded to the
           longest (today's path for a batch of different lengths);
* llama    the matched Llama (ssmkit.models.matched_transformer, to the Mamba-2 model), the same
           left-padded batch, its KV cache (DynamicCache), the prefill in --prefill-chunk chunks.

tokens/s = (prompt tokens + generated tokens) / seconds of the whole call, median of --rounds
round-robin rounds; peak MB = extra peak memory of the call (ssmkit.eval.long_context.measure_call).
The packed and padded outputs are checked equal, token for token. A second mix with the same number
of prompts and the same total tokens but all of one length ("even": the longest prompt ~4x shorter)
tests memory: packed's peak should not depend on the longest prompt, padded's does. Targets, PASS /
FAIL: packed tokens/s >= 1.5x padded at 32 mixed prompts (with --quick: at its largest batch);
packed peak memory flat from the even mix to the mixed one (within 10% or 2 MB).

    .venv/bin/python benchmarks/generate.py --mixed [--mixed-batches 16,32] \
        [--mixed-lengths 64,4096] [--new-tokens 32] [--rounds 2] [--threads N] [--quick]

On a busy machine use --threads 1. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import time

os.environ["HF_HUB_OFFLINE"] = "1"  # no hub downloads; must precede the transformers import
import torch
from long_context import (
    fmt,
    ratio,
)  # the sibling benchmark's table helpers (benchmarks/ is on sys.path)

import ssmkit
from ssmkit.eval.long_context import fix_mmap_threshold, generation_cost, measure_call
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


# --- mixed-length batches: packed prefill vs left padding vs Llama -------------------------------

MIXED_BATCHES, MIXED_LENGTHS = [16, 32], (64, 4096)
QUICK_MIXED_BATCHES, QUICK_MIXED_LENGTHS = [4, 8], (16, 256)
MIXED_SSM = "mamba2"
PACKED_TARGET, PACKED_TARGET_BATCH = 1.5, 32  # packed tokens/s >= 1.5x padded at 32 prompts
MIXED_FLAT_TOLERANCE, MIXED_FLAT_RESOLUTION_MB = 0.10, 2.0
RUNNERS = ["packed", "padded", "llama"]


def mixed_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """n prompt lengths, log-uniform in [lo, hi] (seeded); the first is hi and the second lo, so
    every mix spans the whole range."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    lengths = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))).round().long().tolist()
    lengths[0] = hi
    if n > 1:
        lengths[1] = lo
    return lengths


def even_lengths(lengths: list[int]) -> list[int]:
    """As many prompts, the same total tokens, all of one length (to within one token)."""
    n, total = len(lengths), sum(lengths)
    return [total // n + (i < total % n) for i in range(n)]


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


def llama_generate(model, prompts, new_tokens: int, chunk: int | None) -> torch.Tensor:
    """Greedy continuation of the left-padded prompts with transformers' KV cache: the prefill in
    chunks (attention's mask and activations O(batch x chunk x width)), then one-token steps;
    position ids count real tokens, as transformers' generate sets them. Returns (batch, new)."""
    from transformers import DynamicCache

    ids, mask = left_padded(prompts)
    width, vocab = ids.shape[1], model.config.vocab_size
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    step = chunk or width
    for lo in range(0, width, step):
        out = model(
            input_ids=ids[:, lo : lo + step],
            attention_mask=mask[:, : lo + step],
            position_ids=pos[:, lo : lo + step],
            use_cache=True,
            logits_to_keep=1,
            **{name: cache},
        )
    tokens, nxt = [], pos[:, -1:] + 1
    for i in range(new_tokens):
        token = out.logits[:, -1, :vocab].argmax(-1, keepdim=True)
        tokens.append(token)
        if i == new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(
            input_ids=token,
            attention_mask=mask,
            position_ids=nxt + i,
            use_cache=True,
            logits_to_keep=1,
            **{name: cache},
        )
    return torch.cat(tokens, dim=1)


def mixed_cell(models, lengths, new_tokens, chunk, rounds, runners, log, label) -> dict:
    """Each runner on the prompts of ``lengths``, round-robin: median seconds, tokens/s (prompt +
    generated tokens per second) and peak MB; whether packed and padded gave the same tokens."""
    g = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    ssm, llama = models[MIXED_SSM], models["llama"]
    ids, mask = left_padded(prompts)
    calls = {
        "packed": lambda: ssmkit.generate(ssm, prompts, new_tokens, temperature=0),
        "padded": lambda: ssmkit.generate(ssm, ids, new_tokens, temperature=0, attention_mask=mask),
        "llama": lambda: llama_generate(llama, prompts, new_tokens, chunk),
    }
    runs = {n: [] for n in runners}
    outs = {}
    with torch.inference_mode():
        for r in range(rounds):
            for n in runners:
                outs[n], seconds, peak = measure_call(calls[n])
                runs[n].append((seconds, peak))
            log(
                f"  {label}: {len(lengths)} prompts, {sum(lengths):,} tokens, round {r + 1}/"
                f"{rounds}: " + ", ".join(f"{n} {runs[n][-1][0]:.2f} s" for n in runners)
            )
    tokens = sum(lengths) + len(lengths) * new_tokens
    row = {}
    for n, rs in runs.items():
        seconds = statistics.median(x[0] for x in rs)
        peaks = [x[1] for x in rs]
        row[n] = {
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "peak_mb": None if None in peaks else statistics.median(peaks),
        }
    width = ids.shape[1]
    same = all(
        torch.equal(p, outs["padded"][i, width - len(prompts[i]) :])
        for i, p in enumerate(outs["packed"])
    )
    return {
        "prompts": len(lengths),
        "longest": max(lengths),
        "prompt_tokens": sum(lengths),
        "padded_tokens": len(lengths) * max(lengths),
        "packed_equals_padded": same,
        **row,
    }


def mixed_targets(cells: dict, batches: list[int]) -> dict:
    at = PACKED_TARGET_BATCH if PACKED_TARGET_BATCH in batches else max(batches)
    mixed = cells[at]["mixed"]
    got = ratio(mixed["packed"]["tokens_per_s"], mixed["padded"]["tokens_per_s"])
    flat = {}
    for b in batches:
        a, m = cells[b]["even"]["packed"]["peak_mb"], cells[b]["mixed"]["packed"]["peak_mb"]
        change = None if a is None or m is None else m - a
        flat[f"batch_{b}"] = {
            "pass": None
            if change is None
            else abs(change) <= max(MIXED_FLAT_TOLERANCE * max(a, m), MIXED_FLAT_RESOLUTION_MB),
            "longest_even": cells[b]["even"]["longest"],
            "longest_mixed": cells[b]["mixed"]["longest"],
            "packed_peak_mb_even": a,
            "packed_peak_mb_mixed": m,
            "padded_peak_mb_even": cells[b]["even"]["padded"]["peak_mb"],
            "padded_peak_mb_mixed": cells[b]["mixed"]["padded"]["peak_mb"],
        }
    return {
        "packed_vs_padded": {
            "pass": None if got is None else got >= PACKED_TARGET,
            "batch": at,
            "target": PACKED_TARGET,
            "ratio": got,
        },
        "packed_memory_flat": flat,
    }


def mixed_main(args, log):
    """``--mixed``: the mixed-length section alone; prints its tables, targets and JSON line."""
    try:
        batches = (
            [int(x) for x in args.mixed_batches.split(",")]
            if args.mixed_batches
            else QUICK_MIXED_BATCHES
            if args.quick
            else MIXED_BATCHES
        )
        lo, hi = (
            [int(x) for x in args.mixed_lengths.split(",")]
            if args.mixed_lengths
            else QUICK_MIXED_LENGTHS
            if args.quick
            else MIXED_LENGTHS
        )
    except ValueError:
        raise SystemExit(
            "--mixed-batches and --mixed-lengths take comma-separated integers"
        ) from None
    if min(batches) < 1 or not 1 <= lo <= hi:
        raise SystemExit("need --mixed-batches >= 1 and --mixed-lengths LO,HI with 1 <= LO <= HI")
    batches = sorted(set(batches))
    chunk = args.prefill_chunk or None
    t_start = time.perf_counter()
    fix_mmap_threshold()
    torch.manual_seed(0)
    ssm = build_model(
        ModelConfig(d_model=D_MODEL, n_layer=N_LAYER, vocab_size=VOCAB, **CONFIGS[MIXED_SSM])
    ).eval()
    torch.manual_seed(0)
    llama = matched_transformer(ssm, max_len=hi + args.new_tokens + 1).eval()
    models = {MIXED_SSM: ssm, "llama": llama}
    params = {r["model"]: r for r in parameter_report(models)}
    log("warm-up: one small batch per runner")
    mixed_cell(models, [lo, 2 * lo], 2, chunk, 1, RUNNERS, lambda _: None, "warm-up")
    cells = {}
    for b in batches:
        lengths = mixed_lengths(b, lo, hi)
        cells[b] = {
            "mixed": mixed_cell(models, lengths, args.new_tokens, chunk, args.rounds, RUNNERS, log,
                                "mixed"),
            # the memory control: no Llama (its padded cost is the padded SSM's story again)
            "even": mixed_cell(models, even_lengths(lengths), args.new_tokens, chunk, args.rounds,
                               ["packed", "padded"], log, "even"),
        }  # fmt: skip
        cells[b]["mixed"]["lengths"] = lengths
    goals = mixed_targets(cells, batches)
    wall = time.perf_counter() - t_start
    if not args.json_only:
        print(
            f"\n== mixed-length generation, CPU, {torch.get_num_threads()} threads, fp32, "
            f"{MIXED_SSM} d_model {D_MODEL} x {N_LAYER} layers vs llama "
            f"({params['llama']['layers']} layers), prompts {lo}-{hi} tokens, "
            f"{args.new_tokens} new tokens each, median of {args.rounds} rounds =="
        )
        print(
            f"{'prompts':>8}{'mix':>6}{'tokens':>9}{'padded':>9}"
            + "".join(f"{n + ' tok/s':>14}" for n in RUNNERS)
            + f"{'packed/padded':>15}{'packed/llama':>14}"
            + "".join(f"{n + ' MB':>11}" for n in RUNNERS)
        )
        for b in batches:
            for mix in ("mixed", "even"):
                c = cells[b][mix]
                get = lambda n, key: c[n][key] if n in c else None  # noqa: E731
                print(
                    f"{b:>8}{mix:>6}{c['prompt_tokens']:>9,}{c['padded_tokens']:>9,}"
                    + "".join(fmt(get(n, "tokens_per_s"), ",.0f", 14) for n in RUNNERS)
                    + fmt(ratio(get("packed", "tokens_per_s"), get("padded", "tokens_per_s")),
                          ".2f", 14) + "x"
                    + fmt(ratio(get("packed", "tokens_per_s"), get("llama", "tokens_per_s")),
                          ".2f", 13) + "x"
                    + "".join(fmt(get(n, "peak_mb"), ".0f", 11) for n in RUNNERS)
                )  # fmt: skip
        same = all(cells[b][m]["packed_equals_padded"] for b in batches for m in cells[b])
        print(f"\npacked and padded outputs equal, token for token: {same}")
        verdict = lambda ok: "n/a " if ok is None else "PASS" if ok else "FAIL"  # noqa: E731
        g = goals["packed_vs_padded"]
        shown = "n/a" if g["ratio"] is None else f"{g['ratio']:.2f}x"
        print(
            f"{verdict(g['pass'])} packed tokens/s >= {g['target']:g}x padded at "
            f"{g['batch']} mixed prompts: {shown}"
        )
        for name, f in goals["packed_memory_flat"].items():
            print(
                f"{verdict(f['pass'])} packed peak memory flat in the longest prompt ({name}: "
                f"longest {f['longest_even']} -> {f['longest_mixed']}, same total tokens; "
                f"{100 * MIXED_FLAT_TOLERANCE:.0f}% or {MIXED_FLAT_RESOLUTION_MB:g} MB): packed "
                f"{fmt(f['packed_peak_mb_even'], '.0f', 0)} -> "
                f"{fmt(f['packed_peak_mb_mixed'], '.0f', 0)} MB, padded "
                f"{fmt(f['padded_peak_mb_even'], '.0f', 0)} -> "
                f"{fmt(f['padded_peak_mb_mixed'], '.0f', 0)} MB"
            )
        print(f"wall time {wall:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "generate-mixed",
                "device": "cpu",
                "threads": torch.get_num_threads(),
                "dtype": "float32",
                "batches": batches,
                "lengths": [lo, hi],
                "new_tokens": args.new_tokens,
                "prefill_chunk_llama": chunk,
                "rounds": args.rounds,
                "models": {
                    n: {
                        **{k: v for k, v in r.items() if k != "model"},
                        "config": CONFIGS.get(n, f"matched_transformer({MIXED_SSM})"),
                    }
                    for n, r in params.items()
                },
                "results": [{"batch": b, **cells[b]} for b in batches],
                "targets": goals,
                "wall_s": round(wall, 1),
            }
        )
    )


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
    p.add_argument(
        "--mixed",
        action="store_true",
        help="the mixed-length batches instead: packed vs padded vs Llama (see above)",
    )
    p.add_argument(
        "--mixed-batches",
        help=f"with --mixed: comma-separated prompt counts (default "
        f"{','.join(map(str, MIXED_BATCHES))}; --quick {','.join(map(str, QUICK_MIXED_BATCHES))})",
    )
    p.add_argument(
        "--mixed-lengths",
        help=f"with --mixed: LO,HI prompt lengths (default {MIXED_LENGTHS[0]},{MIXED_LENGTHS[1]}; "
        f"--quick {QUICK_MIXED_LENGTHS[0]},{QUICK_MIXED_LENGTHS[1]})",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda _: None) if args.json_only else (lambda s: print(s, flush=True))
    if args.mixed:
        if args.prompts or args.batches:
            p.error("--mixed takes --mixed-batches / --mixed-lengths, not --prompts / --batches")
        if args.new_tokens < 1 or args.rounds < 1 or args.prefill_chunk < 0:
            p.error("need --new-tokens >= 1, --rounds >= 1, --prefill-chunk >= 0")
        return mixed_main(args, log)
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
    chunk = args.prefill_chunk or None

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
