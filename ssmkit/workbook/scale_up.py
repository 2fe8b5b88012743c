"""Stage 2 of the plan, scaling up: what notebooks/02_scale_up.ipynb calls.

    runs = compare_strategies(cfg, nproc=2, out_dir=d)          # one process, DDP, FSDP: launch_train each
    loss_table(runs), max_loss_difference(runs)                  # the same losses, to fp32 rounding
    memory_rows(runs)                                            # per rank: peak memory, state held, planned
    plans = scale_up_plans(["mamba-370m", "mamba-1.4b"])         # the planner on 8 x A100-80GB
    print(slurm_command("mamba-1.4b", nodes=2))                   # the real run: sbatch / torchrun
    prepare_at_scale("stdlib-docs", "byte", d, max_tokens=2**18, seq_len=256)   # shards + MDS, tokens/s
    stream_remote("slimpajama")                                  # HF streaming, or why it cannot here
    runs = precision_runs(cfg, train_dir, val_dir, out_dir=d)   # fp32, bf16 autocast, fp16 + grad scaler

2.4 (Mamba-2 against Mamba-1), 2.5 (evaluation) and the scaling sweep are in :mod:`.scaling`.

Glossary: C = training compute in FLOPs (:func:`ssmkit.eval.flops_per_token` x tokens: 6 per weight per
token plus the scans), L = validation loss in nats/token, N = d_state (the SSM state size), Q = chunk_size
(Mamba-2's SSD chunk), DDP = every rank holds the whole model and all-reduces gradients, FSDP = each rank
holds 1/n of parameters, gradients and optimizer state and gathers a block's parameters when it runs.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path

from .. import checks
from .launch import launch_train
from .notebooks import PROJECT_ROOT, WorkbookError

__all__ = ["PAPER_SSD_CLAIM", "PARAMETER_CHECKS", "autocast_support", "compare_strategies", "loss_table",
           "max_loss_difference", "memory_rows", "precision_metrics", "precision_rows", "precision_runs",
           "prepare_at_scale", "scale_up_plans", "slurm_command", "strategy_metrics", "stream_remote"]

ONE = "one process"
# Dao & Gu 2024 (Mamba-2, "Transformers are SSMs"), abstract and section 9.1 (figure 10): the SSD layer
# trains 2-8x faster than Mamba-1's fused selective scan on an A100, and larger state sizes cost it little.
PAPER_SSD_CLAIM = ("Mamba-2 paper (Dao & Gu 2024): the SSD layer is 2-8x faster than Mamba-1's optimized "
                   "selective scan (A100, fused CUDA kernels); its time grows little with the state size N")


# --- 2.1 DDP and FSDP -----------------------------------------------------------------------------

def compare_strategies(cfg, *, nproc: int = 2, strategies=("ddp", "fsdp"), out_dir, show: bool = True,
                       **overrides) -> dict[str, dict]:
    """Train ``cfg`` (a TrainConfig) in one process, then with each strategy on ``nproc`` processes (gloo on
    CPU, nccl on GPUs), each a :func:`~ssmkit.workbook.launch_train` run in ``out_dir/<name>``, logging
    every step and evaluating once, at the end. The global batch (``batch_tokens``) is the same in all:
    fewer accumulated micro-batches per rank make up for the extra ranks. ``overrides``: more TrainConfig
    keys for every run. Every process runs one thread (``OMP_NUM_THREADS=1``, torchrun's default for its
    ranks, unless set), the one-process run too: their tokens/s compare 1 core with ``nproc`` cores.
    Returns {"one process": run, "ddp": run, "fsdp": run} (launch_train's dicts)."""
    nproc = checks.integer(nproc, "nproc", minimum=2)
    _check_gpus(cfg.device, nproc)
    base = {"log_every": 1, "eval_every": 0, "overwrite": True, **overrides}
    runs = {}
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}   # what torchrun gives each rank
    for name, n, strategy in [(ONE, 1, "single")] + [(s, nproc, s) for s in strategies]:
        runs[name] = launch_train(cfg, nproc=n, overrides={**base, "strategy": strategy}, env=threads,
                                  out_dir=Path(out_dir) / name.replace(" ", "_"), show=show)
    return runs


def _check_gpus(device: str, nproc: int) -> None:
    """On GPUs every rank needs its own: refuse ``nproc`` above the number visible (before launching)."""
    import torch

    from ..env import pick_device

    if pick_device(device) == "cuda" and torch.cuda.device_count() < nproc:
        raise WorkbookError(f"nproc={nproc} needs {nproc} GPUs (one per rank); {torch.cuda.device_count()} "
                            f"visible: set nproc to at most that (2.1 needs 2), or device='cpu' (gloo)")


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run["history"] if r.get("kind") == "train"}


def loss_table(runs: dict[str, dict], reference: str = ONE) -> list[dict]:
    """One row per logged step: each run's training loss and the largest ``|loss - reference's|`` of the
    others (``max_abs_diff``)."""
    ref = _losses(runs[reference])
    per_run = {name: _losses(run) for name, run in runs.items()}
    rows = []
    for step in sorted(ref):
        row = {"step": step, **{name: losses.get(step) for name, losses in per_run.items()}}
        diffs = [abs(v - ref[step]) for n, v in row.items() if n not in ("step", reference) and v is not None]
        rows.append({**row, "max_abs_diff": max(diffs, default=0.0)})
    return rows


def max_loss_difference(runs: dict[str, dict], reference: str = ONE) -> dict[str, float]:
    """For each run but ``reference``: the largest ``|training loss - reference's|`` over the steps both
    logged, and the same for the final validation loss (key ``"<name> val"``)."""
    ref = _losses(runs[reference])
    out = {}
    for name, run in runs.items():
        if name == reference:
            continue
        losses = _losses(run)
        out[name] = max(abs(losses[s] - ref[s]) for s in ref if s in losses)
        if run.get("val_loss") is not None and runs[reference].get("val_loss") is not None:
            out[f"{name} val"] = abs(run["val_loss"] - runs[reference]["val_loss"])
    return out


def memory_rows(runs: dict[str, dict], cfg=None, backend: str | None = None) -> list[dict]:
    """Per run and rank: ``peak_mb`` (measured: the CUDA allocator's peak, or on CPU the process's peak
    resident memory, which includes Python, torch and the data loader, a few hundred MiB) and ``state_mb``
    (counted: the parameters and AdamW moments the rank holds between steps). With ``cfg`` (the runs'
    TrainConfig) also the memory planner's figures for that rank (:func:`ssmkit.train.plan_memory` with
    the run's strategy and process count, the ``backend``'s formulas; default :func:`_kernel_backend`):
    ``planned_state_mb`` (its weights + optimizer rows) and ``planned_step_mb`` (its total for a step:
    + gradients, activations, workspace)."""
    if cfg is not None and backend is None:
        backend = _kernel_backend(cfg)
    rows = []
    for name, run in runs.items():
        peaks = run.get("rank_peak_mem_mb") or [run.get("peak_mem_mb")]
        states = run.get("rank_state_mb") or [None] * len(peaks)
        plan = None
        if cfg is not None:
            from ..train import plan_memory

            strategy = "single" if run["nproc"] == 1 else name
            plan = plan_memory(cfg, strategy=strategy, n_gpus=run["nproc"], backend=backend)
        for rank, (peak, state) in enumerate(zip(peaks, states)):
            row = {"run": name, "rank": rank, "peak_mb": _round(peak), "state_mb": _round(state, 2)}
            if plan is not None:
                row.update(planned_state_mb=round((plan.weights + plan.optimizer) / 2**20, 2),
                           planned_step_mb=round(plan.total / 2**20, 1))
            rows.append(row)
    return rows


_SCAN_OPS = {"mamba1": "selective_scan", "mamba2": "ssd_scan", "mamba3": "mamba3_siso"}   # ops.backend's


def _kernel_backend(cfg) -> str:
    """The planner's backend for a run of ``cfg`` (a TrainConfig): "cuda" where it runs on GPUs and the
    kernels of every SSM mixer of its model import (mamba_ssm; Mamba-3's only exist in mamba_ssm's source
    tree, the MIMO one in TileLang), else "torch" (ssmkit's PyTorch path, which those layers then take)."""
    from ..env import pick_device
    from ..ops.backend import KERNEL_MODULES, kernel_import_error

    if pick_device(cfg.device) != "cuda":
        return "torch"
    model = cfg.model_config()
    ops = {"mamba3_mimo" if m == "mamba3" and model.mamba3.is_mimo else _SCAN_OPS[m]
           for m in model.mixers if m in _SCAN_OPS}
    modules = {KERNEL_MODULES[op] for op in ops} or {"mamba_ssm"}
    return "cuda" if all(kernel_import_error(m) is None for m in modules) else "torch"


def strategy_metrics(runs: dict[str, dict], mem: list[dict], reference: str = ONE) -> dict:
    """metrics.json's numbers of 2.1: per run the median tokens/s (``<name>_tok_s``; "one process" as
    ``one_process_tok_s``), and for the runs of several processes the largest loss difference from one
    process, rank 0's peak memory and state (``<name>_max_loss_diff``, ``<name>_rank0_peak_mb``,
    ``<name>_state_mb``)."""
    diff = max_loss_difference(runs, reference)
    rank0 = {r["run"]: r for r in mem if r["rank"] == 0}
    out = {}
    for name, run in runs.items():
        key = name.replace(" ", "_")
        if name in diff:
            out[f"{key}_max_loss_diff"] = diff[name]
        out[f"{key}_tok_s"] = round(run["tokens_per_s"])
        if rank0[name]["state_mb"] is not None:                 # the runs of several processes
            out[f"{key}_rank0_peak_mb"] = rank0[name]["peak_mb"]
            out[f"{key}_state_mb"] = rank0[name]["state_mb"]
    return out


PLAN_PRESETS = ("mamba-130m", "mamba-370m", "mamba-1.4b", "mamba2-1.3b")   # stage 2's sizes (and stage 1's)


def scale_up_plans(presets=PLAN_PRESETS, *, seq_len: int = 2048, micro_batch: int = 8, n_gpus: int = 8,
                   gpu_memory_gb: float = 80.0, precision: str = "bf16") -> dict:
    """The memory planner (:func:`ssmkit.train.plan_memory`, CUDA kernels) for each preset on ``n_gpus``
    GPUs of ``gpu_memory_gb``: DDP, FSDP and FSDP with activation checkpointing. Keys "<preset> <how>";
    show them with :func:`ssmkit.train.memory_table`."""
    from ..train import plan_memory

    plans = {}
    for preset in presets:
        for label, strategy, ckpt in (("ddp", "ddp", False), ("fsdp", "fsdp", False),
                                      ("fsdp+ckpt", "fsdp", True)):
            plans[f"{preset} {label}"] = plan_memory(
                preset, seq_len=seq_len, micro_batch=micro_batch, precision=precision, strategy=strategy,
                activation_checkpointing=ckpt, n_gpus=n_gpus, gpu_memory_gb=gpu_memory_gb)
    return plans


def slurm_command(preset: str, *, nodes: int = 1, gpus_per_node: int = 8, sets=()) -> str:
    """The commands that run ``configs/<preset>.yaml`` for real: on one node with ``ssmkit train --nproc``
    (torchrun's standalone launcher), and on ``nodes`` nodes through Slurm (scripts/slurm/train.sbatch: one
    torchrun per node, joined by torchrun's c10d rendezvous on the first node; requeue-safe with
    ``--resume``). ``sets``: ``key=value`` overrides (``--set``)."""
    nodes = checks.integer(nodes, "nodes", minimum=1)
    gpus_per_node = checks.integer(gpus_per_node, "gpus_per_node", minimum=1)
    config = f"configs/{preset}.yaml"
    if not (PROJECT_ROOT / config).exists():
        raise WorkbookError(f"{config} does not exist; run configs: "
                            + ", ".join(sorted(p.stem for p in (PROJECT_ROOT / "configs").glob("*.yaml"))))
    extra = "".join(f" --set {item}" for item in sets)
    return "\n".join([
        f"# one node, {gpus_per_node} GPUs:",
        f"ssmkit train --config {config} --nproc {gpus_per_node}{extra}",
        f"# {nodes} node(s) x {gpus_per_node} GPUs with Slurm (adapt the #SBATCH lines to the cluster):",
        f"sbatch --nodes={nodes} --gres=gpu:{gpus_per_node} scripts/slurm/train.sbatch {config}{extra}",
        "# ... which runs on every node (the rendezvous on the first node assigns the ranks):",
        f"srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node={gpus_per_node} --rdzv-id=$SLURM_JOB_ID "
        f"--rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 -m ssmkit.train --config {config} --resume{extra}",
    ])


# --- 2.2 data at scale ----------------------------------------------------------------------------

PREPARED_MARK = ".ssmkit-prepare-at-scale"       # a directory prepare_at_scale wrote (and may replace)


def prepare_at_scale(source: str, tokenizer: str, out_dir, *, max_tokens: int | None, seq_len: int,
                     workers: int = 1) -> dict:
    """Tokenize ``source`` into ``out_dir`` (token shards, then their MosaicML-streaming copy of
    ``seq_len + 1``-token samples in ``out_dir/mds``: :func:`ssmkit.data.prepare` with ``mds_seq_len``),
    from scratch, timed. Returns ``tokens``, ``documents``, ``seconds``, ``tokens_per_s`` (shards and MDS
    together), ``mds_samples``, ``mds_files`` (names and sizes) and ``first_sample`` (the first MDS sample,
    which :class:`~ssmkit.data.TokenLoader` reads as its first window: ``input_ids = s[:-1]``)."""
    import shutil

    from ..data import prepare, read_mds
    from ..io import read_json

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):                     # timed from scratch: replace only our own
        if not (out / PREPARED_MARK).is_file():
            raise WorkbookError(f"{out} holds files prepare_at_scale did not write; "
                                "give an empty or new directory")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / PREPARED_MARK).write_text("written by ssmkit.workbook.prepare_at_scale\n")
    start = time.perf_counter()
    index = prepare(source, tokenizer, out, max_tokens=max_tokens, workers=workers, progress=False,
                    mds_seq_len=seq_len)
    seconds = time.perf_counter() - start
    mds = read_json(out / "mds" / "index.json", "MDS index")
    files = {s["raw_data"]["basename"]: s["raw_data"]["bytes"] for s in mds["shards"]}
    first = next(read_mds(out / "mds"))["tokens"]
    return {"source": source, "tokenizer": tokenizer, "tokens": index["total_tokens"],
            "documents": index["documents"], "seconds": round(seconds, 2),
            "tokens_per_s": round(index["total_tokens"] / seconds), "mds_samples": sum(s["samples"] for s in
                                                                                      mds["shards"]),
            "mds_files": files, "first_sample": first.tolist()}


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def stream_remote(name: str, *, docs: int = 3, tokenizer: str = "gpt2", timeout: float = 5.0) -> dict:
    """Stream the first ``docs`` documents of a remote corpus of the plan (``ssmkit.data.REMOTE``: HF
    ``datasets`` with ``streaming=True``, nothing downloaded in full) and tokenize them, timed. Returns
    ``ok``, and either ``documents``, ``tokens``, ``seconds``, ``tokens_per_s`` (network included) or
    ``error``: ssmkit's message when the hub cannot be reached (offline), after at most ``timeout``
    seconds of trying to connect to huggingface.co when no offline variable is set."""
    from ..data import REMOTE, get_tokenizer, load_source

    if name not in REMOTE:
        raise WorkbookError(f"{name!r} is not a remote corpus; valid: {', '.join(REMOTE)}")
    if not _offline():
        try:
            socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        except OSError as exc:
            return {"source": name, "ok": False,
                    "error": f"the hub (huggingface.co:443) cannot be reached ({type(exc).__name__}: "
                             f"{exc}); 'ssmkit data prepare --source {name}' fails the same way. Offline, "
                             "use 'stdlib-docs' or local files (.txt, .jsonl, .parquet, .arrow)."}
    start = time.perf_counter()
    try:
        texts = []
        for doc in load_source(name):
            texts.append(doc.text)
            if len(texts) >= docs:
                break
    except ValueError as exc:
        return {"source": name, "ok": False, "error": str(exc)}
    tok = get_tokenizer(tokenizer)
    tokens = sum(len(tok.encode(t)) for t in texts)
    seconds = time.perf_counter() - start
    return {"source": name, "ok": True, "documents": len(texts), "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds)}


# --- 2.3 mixed precision --------------------------------------------------------------------------

def autocast_support(device: str = "cpu") -> dict:
    """Whether ``torch.autocast`` on ``device`` runs a linear layer in bf16 and in fp16 (and the dtype it
    computes in): {"bf16": "bfloat16" or the error, "fp16": ...}."""
    import torch

    layer = torch.nn.Linear(8, 8).to(device)
    x = torch.randn(2, 8, device=device)
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            with torch.autocast(torch.device(device).type, dtype=dtype):
                out[name] = str(layer(x).dtype).removeprefix("torch.")
        except Exception as exc:                              # an unsupported dtype for this device
            out[name] = f"not supported ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    return out


def precision_runs(cfg, data, val_data, *, out_dir, precisions=("fp32", "bf16", "fp16"),
                   fp16_init_scale: float = 2.0**20, fp16_growth_interval: int = 4, callbacks=(),
                   **model_overrides) -> dict:
    """The same run (``cfg``: model, data order, seed) in each precision, with the Trainer in this process,
    logging every step, into ``out_dir/<precision>``. bf16 and fp16 are autocast (matmuls in half precision,
    fp32 master weights and optimizer); fp16 adds the gradient scaler: the loss is multiplied by the scale
    S before the backward, gradients divided by S before the step; a step whose gradients overflow (inf or
    NaN) is skipped and S halved; after ``fp16_growth_interval`` good steps S doubles. It starts at
    ``fp16_init_scale`` (2^20, higher than torch's 2^16, so that a short run shows the back-off).
    ``model_overrides``: ModelConfig fields replacing ``cfg``'s (e.g. a smaller model on a CPU).

    Returns {precision: {"history", "model", "seconds"}}; :func:`precision_rows` tabulates them."""
    import torch

    from ..data import TokenLoader
    from ..train import Trainer
    from .hybrid import build_lm

    vocab = TokenLoader(data, cfg.seq_len, 1).index["vocab_size"]
    runs = {}
    for precision in precisions:
        run_cfg = dataclasses.replace(cfg, precision=precision, log_every=1, overwrite=True,
                                      model_overrides={**cfg.model_overrides, **model_overrides},
                                      out_dir=str(Path(out_dir) / precision))
        model = build_lm(run_cfg, vocab)                        # the same initial weights for each
        trainer = Trainer(model, run_cfg, data=data, val_data=val_data, callbacks=list(callbacks),
                          name=f"Mamba {precision}")
        if precision == "fp16":
            trainer.scaler = torch.amp.GradScaler(trainer.dist.device.type, init_scale=fp16_init_scale,
                                                  growth_interval=fp16_growth_interval)
        start = time.perf_counter()
        history = trainer.fit()
        runs[precision] = {"history": history, "model": model, "seconds": time.perf_counter() - start}
    return runs


def precision_rows(runs: dict, reference: str = "fp32") -> list[dict]:
    """One row per precision: final training and validation loss, the largest |training loss - the
    reference's| over the steps, median tokens/s, and for fp16 the scaler's final scale and skipped steps."""
    from .launch import run_metrics

    ref = {r["step"]: r["loss"] for r in runs[reference]["history"] if r["kind"] == "train"}
    rows = []
    for name, run in runs.items():
        m = run_metrics(run["history"])
        losses = {r["step"]: r["loss"] for r in run["history"] if r["kind"] == "train"}
        rows.append({"precision": name, "final_loss": round(m["final_loss"], 4),
                     "val_loss": _round(m["val_loss"], 4),
                     "max_abs_diff": round(max(abs(v - ref[s]) for s, v in losses.items() if s in ref), 5),
                     "tok_s": round(m["tokens_per_s"]), "seconds": round(run["seconds"], 1),
                     "grad_scale": m.get("grad_scale"), "scaler_skipped": m.get("scaler_skipped")})
    return rows


def precision_metrics(rows: list[dict]) -> dict:
    """metrics.json's numbers of 2.3: ``<precision>_final_loss`` each, and fp16's ``fp16_scaler_skipped`` and
    ``fp16_final_grad_scale`` (:func:`precision_rows`' rows)."""
    out = {f"{r['precision']}_final_loss": r["final_loss"] for r in rows}
    for r in rows:
        if r.get("grad_scale") is not None:
            out.update({f"{r['precision']}_scaler_skipped": r["scaler_skipped"],
                        f"{r['precision']}_final_grad_scale": r["grad_scale"]})
    return out


def _round(value, digits: int = 1):
    return None if value is None else round(value, digits)


# --- the notebook's parameters --------------------------------------------------------------------

def _int_list(name: str, minimum: int, ascending: bool = True):
    def check(value):
        parsed = checks.parse_value(value) if isinstance(value, str) else value
        try:
            if not isinstance(parsed, (list, tuple)) or not parsed:
                raise ValueError
            values = [checks.integer(v, name, minimum=minimum, whole_floats=True) for v in parsed]
        except ValueError:
            raise WorkbookError(f"{name} must be a non-empty list of integers >= {minimum}, e.g. [16, 64]; "
                                f"got {value!r}") from None
        if ascending and values != sorted(set(values)):
            raise WorkbookError(f"{name} must be ascending and distinct; got {values}")
        return values
    return check


def _eval_tasks(value):
    """"offline", "plan", a comma-separated string of lm-eval task names, or a list of them."""
    if isinstance(value, str) and value.strip().startswith("["):
        value = checks.parse_value(value)
    if isinstance(value, str):
        names = [t.strip() for t in value.split(",") if t.strip()]
        if names in (["offline"], ["plan"]):
            return names[0]
    elif isinstance(value, (list, tuple)) and all(isinstance(t, str) and t.strip() for t in value):
        names = [t.strip() for t in value]
    else:
        names = []
    if not names:
        raise WorkbookError(f"eval_tasks must be 'offline', 'plan', or lm-eval task names (a list or 'a,b'); "
                            f"got {value!r}")
    return names


def _eval_limit(value):
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    try:
        return checks.integer(checks.parse_value(value) if isinstance(value, str) else value, "eval_limit",
                              minimum=1, whole_floats=True)
    except ValueError:
        raise WorkbookError(f"eval_limit must be an integer >= 1 (items per task) or None (all); "
                            f"got {value!r}") from None


def _at_least(name: str, minimum: int = 1):
    def check(value):
        try:
            return checks.integer(checks.parse_value(value) if isinstance(value, str) else value, name,
                                  minimum=minimum, whole_floats=True)
        except ValueError:
            raise WorkbookError(f"{name} must be an integer >= {minimum}; got {value!r}") from None
    return check


# name -> check, joined to :data:`ssmkit.workbook.params.CHECKS` (notebook 02's parameters)
PARAMETER_CHECKS = {
    "nproc": _at_least("nproc", 2),                         # 02: processes of the DDP / FSDP runs
    "ssd_lengths": _int_list("ssd_lengths", 2),             # 02: sequence lengths of Mamba-2 vs Mamba-1
    "ssd_states": _int_list("ssd_states", 1),               # 02: state sizes N of Mamba-2 vs Mamba-1
    "eval_tasks": _eval_tasks,                              # 02: "offline", "plan" or lm-eval task names
    "eval_limit": _eval_limit,                              # 02: items per task (None: all)
    "scaling_widths": _int_list("scaling_widths", 8),       # 02: d_model of the scaling sweep's models
    "scaling_tokens": _at_least("scaling_tokens"),          # 02: training tokens of each of them
}
