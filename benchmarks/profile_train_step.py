"""Where one CPU training step of a benchmark model spends its time: torch.profiler's top ops, page
faults.

The models and the step are benchmarks/train_step_cpu.py's (same configs, same names, including the
``*_compiled`` and ``*_noscan`` rows). Prints the step time (median of --steps), minor / major page
faults per step (getrusage), torch's thread count, then the ops sorted by their own CPU time over
--profile-steps steps, and last one JSON line with the step time and the top ops' shares.

Run:  .venv/bin/python benchmarks/profile_train_step.py ssmkit_mamba1 [--seq-len 256] [--rows 20]
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import train_step_cpu as bench  # noqa: E402
from torch.profiler import profile  # noqa: E402


def main():
    names = bench.MODELS + list(bench.VARIANTS)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", choices=names)
    p.add_argument("--config", choices=sorted(bench.CONFIGS), default="base")
    p.add_argument("--seq-len", type=int, default=None, help="same tokens per step as the config's")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warmup)")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bench.allocator_setting()
    c = dict(bench.CONFIGS[args.config])
    if args.seq_len:
        c["batch"], c["seqlen"] = max(1, c["batch"] * c["seqlen"] // args.seq_len), args.seq_len
    llama_ffn = bench.llama_ffn_size(c, bench.n_params(bench.build("ssmkit_mamba1", c)))
    model = bench.build(args.model, c, llama_ffn).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(
        0, c["vocab"], (c["batch"], c["seqlen"]), generator=torch.Generator().manual_seed(0)
    )
    with bench.scan_mode(args.model):
        for _ in range(2):
            bench.train_step(model, opt, ids)
        times, before = [], resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(args.steps):
            t = time.perf_counter()
            bench.train_step(model, opt, ids)
            times.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_SELF)
        with profile() as prof:
            for _ in range(args.profile_steps):
                bench.train_step(model, opt, ids)
    step = statistics.median(times)
    minflt, majflt = (
        (after.ru_minflt - before.ru_minflt) / args.steps,
        (after.ru_majflt - before.ru_majflt) / args.steps,
    )
    print(
        f"{args.model}, {args.config} config, batch {c['batch']} x {c['seqlen']}: "
        f"step {step * 1e3:.1f} ms ({c['batch'] * c['seqlen'] / step:,.0f} tokens/s), "
        f"page faults per step {minflt:,.0f} minor / "
        f"{majflt:,.0f} major, {torch.get_num_threads()} threads"
    )
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.rows]
    print(
        json.dumps(
            {
                "model": args.model,
                "batch": c["batch"],
                "seqlen": c["seqlen"],
                "step_ms": step * 1e3,
                "minor_faults_per_step": minflt,
                "threads": torch.get_num_threads(),
                "top_self_cpu_share": {e.key: round(e.self_cpu_time_total / total, 4) for e in top},
            }
        )
    )


if __name__ == "__main__":
    main()
