"""Mamba-2's recomputing backward on and off (CPU): training-step tokens/s and peak memory of the
long-context benchmark's Mamba-2, one run, as ratios.

Above ssmkit.ops.ssd.RECOMPUTE_FROM tokens a call, Mamba-2 on the torch ops keeps for the backward
only what it needs to recompute the rest: the SSD runs as ssmkit.ops.ssd_chunked_recompute (inputs
and one state per segment kept, one segment recomputed at a time) instead of ssd_chunked under
autograd (every chunk's intermediates kept), and the mixer recomputes its conv + SiLU and its gated
norm with out_proj. Here both ways are forced (ssmkit.ops.ssd_recompute) on the same model and
batches, the steps round-robin so that the machine's drift hits both alike; tokens/s = batch x L /
median step seconds (timed under the Trainer's allocator), peak MB = the extra peak RSS of one step
under the memory-measuring setting (ssmkit.eval.long_context), every shape's measured before any
timing.

    .venv/bin/python benchmarks/ssd_recompute.py [--shapes 8x256,1x2048,1x16384] [--steps 3]
        [--threads 1] [--json-only]

The ratio columns are recompute / autograd; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from long_context import CONFIGS, D_MODEL, N_LAYER, VOCAB

from ssmkit import ops
from ssmkit.eval.long_context import (
    fix_mmap_threshold,
    make_train_step,
    measure_call,
    timed_call,
    timing_allocator,
)
from ssmkit.models import ModelConfig, build_model

SHAPES = "8x256,1x2048,1x16384"
PATHS = {"autograd": False, "recompute": True}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        batch, _, length = item.strip().partition("x")
        if not (batch.isdigit() and length.isdigit()) or int(batch) < 1 or int(length) < 2:
            raise ValueError(f"--shapes takes BATCHxLENGTH items, e.g. 8x256; got {item!r}")
        out.append((int(batch), int(length)))
    return out


def peaks(model, batch, length) -> dict:
    """{path: extra peak MB of one step}, after one untimed step each (first-call caches)."""
    step = make_train_step(model, length, batch=batch)
    out = {}
    for p, on in PATHS.items():
        ops.ssd_recompute(on)
        step()
        model.zero_grad(set_to_none=True)  # the step's gradients count in its peak
        out[p] = measure_call(step)[2]
        model.zero_grad(set_to_none=True)
    ops.ssd_recompute(None)
    return out


def timings(model, batch, length, steps, log) -> dict:
    """{path: (median step seconds, median process CPU seconds)} over ``steps`` round-robin rounds,
    after an untimed step each. With one thread the CPU seconds leave out the time other processes
    held the core: on a shared machine they rank the paths more steadily than the wall time."""
    step = make_train_step(model, length, batch=batch)
    wall, cpu = {p: [] for p in PATHS}, {p: [] for p in PATHS}
    timing_allocator()
    for p, on in PATHS.items():
        ops.ssd_recompute(on)
        step()
    for r in range(steps):
        for p, on in PATHS.items():
            ops.ssd_recompute(on)
            c0 = time.process_time()
            wall[p].append(timed_call(step)[1])
            cpu[p].append(time.process_time() - c0)
        shown = ", ".join(f"{p} {wall[p][-1]:.2f}s" for p in PATHS)
        log(f"  {batch}x{length} round {r + 1}/{steps}: {shown}")
    ops.ssd_recompute(None)
    return {p: (statistics.median(wall[p]), statistics.median(cpu[p])) for p in PATHS}


def row(batch, length, peak: dict, secs: dict) -> dict:
    out = {"batch": batch, "seq_len": length}
    for p in PATHS:
        wall, cpu = secs[p]
        out[p] = {
            "step_s": wall,
            "cpu_s": cpu,
            "tokens_per_s": batch * length / wall,
            "tokens_per_cpu_s": batch * length / cpu,
            "peak_mb": peak[p],
        }
    a, b = out["autograd"], out["recompute"]
    out["ratio"] = {
        "tokens_per_s": b["tokens_per_s"] / a["tokens_per_s"],
        "tokens_per_cpu_s": b["tokens_per_cpu_s"] / a["tokens_per_cpu_s"],
        "peak_mb": None
        if not a["peak_mb"] or b["peak_mb"] is None
        else b["peak_mb"] / a["peak_mb"],
    }
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help=f"BATCHxLENGTH,... (default {SHAPES})")
    p.add_argument("--steps", type=int, default=3, help="timed rounds per shape")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = p.parse_args()
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        p.error(str(e))
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(msg):
        if not args.json_only:
            print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    fix_mmap_threshold()  # before the model exists (benchmarks/long_context.py says why)
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(d_model=D_MODEL, n_layer=N_LAYER, vocab_size=VOCAB, **CONFIGS["mamba2"])
    )
    # every peak first: a timed step's freed memory, kept for reuse under the timing allocator,
    # would hide later allocations from the resident set (benchmarks/long_context.py)
    peak = {s: peaks(model, *s) for s in shapes}
    log("peaks: " + "; ".join(f"{b}x{L} {peak[(b, L)]}" for b, L in shapes))
    results = [row(b, L, peak[(b, L)], timings(model, b, L, args.steps, log)) for b, L in shapes]
    if not args.json_only:
        print(
            f"\n== Mamba-2 training step (fwd + bwd), CPU, {torch.get_num_threads()} threads, "
            f"fp32; SSD under autograd vs recomputed; median of {args.steps} rounds =="
        )
        print(
            f"{'shape':>9}{'tok/s autograd':>16}{'recompute':>11}{'ratio':>7}{'per CPU s':>11}"
            f"{'peak MB autograd':>18}{'recompute':>11}{'ratio':>7}"
        )
        for r in results:
            a, b, q = r["autograd"], r["recompute"], r["ratio"]
            print(
                f"{str(r['batch']) + 'x' + str(r['seq_len']):>9}{a['tokens_per_s']:>16,.0f}"
                f"{b['tokens_per_s']:>11,.0f}{q['tokens_per_s']:>7.2f}"
                f"{q['tokens_per_cpu_s']:>11.2f}"
                f"{a['peak_mb'] or 0:>18,.0f}{b['peak_mb'] or 0:>11,.0f}"
                f"{q['peak_mb'] or 0:>7.2f}"
            )
        print("ratio: recompute / autograd; per CPU s: the same for tokens per process CPU second")
        print(f"wall time {time.perf_counter() - t0:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "ssd_recompute",
                "device": "cpu",
                "threads": torch.get_num_threads(),
                "dtype": "float32",
                "model": {"config": CONFIGS["mamba2"], "d_model": D_MODEL, "n_layer": N_LAYER},
                "recompute_from": ops.ssd.RECOMPUTE_FROM,
                "segment": ops.ssd.RECOMPUTE_SEGMENT,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
