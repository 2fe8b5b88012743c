"""CPU training-step benchmark: ssmkit Mamba vs. transformers Mamba / Mamba2 / Llama.

What it measures, per config (fp32, CPU, vocab 1000, AdamW lr 1e-3, torch.manual_seed(0)):

* train tokens/s: one full step = forward with labels -> loss, backward, AdamW step,
  zero_grad. tokens/s = batch * seqlen / median(step time) over the timed steps.
* fwd@2048 tokens/s: batch 1 x 2048 tokens, eval mode, torch.no_grad, median over steps.
  The transformers Mamba default path (a per-token Python loop) is left out here.
* allocator: steps are timed under the Trainer's CPU allocator setting
  (ssmkit.env.reuse_freed_memory: glibc reuses freed blocks instead of unmapping them and
  page-faulting them in again), process-wide, so for every model alike; SSMKIT_REUSE_MEMORY=0 times
  glibc's default. Peak memory is measured without it.
* peak MB: extra peak RSS of a fresh child process that builds only that model and runs
  two train steps (see `child_peak_mb`).

Models: ssmkit Mamba-1, Mamba-2 and Mamba-3 (SISO, and MIMO of rank 4; Mamba-2's sizes: d_state
64, headdim 32, chunk 64), transformers MambaForCausalLM (default CPU path and, if the `mambapy`
package imports, use_mambapy=True), Mamba2ForCausalLM (torch chunked path, same sizes as ssmkit
Mamba-2) and a LlamaForCausalLM sized to about the parameter count of ssmkit Mamba-1.

Why ratios: this runs on shared machines whose speed drifts by tens of percent. All
models are timed in the same process, round-robin (one step of each model per round),
so drift hits all of them alike and the ratios stay meaningful when absolute numbers don't.

Optional groups of rows, timed in the same rounds (train step only: no fwd@2048, no peak memory):

* ``--compile-scan``: ssmkit Mamba-1 / Mamba-2 with ``ssmkit.ops.compile_scan(True)`` (the S6 chunks
  and the SSD through torch.compile; the first step per shape compiles, which the warmup absorbs);
* ``--floor``: the same models with the scan replaced by an O(batch x seqlen x channels) stand-in
  (y = u silu(z), plus zero-weighted terms so every input still gets a gradient). Its ratio to Llama
  is an upper bound for any scan implementation at this config: what the rest of the model costs.
  Mamba-1's default (the fused CPU scan, ``ssmkit.ops.s6_cpu``) is judged against it: >= 0.8x
  (issue 28), PASS / FAIL;
* ``--torch-scan``: ssmkit Mamba-1 with the pure-PyTorch scan (``SSMKIT_BACKEND=torch``), the path
  the fused kernel replaces on CPU (and the fallback where it cannot be built).

Run:  .venv/bin/python benchmarks/train_step_cpu.py [--config base|large|both] [--seq-len 256,2048]
      [--compile-scan] [--floor] [--torch-scan] [--steps 7] [--warmup 3] [--threads N] [--json-only]
The last stdout line is one JSON object (keyed by config name for --config both, by "config@L" with
--seq-len). --seq-len L1,L2 runs the config at each length with the same tokens per step (batch =
config batch x config seqlen / L, at least 1); transformers' per-token default path is timed only up
to 512 tokens (its ratio is null beyond). Issue 17's targets against the matched Llama: Mamba-1 and
Mamba-2 >= 1x at L=256 and >= 3x at L=2048 (LLAMA_TARGETS).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # no hub kernels / downloads; must precede the import
import torch
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
)

import ssmkit  # installed editable by `make bench` / `make test`
from ssmkit.eval import peak_memory_mb, time_round_robin

CONFIGS = {
    "base": dict(d_model=128, n_layer=4, vocab=1000, batch=8, seqlen=256),
    "large": dict(d_model=256, n_layer=4, vocab=1000, batch=4, seqlen=512),
}
# each mixer's ModelConfig group (mamba1 / mamba2 / mamba3), also written into transformers' configs
MAMBA1 = dict(d_state=16, expand=2, d_conv=4)
MAMBA2 = dict(d_state=64, headdim=32, chunk_size=64, ngroups=1, expand=2, d_conv=4)
MAMBA3 = dict(d_state=64, headdim=32, chunk_size=64, ngroups=1, expand=2)  # Mamba-2's, no conv
FWD_SEQLEN = 2048
SLOW = "hf_mamba_default"  # the slowest peer by far: timed with 1 warmup + 1 timed step only
MODELS = [
    "ssmkit_mamba1",
    "ssmkit_mamba2",
    "ssmkit_mamba3",
    "ssmkit_mamba3_mimo",
    SLOW,
    "hf_mambapy",
    "hf_mamba2",
    "llama",
]
COMPILED = {"ssmkit_mamba1_compiled": "ssmkit_mamba1", "ssmkit_mamba2_compiled": "ssmkit_mamba2"}
FLOOR = {"ssmkit_mamba1_noscan": "ssmkit_mamba1", "ssmkit_mamba2_noscan": "ssmkit_mamba2"}
TORCH_SCAN = {"ssmkit_mamba1_torchscan": "ssmkit_mamba1"}
VARIANTS = {**COMPILED, **FLOOR, **TORCH_SCAN}  # row name -> the model it times in another mode
RATIOS = {  # name: (numerator, denominator, target); a target of None: reported, not judged
    "ssmkit_mamba1_vs_hf_mamba_default": ("ssmkit_mamba1", SLOW, 50.0),
    "ssmkit_mamba1_vs_hf_mambapy": ("ssmkit_mamba1", "hf_mambapy", 2.0),
    "ssmkit_mamba1_vs_llama": ("ssmkit_mamba1", "llama", 1.0),
    "ssmkit_mamba2_vs_llama": ("ssmkit_mamba2", "llama", 1.0),
    "ssmkit_mamba2_vs_hf_mamba2": ("ssmkit_mamba2", "hf_mamba2", 1.0),
    "ssmkit_mamba3_vs_ssmkit_mamba2": ("ssmkit_mamba3", "ssmkit_mamba2", 0.5),
    "ssmkit_mamba3_vs_ssmkit_mamba1": ("ssmkit_mamba3", "ssmkit_mamba1", None),
    "ssmkit_mamba3_mimo_vs_ssmkit_mamba3": ("ssmkit_mamba3_mimo", "ssmkit_mamba3", None),
    # with --compile-scan (judged by the same targets) and --floor (the bound: reported, not judged)
    "ssmkit_mamba1_compiled_vs_llama": ("ssmkit_mamba1_compiled", "llama", 1.0),
    "ssmkit_mamba2_compiled_vs_llama": ("ssmkit_mamba2_compiled", "llama", 1.0),
    "ssmkit_mamba1_noscan_vs_llama": ("ssmkit_mamba1_noscan", "llama", None),
    "ssmkit_mamba2_noscan_vs_llama": ("ssmkit_mamba2_noscan", "llama", None),
    # issue 28: the default path near its bound (--floor), and the torch path it replaces
    "ssmkit_mamba1_vs_floor": ("ssmkit_mamba1", "ssmkit_mamba1_noscan", 0.8),
    "ssmkit_mamba1_torchscan_vs_llama": ("ssmkit_mamba1_torchscan", "llama", None),
    "ssmkit_mamba1_vs_torchscan": ("ssmkit_mamba1", "ssmkit_mamba1_torchscan", None),
}


# the targets against Llama by sequence length (issue 17); lengths between take the shorter one's
LLAMA_TARGETS = {256: 1.0, 2048: 3.0}
SLOW_MAX_LEN = 512  # transformers' per-token loop (SLOW) is not timed beyond this


def llama_target(seqlen: int) -> float | None:
    """The target of Mamba-1 / Mamba-2 against Llama at ``seqlen``: the longest listed length's <=
    it."""
    known = [n for n in LLAMA_TARGETS if n <= seqlen]
    return LLAMA_TARGETS[max(known)] if known else None


def allocator_setting() -> str:
    """The Trainer's CPU allocator setting (``ssmkit.env.reuse_freed_memory``: freed blocks are
    reused, not unmapped and page-faulted in again), process-wide, so every model here is timed
    under it; SSMKIT_REUSE_MEMORY=0 keeps glibc's default. Returns which one is in effect."""
    return (
        "reuse freed memory (the Trainer's)" if ssmkit.env.reuse_freed_memory() else "glibc default"
    )


def mambapy_available():
    # Without mambapy, transformers silently falls back to the slow loop for use_mambapy=True.
    try:
        import mambapy.pscan  # noqa: F401

        return True
    except ImportError:
        return False


def llama_ffn_size(c, target_params):
    """intermediate_size (multiple of 16) that brings a tied-embedding Llama near target_params."""
    d, L = c["d_model"], c["n_layer"]
    fixed = c["vocab"] * d + d + L * (4 * d * d + 2 * d)  # embeddings, norms, q/k/v/o
    return max(16, round((target_params - fixed) / (3 * d * L) / 16) * 16)


def _no_s6(u, delta, A, B, C, D=None, z=None, **_):
    """--floor's stand-in for ops.selective_scan: O(b L d), every input in the graph."""
    return (
        u * F.silu(z)
        + delta * 0
        + (B.sum(-2) + C.sum(-2))[:, None] * 0
        + A.sum() * 0
        + D[:, None] * 0
    )


def _no_ssd(x, dt, A, B, C, chunk_size, D=None, z=None, **_):
    """--floor's stand-in for ops.ssd_scan (Mamba-2's mixer gates after its norm: z is None
    here)."""
    y = (
        x
        + dt[..., None] * 0
        + (B.sum((-2, -1)) + C.sum((-2, -1)))[..., None, None] * 0
        + A.sum() * 0
    )
    return y if D is None else y + D.sum() * 0


@contextlib.contextmanager
def scan_mode(name):
    """Run model row ``name`` in its mode: compiled scans for COMPILED rows, the stand-ins for
    FLOOR, the pure-PyTorch ops (SSMKIT_BACKEND=torch) for TORCH_SCAN."""
    saved = ssmkit.ops.selective_scan, ssmkit.ops.ssd_scan
    saved_backend = os.environ.get("SSMKIT_BACKEND")
    ssmkit.ops.compile_scan(name in COMPILED)
    if name in FLOOR:
        ssmkit.ops.selective_scan, ssmkit.ops.ssd_scan = _no_s6, _no_ssd
    if name in TORCH_SCAN:
        os.environ["SSMKIT_BACKEND"] = "torch"
    try:
        yield
    finally:
        ssmkit.ops.selective_scan, ssmkit.ops.ssd_scan = saved
        ssmkit.ops.compile_scan(False)
        if saved_backend is None:
            os.environ.pop("SSMKIT_BACKEND", None)
        else:
            os.environ["SSMKIT_BACKEND"] = saved_backend


def build(name, c, llama_ffn=None):
    if name in VARIANTS:
        return build(VARIANTS[name], c)
    torch.manual_seed(0)
    d, L, V = c["d_model"], c["n_layer"], c["vocab"]
    if name == "ssmkit_mamba1":
        return ssmkit.build_model(
            ssmkit.ModelConfig(d_model=d, n_layer=L, vocab_size=V, mixer="mamba1", mamba1=MAMBA1)
        )
    if name == "ssmkit_mamba2":
        return ssmkit.build_model(
            ssmkit.ModelConfig(d_model=d, n_layer=L, vocab_size=V, mixer="mamba2", mamba2=MAMBA2)
        )
    if name in ("ssmkit_mamba3", "ssmkit_mamba3_mimo"):
        mimo = dict(is_mimo=True, mimo_rank=4) if name.endswith("mimo") else {}
        return ssmkit.build_model(
            ssmkit.ModelConfig(
                d_model=d, n_layer=L, vocab_size=V, mixer="mamba3", mamba3={**MAMBA3, **mimo}
            )
        )
    common = dict(
        vocab_size=V, hidden_size=d, num_hidden_layers=L, use_cache=False, tie_word_embeddings=True
    )
    if name in (SLOW, "hf_mambapy"):
        return MambaForCausalLM(
            MambaConfig(
                state_size=MAMBA1["d_state"],
                expand=MAMBA1["expand"],
                conv_kernel=MAMBA1["d_conv"],
                use_mambapy=(name == "hf_mambapy"),
                **common,
            )
        )
    if name == "hf_mamba2":
        return Mamba2ForCausalLM(
            Mamba2Config(
                state_size=MAMBA2["d_state"],
                head_dim=MAMBA2["headdim"],
                num_heads=MAMBA2["expand"] * d // MAMBA2["headdim"],
                n_groups=MAMBA2["ngroups"],
                chunk_size=MAMBA2["chunk_size"],
                expand=MAMBA2["expand"],
                conv_kernel=MAMBA2["d_conv"],
                **common,
            )
        )
    if name == "llama":
        return LlamaForCausalLM(
            LlamaConfig(
                intermediate_size=llama_ffn,
                num_attention_heads=d // 32,
                num_key_value_heads=d // 32,
                max_position_embeddings=FWD_SEQLEN,
                **common,
            )
        )
    raise ValueError(name)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def train_step(model, opt, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def child_peak_mb(job):
    """Runs in a fresh process: builds one model and runs two train steps (the second one
    holds activations, grads and AdamW state at once). Reports the peak RSS minus the RSS
    after the imports, i.e. the extra peak memory of model + optimizer + activations.
    In-process deltas would be dishonest (a high-water mark never goes down), and ru_maxrss is
    inherited from the forking parent across exec, so VmHWM is used (peak_memory_mb)."""
    c = {**CONFIGS[job["config"]], "batch": job["batch"], "seqlen": job["seqlen"]}
    before = peak_memory_mb()
    model = build(job["model"], c, job["llama_ffn"]).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(
        0, c["vocab"], (c["batch"], c["seqlen"]), generator=torch.Generator().manual_seed(0)
    )
    for _ in range(2):
        train_step(model, opt, ids)
    return peak_memory_mb() - before


def bench_config(cfg_name, args, log, seqlen=None):
    c = dict(CONFIGS[cfg_name])
    if seqlen is not None:  # same tokens per step at another length
        c["batch"], c["seqlen"] = max(1, c["batch"] * c["seqlen"] // seqlen), seqlen
    names = [n for n in MODELS if n != "hf_mambapy" or mambapy_available()]
    names += [
        *(COMPILED if args.compile_scan else ()),
        *(FLOOR if args.floor else ()),
        *(TORCH_SCAN if args.torch_scan else ()),
    ]
    if c["seqlen"] > SLOW_MAX_LEN:
        names.remove(SLOW)
        log(
            f"[{cfg_name}] L={c['seqlen']}: transformers' per-token path not timed "
            f"(> {SLOW_MAX_LEN})"
        )
    if "hf_mambapy" not in names:
        log("mambapy does not import: skipping transformers use_mambapy=True (reported as null)")
    models = {n: build(n, c) for n in names if n != "llama"}
    llama_ffn = llama_ffn_size(c, n_params(models["ssmkit_mamba1"]))
    models["llama"] = build("llama", c, llama_ffn)
    params = {n: n_params(m) for n, m in models.items()}
    log(
        f"[{cfg_name}] params: ssmkit_mamba1 {params['ssmkit_mamba1']:,}, "
        f"llama {params['llama']:,} "
        f"(intermediate_size {llama_ffn}, {params['llama'] / params['ssmkit_mamba1']:.2f}x)"
    )

    # Training: round-robin, one step per model per round.
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-3) for n, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seqlen"]), generator=gen)
    losses = {}

    def train_call(n, model, opt):  # one train step of model n; its loss is kept for the table
        def call():
            with scan_mode(n):
                losses[n] = train_step(model, opt, ids)

        return call

    for m in models.values():
        m.train()
    times = time_round_robin(
        {n: train_call(n, models[n], opts[n]) for n in names},
        args.steps,
        args.warmup,
        skip=lambda n, r: n == SLOW and r not in (0, args.warmup),  # its 1 warmup + 1 timed step
        on_round=lambda r: log(f"[{cfg_name}] train round {r + 1}/{args.warmup + args.steps} done"),
    )
    tokens = c["batch"] * c["seqlen"]
    train_tps = {n: tokens / statistics.median(times[n]) for n in names}

    # Forward only at 2048 tokens, same round-robin scheme.
    fwd_names = [n for n in names if n != SLOW and n not in VARIANTS]
    fwd_ids = torch.randint(0, c["vocab"], (1, FWD_SEQLEN), generator=gen)
    for n in fwd_names:
        models[n].eval()
    with torch.no_grad():
        fwd_times = time_round_robin(
            {n: lambda m=models[n]: m(fwd_ids) for n in fwd_names}, args.steps, args.warmup
        )
    fwd_tps = {n: FWD_SEQLEN / statistics.median(fwd_times[n]) for n in fwd_names}
    del models, opts

    # Peak memory: one fresh child process per model, run sequentially after the timing.
    peak_mb = {}
    for n in [n for n in names if n not in VARIANTS]:
        job = dict(
            model=n, config=cfg_name, llama_ffn=llama_ffn, batch=c["batch"], seqlen=c["seqlen"]
        )
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", json.dumps(job)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        peak_mb[n] = json.loads(out.strip().splitlines()[-1])["peak_mb"]
        log(f"[{cfg_name}] peak memory of {n}: {peak_mb[n]:.0f} MB")

    result = {
        "config": cfg_name,
        **c,
        "threads": torch.get_num_threads(),
        "allocator": args.allocator,
        "timing": f"median over {args.steps} timed steps after {args.warmup} warmup "
        f"({SLOW}: 1 timed after 1 warmup)",
    }
    for key, (num, den, _) in RATIOS.items():
        result[key] = (
            train_tps[num] / train_tps[den] if num in train_tps and den in train_tps else None
        )
    targets = targets_at(c["seqlen"])
    result.update(
        load_average=args.load_average,
        scan_backend=ssmkit.ops.backend.describe("cpu")["selective_scan"],
        tokens_per_s=train_tps,
        fwd2048_tokens_per_s=fwd_tps,
        peak_mb=peak_mb,
        params=params,
        final_loss=losses,
        targets=targets,
        targets_met={
            k: None if result[k] is None or t is None else result[k] >= t
            for k, t in targets.items()
        },
    )
    result["verdicts"] = {
        k: "PASS" if met else "FAIL" for k, met in result["targets_met"].items() if met is not None
    }
    return result


def targets_at(seqlen: int) -> dict:
    """RATIOS' targets, those against Llama taken from LLAMA_TARGETS at ``seqlen``."""
    return {
        k: (llama_target(seqlen) if den == "llama" and t is not None else t)
        for k, (_, den, t) in RATIOS.items()
    }


def print_table(res):
    print(
        f"\n== config {res['config']}: d_model {res['d_model']}, {res['n_layer']} layers, "
        f"batch {res['batch']} x {res['seqlen']}, {res['threads']} threads, "
        f"allocator: {res['allocator']}; "
        f"{res['timing']}; load average {res['load_average']}; "
        f"selective_scan: {res['scan_backend']} =="
    )
    print(
        f"{'model':<24}{'params':>10}{'loss':>8}{'train tok/s':>13}{'vs HF Mamba':>13}"
        f"{'fwd@2048 tok/s':>16}{'peak MB':>9}"
    )
    base = res["tokens_per_s"].get(SLOW)
    for n in MODELS + [v for v in VARIANTS if v in res["tokens_per_s"]]:
        if n not in res["tokens_per_s"]:
            why = "not timed at this length" if n == SLOW else "skipped (mambapy not installed)"
            print(f"{n:<24}{why:>60}")
            continue
        tps, fwd = res["tokens_per_s"][n], res["fwd2048_tokens_per_s"].get(n)
        fwd_s = f"{fwd:,.0f}" if fwd is not None else "-"
        peak = res["peak_mb"].get(n)  # the --compile-scan / --floor rows: not measured
        peak_s = f"{peak:>9.0f}" if peak is not None else f"{'-':>9}"
        vs = f"{tps / base:>12.1f}x" if base else f"{'-':>13}"
        print(
            f"{n:<24}{res['params'][n]:>10,}{res['final_loss'][n]:>8.3f}{tps:>13,.0f}"
            f"{vs}{fwd_s:>16}{peak_s}"
        )
    for key, target in res["targets"].items():
        val = res[key]
        if val is None and RATIOS[key][0] in VARIANTS:  # a row group that was not asked for
            continue
        if target is None:
            print(f"  {key}: {'n/a' if val is None else f'{val:.2f}x'}")
            continue
        shown = "n/a" if val is None else f"{val:.2f}x {'PASS' if val >= target else 'FAIL'}"
        print(f"  {key}: {shown}, target >= {target}x")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=["base", "large", "both"], default="base")
    p.add_argument(
        "--seq-len",
        default=None,
        metavar="L1,L2",
        help="sequence lengths to run the config at, same tokens per step (default: the config's)",
    )
    p.add_argument("--steps", type=int, default=7, help="timed steps (fast models)")
    p.add_argument("--warmup", type=int, default=3, help="warmup steps (fast models)")
    p.add_argument(
        "--compile-scan",
        action="store_true",
        help="also time ssmkit Mamba-1/-2 with ssmkit.ops.compile_scan(True)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time ssmkit Mamba-1/-2 with the scan replaced by an O(L d) stand-in (a bound)",
    )
    p.add_argument(
        "--torch-scan",
        action="store_true",
        help="also time ssmkit Mamba-1 with the pure-PyTorch scan (SSMKIT_BACKEND=torch)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json-only", action="store_true", help="print only the JSON line")
    p.add_argument("--_child", help=argparse.SUPPRESS)  # internal: peak-memory child process
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args._child:
        print(json.dumps({"peak_mb": child_peak_mb(json.loads(args._child))}))
        return
    if args.steps < 1:
        p.error("--steps must be >= 1")
    args.allocator = allocator_setting()
    # how busy the machine was (1, 5, 15 min) when the run started: ratios in one run still hold
    args.load_average = [round(x, 2) for x in os.getloadavg()]

    def log(msg):
        if not args.json_only:
            print(msg, file=sys.stderr, flush=True)

    try:
        lengths = [int(v) for v in args.seq_len.split(",")] if args.seq_len else [None]
    except ValueError:
        p.error(f"--seq-len takes comma-separated integers, e.g. 256,2048; got {args.seq_len!r}")
    if any(n is not None and n < 8 for n in lengths):
        p.error("--seq-len: each length must be >= 8")
    cfg_names = ["base", "large"] if args.config == "both" else [args.config]
    results = {
        (name if n is None else f"{name}@{n}"): bench_config(name, args, log, n)
        for name in cfg_names
        for n in lengths
    }
    if not args.json_only:
        for res in results.values():
            print_table(res)
    print(json.dumps(results if len(results) > 1 else next(iter(results.values()))))


if __name__ == "__main__":
    main()
