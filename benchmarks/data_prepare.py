"""Tokenization throughput: ``ssmkit data prepare`` against ``datasets.Dataset.map``.

Both tokenize the same documents (the embedded stdlib-docs corpus, train split, read once up
front) with the same GPT-2 tokenizer. ssmkit also appends EOS, packs and writes uint16 shards with
their sha256; datasets.map only tokenizes into an in-memory Arrow table (batched, the fast path).
Each measurement runs in a fresh process (so peak memory is that process's own), in alternating
order, twice; the table shows the medians and the last line is JSON with the ratio.

Run: .venv/bin/python benchmarks/data_prepare.py [--workers N] [--repeat K]   (needs `datasets`)
"""

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, tempfile, time
os.environ["HF_HUB_OFFLINE"] = "1"
import ssmkit.data as D
from ssmkit.eval import peak_memory_mb   # this process's peak RSS (VmHWM)
which, workers = sys.argv[1], int(sys.argv[2])
docs = list(D.stdlib_docs("train"))
tok = D.get_tokenizer("gpt2")
t0 = time.perf_counter()
if which == "ssmkit":
    with tempfile.TemporaryDirectory() as out:
        tokens = D.prepare(docs, "gpt2", out, workers=workers, progress=False)["total_tokens"]
else:
    import datasets
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"text": [d.text for d in docs]})
    mapped = ds.map(lambda b: tok(b["text"], verbose=False), batched=True, remove_columns=["text"],
                    num_proc=workers if workers > 1 else None)
    tokens = sum(len(ids) for ids in mapped["input_ids"]) + len(docs)   # + the EOS ssmkit adds
seconds = time.perf_counter() - t0
print(json.dumps({"tokens": tokens, "seconds": seconds, "peak_mb": peak_memory_mb()}))
"""


def run(which, workers):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, which, str(workers)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    results = {"ssmkit": [], "datasets": []}
    for r in range(args.repeat):
        for which in ("ssmkit", "datasets") if r % 2 == 0 else ("datasets", "ssmkit"):
            results[which].append(run(which, args.workers))
    summary = {}
    for which, runs in results.items():
        tps = statistics.median(x["tokens"] / x["seconds"] for x in runs)
        summary[which] = {
            "tokens": runs[0]["tokens"],
            "tokens_per_s": tps,
            "peak_mb": statistics.median(x["peak_mb"] for x in runs),
        }
        print(
            f"{which:<10} {runs[0]['tokens']:>10,} tokens  {tps:>12,.0f} tokens/s  "
            f"peak {summary[which]['peak_mb']:.0f} MB"
        )
    ratio = summary["ssmkit"]["tokens_per_s"] / summary["datasets"]["tokens_per_s"]
    print(
        json.dumps(
            {
                "workers": args.workers,
                "ssmkit_vs_datasets_map": ratio,
                "target": 1.0,
                "target_met": ratio >= 1.0,
                **{k: v for k, v in summary.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
