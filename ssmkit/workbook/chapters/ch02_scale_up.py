"""Chapter 02, scaling up: what notebooks/02_scale_up.ipynb calls (stage 2 of the plan).

    p = PARAMETERS.check(globals())
    runs = compare_strategies(cfg, nproc=2, out_dir=d)  # one process, DDP, FSDP: launch_train each
    loss_table(runs), max_loss_difference(runs)         # the same losses, to fp32 rounding
    memory_rows(runs, cfg)                              # per rank: peak memory, state held, planned
    print(slurm_command("mamba-1.4b", nodes=2))         # the real run: sbatch / torchrun
    prepare_at_scale("stdlib-docs", "byte", d, max_tokens=2**18, seq_len=256)  # shards + MDS, tok/s
    stream_remote("slimpajama")                         # HF streaming, or why it cannot here
    runs = precision_runs(cfg, train_dir, val_dir, out_dir=d)  # fp32, bf16 autocast, fp16 + scaler
    rows = mixer_throughput([256, 1024], [16, 64])      # Mamba-2 / Mamba-1 training tokens/s
    evaluate_models({"fp32": model}, "offline", tokenizer="byte")  # lm-eval tasks (ssmkit.eval)
    rows = scaling_sweep(cfg, [32, 64, 128], tokens, train_dir, val_dir, out_dir=d)
    fit = fit_power_law([r["compute"] for r in rows], [r["val_loss"] for r in rows])  # L = a C^-b

The plan's memory table is :func:`ssmkit.train.scale_up_plans`.

Glossary: C = training compute in FLOPs (:func:`ssmkit.eval.flops_per_token` x tokens: 6 per weight
per token plus the scans), L = validation loss in nats/token, N = d_state (the SSM state size), Q =
chunk_size (Mamba-2's SSD chunk), DDP = every rank holds the whole model and all-reduces gradients,
FSDP = each rank holds 1/n of parameters, gradients and optimizer state and gathers a block's
parameters when it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from ... import checks
from ...models import SSM_MIXERS
from ..cells import rounded
from ..launch import launch_train
from ..notebooks import PROJECT_ROOT, WorkbookError
from ..params import (
    ALLOW_CPU,
    DEVICE,
    Param,
    Parameters,
    check_data,
    check_out_dir,
    check_overrides,
    check_run_config,
    check_tokenizer,
)
from ..progress import step_line

__all__ = [
    "PAPER_SSD_CLAIM",
    "PARAMETERS",
    "autocast_support",
    "compare_strategies",
    "evaluate_models",
    "fit_power_law",
    "loss_table",
    "max_loss_difference",
    "memory_rows",
    "mixer_throughput",
    "model_compute",
    "plot_scaling",
    "precision_metrics",
    "precision_rows",
    "precision_runs",
    "predict_loss",
    "prepare_at_scale",
    "scaling_sweep",
    "score_table",
    "slurm_command",
    "strategy_metrics",
    "stream_remote",
]


# --- the notebook's parameters --------------------------------------------------------------------


def eval_tasks(value, name: str = "eval_tasks"):
    """ "offline", "plan", a comma-separated string of lm-eval task names, or a list of them."""
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
        raise WorkbookError(
            f"eval_tasks must be 'offline', 'plan', or lm-eval task names (a list or 'a,b'); "
            f"got {value!r}"
        )
    return names


def eval_limit(value, name: str = "eval_limit"):
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    try:
        return checks.integer(
            checks.parse_value(value) if isinstance(value, str) else value,
            "eval_limit",
            minimum=1,
            whole_floats=True,
        )
    except ValueError:
        raise WorkbookError(
            f"eval_limit must be an integer >= 1 (items per task) or None (all); got {value!r}"
        ) from None


# fmt: off
PARAMETERS = Parameters(
    Param("config",         "cpu-tiny",    check_run_config,
          "the run config every run here starts from (configs/<config>.yaml); GPU node: "
          '"mamba-130m"'),
    Param("data",           "stdlib-docs", check_data,
          'training text: the embedded corpus (offline); GPU node: "slimpajama"'),
    Param("tokenizer",      "byte",        check_tokenizer,
          '"byte" (257 ids: a small LM head, cheap on a CPU); GPU node: "gpt2"'),
    Param("max_tokens",     24_576,        checks.integer,
          "2.1 and 2.3: training tokens of each run (one process, DDP, FSDP; fp32, bf16, fp16); "
          "GPU node: 50_000_000", minimum=1, whole_floats=True),
    Param("nproc",          2,             checks.integer,
          "2.1: processes of the DDP and FSDP runs (on GPUs: one per GPU)",
          minimum=2, whole_floats=True),
    Param("ssd_lengths",    [256, 1024],   checks.integers,
          "2.4: sequence lengths at which Mamba-2 and Mamba-1 are timed ...",
          minimum=2, ascending=True),
    Param("ssd_states",     [16, 128],     checks.integers,
          "... and state sizes N; GPU node: [2048, 8192] and [16, 64, 128]",
          minimum=1, ascending=True),
    Param("eval_tasks",     "offline",     eval_tasks,
          '2.5: "offline" (ssmkit\'s tasks), "plan" (hellaswag, piqa, arc_easy, arc_challenge, '
          "winogrande, lambada_openai: needs the hub), or names"),
    Param("eval_limit",     50,            eval_limit,
          "2.5: items per task (None: all of them)"),
    Param("scaling_widths", [32, 64, 128], checks.integers,
          "beyond: d_model of the scaling sweep's models", minimum=8, ascending=True),
    Param("scaling_tokens", 24_576,        checks.integer,
          "beyond: training tokens of each of them", minimum=1, whole_floats=True),
    DEVICE,
    ALLOW_CPU,
    Param("overrides",      {"eval_batches": 2}, check_overrides,
          "more TrainConfig keys for every run: here 2 micro-batches per evaluation; a recipe's "
          "keys arrive here (-f params/gpu-8xa100.yaml)"),
    Param("out_dir",        "../runs/lab/02_scale_up", check_out_dir,
          "figures, metrics.json, runs (relative: from notebooks/)"),
    Param("seed",           0,             checks.integer,
          "model initialisation and data order", minimum=0, whole_floats=True),
)
# fmt: on


ONE = "one process"
# Dao & Gu 2024 (Mamba-2, "Transformers are SSMs"), abstract and section 9.1 (figure 10): the SSD
# layer trains 2-8x faster than Mamba-1's fused selective scan on an A100, and larger state sizes
# cost it little.
PAPER_SSD_CLAIM = (
    "Mamba-2 paper (Dao & Gu 2024): the SSD layer is 2-8x faster than Mamba-1's optimized "
    "selective scan (A100, fused CUDA kernels); its time grows little with the state size N"
)


# --- 2.1 DDP and FSDP -----------------------------------------------------------------------------


def compare_strategies(
    cfg, *, nproc: int = 2, strategies=("ddp", "fsdp"), out_dir, show: bool = True, **overrides
) -> dict[str, dict]:
    """Train ``cfg`` (a TrainConfig) in one process, then with each strategy on ``nproc`` processes
    (gloo on CPU, nccl on GPUs), each a :func:`~ssmkit.workbook.launch_train` run in
    ``out_dir/<name>``, logging every step and evaluating once, at the end. The global batch
    (``batch_tokens``) is the same in all: fewer accumulated micro-batches per rank make up for the
    extra ranks. ``overrides``: more TrainConfig keys for every run. Every process runs one thread
    (``OMP_NUM_THREADS=1``, torchrun's default for its ranks, unless set), the one-process run too:
    their tokens/s compare 1 core with ``nproc`` cores. Returns {"one process": run, "ddp": run,
    "fsdp": run} (launch_train's dicts)."""
    nproc = checks.integer(nproc, "nproc", minimum=2)
    _check_gpus(cfg.device, nproc)
    base = {"log_every": 1, "eval_every": 0, "overwrite": True, **overrides}
    runs = {}
    threads = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")
    }  # what torchrun gives each rank
    for name, n, strategy in [(ONE, 1, "single")] + [(s, nproc, s) for s in strategies]:
        runs[name] = launch_train(
            cfg,
            nproc=n,
            overrides={**base, "strategy": strategy},
            env=threads,
            out_dir=Path(out_dir) / name.replace(" ", "_"),
            show=show,
        )
    return runs


def _check_gpus(device: str, nproc: int) -> None:
    """On GPUs every rank needs its own: refuse ``nproc`` above the number visible (before
    launching)."""
    import torch

    from ...env import pick_device

    if pick_device(device) == "cuda" and torch.cuda.device_count() < nproc:
        raise WorkbookError(
            f"nproc={nproc} needs {nproc} GPUs (one per rank); {torch.cuda.device_count()} "
            f"visible: set nproc to at most that (2.1 needs 2), or device='cpu' (gloo)"
        )


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run["history"] if r.get("kind") == "train"}


def loss_table(runs: dict[str, dict], reference: str = ONE) -> list[dict]:
    """One row per logged step: each run's training loss and the largest ``|loss - reference's|`` of
    the others (``max_abs_diff``)."""
    ref = _losses(runs[reference])
    per_run = {name: _losses(run) for name, run in runs.items()}
    rows = []
    for step in sorted(ref):
        row = {"step": step, **{name: losses.get(step) for name, losses in per_run.items()}}
        diffs = [
            abs(v - ref[step])
            for n, v in row.items()
            if n not in ("step", reference) and v is not None
        ]
        rows.append({**row, "max_abs_diff": max(diffs, default=0.0)})
    return rows


def max_loss_difference(runs: dict[str, dict], reference: str = ONE) -> dict[str, float]:
    """For each run but ``reference``: the largest ``|training loss - reference's|`` over the steps
    both logged, and the same for the final validation loss (key ``"<name> val"``)."""
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
    """Per run and rank: ``peak_mb`` (measured: the CUDA allocator's peak, or on CPU the process's
    peak resident memory, which includes Python, torch and the data loader, a few hundred MiB) and
    ``state_mb`` (counted: the parameters and AdamW moments the rank holds between steps). With
    ``cfg`` (the runs' TrainConfig) also the memory planner's figures for that rank
    (:func:`ssmkit.train.plan_memory` with the run's strategy and process count, the ``backend``'s
    formulas; default :func:`_kernel_backend`): ``planned_state_mb`` (its weights + optimizer rows)
    and ``planned_step_mb`` (its total for a step:
    + gradients, activations, workspace)."""
    if cfg is not None and backend is None:
        backend = _kernel_backend(cfg)
    rows = []
    for name, run in runs.items():
        peaks = run.get("rank_peak_mem_mb") or [run.get("peak_mem_mb")]
        states = run.get("rank_state_mb") or [None] * len(peaks)
        plan = None
        if cfg is not None:
            from ...train import plan_memory

            strategy = "single" if run["nproc"] == 1 else name
            plan = plan_memory(cfg, strategy=strategy, n_gpus=run["nproc"], backend=backend)
        for rank, (peak, state) in enumerate(zip(peaks, states)):
            row = {
                "run": name,
                "rank": rank,
                "peak_mb": rounded(peak),
                "state_mb": rounded(state, 2),
            }
            if plan is not None:
                row.update(
                    planned_state_mb=round((plan.weights + plan.optimizer) / 2**20, 2),
                    planned_step_mb=round(plan.total / 2**20, 1),
                )
            rows.append(row)
    return rows


_SCAN_OPS = {
    "mamba1": "selective_scan",
    "mamba2": "ssd_scan",
    "mamba3": "mamba3_siso",
}  # ops.backend's


def _kernel_backend(cfg) -> str:
    """The planner's backend for a run of ``cfg`` (a TrainConfig): "cuda" where it runs on GPUs and
    the kernels of every SSM mixer of its model import (mamba_ssm; Mamba-3's only exist in
    mamba_ssm's source tree, the MIMO one in TileLang), else "torch" (ssmkit's PyTorch path, which
    those layers then take); on a CPU "cpu" (the fused Mamba-1 scan) where the selective scan takes
    it, else "torch" (SSMKIT_BACKEND=torch, or no compiler to build it)."""
    from ...env import pick_device
    from ...ops.backend import KERNEL_MODULES, BackendError, kernel_import_error, select

    model = cfg.model_config()
    if pick_device(cfg.device) != "cuda":
        if "mamba1" not in model.mixers:  # the two plan alike: no layer takes the fused scan
            return "cpu"
        try:  # what the run's scan took (the kernel built then: this only loads it)
            return "cpu" if select("selective_scan") == "cpu" else "torch"
        except BackendError:  # SSMKIT_BACKEND=cpu where it does not build: the run failed too
            return "torch"
    ops = {
        "mamba3_mimo" if m == "mamba3" and model.mamba3.is_mimo else _SCAN_OPS[m]
        for m in model.mixers
        if m in _SCAN_OPS
    }
    modules = {KERNEL_MODULES[op] for op in ops} or {"mamba_ssm"}
    return "cuda" if all(kernel_import_error(m) is None for m in modules) else "torch"


def strategy_metrics(runs: dict[str, dict], mem: list[dict], reference: str = ONE) -> dict:
    """metrics.json's numbers of 2.1: per run the median tokens/s (``<name>_tok_s``; "one process"
    as ``one_process_tok_s``), and for the runs of several processes the largest loss difference
    from one process, rank 0's peak memory and state (``<name>_max_loss_diff``,
    ``<name>_rank0_peak_mb``,
    ``<name>_state_mb``)."""
    diff = max_loss_difference(runs, reference)
    rank0 = {r["run"]: r for r in mem if r["rank"] == 0}
    out = {}
    for name, run in runs.items():
        key = name.replace(" ", "_")
        if name in diff:
            out[f"{key}_max_loss_diff"] = diff[name]
        out[f"{key}_tok_s"] = run["train_tok_s"]
        if rank0[name]["state_mb"] is not None:  # the runs of several processes
            out[f"{key}_rank0_peak_mb"] = rank0[name]["peak_mb"]
            out[f"{key}_state_mb"] = rank0[name]["state_mb"]
    return out


def slurm_command(name: str, *, nodes: int = 1, gpus_per_node: int = 8, sets=()) -> str:
    """The commands that run the run config ``configs/<name>.yaml`` for real: on one node with
    ``ssmkit train --nproc`` (torchrun's standalone launcher), and on ``nodes`` nodes through Slurm
    (scripts/slurm/train.sbatch: ``ssmkit train --nnodes`` on every node, which runs torchrun joined
    by its c10d rendezvous on the first node; requeue-safe with ``--resume``). ``sets``:
    ``key=value`` overrides (``--set``)."""
    from ...train.cli import torchrun_args

    nodes = checks.integer(nodes, "nodes", minimum=1)
    gpus_per_node = checks.integer(gpus_per_node, "gpus_per_node", minimum=1)
    config = f"configs/{name}.yaml"
    if not (PROJECT_ROOT / config).exists():
        raise WorkbookError(
            f"{config} does not exist; run configs: "
            + ", ".join(sorted(p.stem for p in (PROJECT_ROOT / "configs").glob("*.yaml")))
        )
    extra = "".join(f" --set {item}" for item in sets)
    endpoint = "$HEAD:29500"  # the script's: the first node of the allocation
    torchrun = " ".join(torchrun_args(gpus_per_node, "$SLURM_NNODES", endpoint, "$SLURM_JOB_ID"))
    return "\n".join(
        [
            f"# one node, {gpus_per_node} GPUs:",
            f"ssmkit train --config {config} --nproc {gpus_per_node}{extra}",
            f"# {nodes} node(s) x {gpus_per_node} GPUs with Slurm "
            "(adapt the #SBATCH lines to the cluster):",
            f"sbatch --nodes={nodes} --gres=gpu:{gpus_per_node} "
            f"scripts/slurm/train.sbatch {config}{extra}",
            "# ... which runs on every node (the rendezvous on the first node assigns the ranks):",
            f"srun ssmkit train --config {config} --resume --nnodes $SLURM_NNODES "
            f"--nproc {gpus_per_node} --rdzv-endpoint {endpoint} --rdzv-id $SLURM_JOB_ID{extra}",
            "# ... that is, torchrun on each node:",
            f"torchrun {torchrun} -m ssmkit.train --config {config}{extra} --resume",
        ]
    )


# --- 2.2 data at scale ----------------------------------------------------------------------------

PREPARED_MARK = ".ssmkit-prepare-at-scale"  # a directory prepare_at_scale wrote (and may replace)


def prepare_at_scale(
    source: str, tokenizer: str, out_dir, *, max_tokens: int | None, seq_len: int, workers: int = 1
) -> dict:
    """Tokenize ``source`` into ``out_dir`` (token shards, then their MosaicML-streaming copy of
    ``seq_len + 1``-token samples in ``out_dir/mds``: :func:`ssmkit.data.prepare` with
    ``mds_seq_len``), from scratch, timed. Returns ``tokens``, ``documents``, ``seconds``,
    ``tokens_per_s`` (shards and MDS together), ``mds_samples``, ``mds_files`` (names and sizes) and
    ``first_sample`` (the first MDS sample, which :class:`~ssmkit.data.TokenLoader` reads as its
    first window: ``input_ids = s[:-1]``)."""
    import shutil

    from ...data import prepare, read_mds
    from ...io import read_json

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):  # timed from scratch: replace only our own
        if not (out / PREPARED_MARK).is_file():
            raise WorkbookError(
                f"{out} holds files prepare_at_scale did not write; give an empty or new directory"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / PREPARED_MARK).write_text("written by ssmkit.workbook.prepare_at_scale\n")
    start = time.perf_counter()
    index = prepare(
        source,
        tokenizer,
        out,
        max_tokens=max_tokens,
        workers=workers,
        progress=False,
        mds_seq_len=seq_len,
    )
    seconds = time.perf_counter() - start
    mds = read_json(out / "mds" / "index.json", "MDS index")
    files = {s["raw_data"]["basename"]: s["raw_data"]["bytes"] for s in mds["shards"]}
    first = next(read_mds(out / "mds"))["tokens"]
    return {
        "source": source,
        "tokenizer": tokenizer,
        "tokens": index["total_tokens"],
        "documents": index["documents"],
        "seconds": round(seconds, 2),
        "tokens_per_s": round(index["total_tokens"] / seconds),
        "mds_samples": sum(s["samples"] for s in mds["shards"]),
        "mds_files": files,
        "first_sample": first.tolist(),
    }


def stream_remote(
    name: str, *, docs: int = 3, tokenizer: str = "gpt2", timeout: float = 5.0
) -> dict:
    """Stream the first ``docs`` documents of a remote corpus of the plan (``ssmkit.data.REMOTE``:
    HF ``datasets`` with ``streaming=True``, nothing downloaded in full) and tokenize them, timed.
    Returns ``ok``, and either ``documents``, ``tokens``, ``seconds``, ``tokens_per_s`` (network
    included) or ``error``: ssmkit's message when the hub cannot be reached (offline), after at most
    ``timeout`` seconds of trying to connect to huggingface.co when no offline variable is set."""
    from ...data import REMOTE, get_tokenizer, load_source
    from ...env import offline

    if name not in REMOTE:
        raise WorkbookError(f"{name!r} is not a remote corpus; valid: {', '.join(REMOTE)}")
    if not offline("datasets"):
        try:
            socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        except OSError as exc:
            return {
                "source": name,
                "ok": False,
                "error": f"the hub (huggingface.co:443) cannot be reached ({type(exc).__name__}: "
                f"{exc}); 'ssmkit data prepare --source {name}' fails the same way. Offline, "
                "use 'stdlib-docs' or local files (.txt, .jsonl, .parquet, .arrow).",
            }
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
    return {
        "source": name,
        "ok": True,
        "documents": len(texts),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds),
    }


# --- 2.3 mixed precision --------------------------------------------------------------------------


def autocast_support(device: str = "cpu") -> dict:
    """Whether ``torch.autocast`` on ``device`` runs a linear layer in bf16 and in fp16 (and the
    dtype it computes in): {"bf16": "bfloat16" or the error, "fp16": ...}."""
    import torch

    layer = torch.nn.Linear(8, 8).to(device)
    x = torch.randn(2, 8, device=device)
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            with torch.autocast(torch.device(device).type, dtype=dtype):
                out[name] = str(layer(x).dtype).removeprefix("torch.")
        except Exception as exc:  # an unsupported dtype for this device
            out[name] = f"not supported ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    return out


def precision_runs(
    cfg,
    data,
    val_data,
    *,
    out_dir,
    precisions=("fp32", "bf16", "fp16"),
    fp16_init_scale: float = 2.0**20,
    fp16_growth_interval: int = 4,
    callbacks=(),
    **model_overrides,
) -> dict:
    """The same run (``cfg``: model, data order, seed) in each precision, with the Trainer in this
    process, logging every step, into ``out_dir/<precision>``. bf16 and fp16 are autocast (matmuls
    in half precision, fp32 master weights and optimizer); fp16 adds the gradient scaler: the loss
    is multiplied by the scale S before the backward, gradients divided by S before the step; a step
    whose gradients overflow (inf or NaN) is skipped and S halved; after ``fp16_growth_interval``
    good steps S doubles. It starts at ``fp16_init_scale`` (2^20, higher than torch's 2^16, so that
    a short run shows the back-off).
    ``model_overrides``: ModelConfig fields replacing ``cfg``'s (e.g. a smaller model on a CPU).

    Returns {precision: {"history", "model", "seconds"}}; :func:`precision_rows` tabulates them."""
    import torch

    from ...data import TokenLoader
    from ...models import build_model
    from ...train import Trainer

    vocab = TokenLoader(data, cfg.seq_len, 1).index["vocab_size"]
    runs = {}
    for precision in precisions:
        run_cfg = dataclasses.replace(
            cfg,
            precision=precision,
            log_every=1,
            overwrite=True,
            model_overrides={**cfg.model_overrides, **model_overrides},
            out_dir=str(Path(out_dir) / precision),
        )
        # the same initial weights for each
        model = build_model(run_cfg.model_config(vocab_size=vocab), seed=run_cfg.seed)
        trainer = Trainer(
            model,
            run_cfg,
            data=data,
            val_data=val_data,
            callbacks=list(callbacks),
            name=f"Mamba {precision}",
        )
        if precision == "fp16":
            trainer.scaler = torch.amp.GradScaler(
                trainer.dist.device.type,
                init_scale=fp16_init_scale,
                growth_interval=fp16_growth_interval,
            )
        start = time.perf_counter()
        history = trainer.fit()
        runs[precision] = {
            "history": history,
            "model": model,
            "seconds": time.perf_counter() - start,
        }
    return runs


def precision_rows(runs: dict, reference: str = "fp32") -> list[dict]:
    """One row per precision: final training and validation loss, the largest |training loss - the
    reference's| over the steps, median tokens/s, and for fp16 the scaler's final scale and skipped
    steps."""
    from ...eval import summarize_run

    ref = {r["step"]: r["loss"] for r in runs[reference]["history"] if r["kind"] == "train"}
    rows = []
    for name, run in runs.items():
        m = summarize_run(run["history"])
        losses = {r["step"]: r["loss"] for r in run["history"] if r["kind"] == "train"}
        rows.append(
            {
                "precision": name,
                "final_loss": round(m["final_loss"], 4),
                "val_loss": rounded(m["val_loss"], 4),
                "max_abs_diff": round(
                    max(abs(v - ref[s]) for s, v in losses.items() if s in ref), 5
                ),
                "tok_s": m["train_tok_s"],
                "seconds": round(run["seconds"], 1),
                "grad_scale": m.get("grad_scale"),
                "scaler_skipped": m.get("scaler_skipped"),
            }
        )
    return rows


def precision_metrics(rows: list[dict]) -> dict:
    """metrics.json's numbers of 2.3: ``<precision>_final_loss`` each, and fp16's
    ``fp16_scaler_skipped`` and ``fp16_final_grad_scale`` (:func:`precision_rows`' rows)."""
    out = {f"{r['precision']}_final_loss": r["final_loss"] for r in rows}
    for r in rows:
        if r.get("grad_scale") is not None:
            out.update(
                {
                    f"{r['precision']}_scaler_skipped": r["scaler_skipped"],
                    f"{r['precision']}_final_grad_scale": r["grad_scale"],
                }
            )
    return out


# --- 2.4 Mamba-2 against Mamba-1 ------------------------------------------------------------------


def mixer_throughput(
    seq_lens,
    d_states,
    *,
    d_model: int = 128,
    n_layer: int = 2,
    vocab_size: int = 257,
    batch: int = 1,
    headdim: int = 32,
    chunk_size: int = 64,
    steps: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    seed: int = 0,
    mixers=("mamba1", "mamba2"),
) -> list[dict]:
    """Training tokens/s (forward + backward, no optimizer:
    :func:`ssmkit.eval.long_context.make_train_step`) of LMs of the same width and depth, one per
    mixer of ``mixers`` (default Mamba-1 and Mamba-2; any of :data:`ssmkit.models.SSM_MIXERS`, e.g.
    with "mamba3": Mamba-3 SISO), for each sequence length and state size N. The models are timed
    round-robin (:func:`ssmkit.eval.time_round_robin`), so a busy machine slows all alike;
    ``warmup`` untimed rounds, then the median of ``steps``. Mamba-2 and Mamba-3: ``headdim`` P,
    chunk ``chunk_size`` Q. Rows: ``seq_len``, ``d_state``, ``<mixer>_tok_s`` and ``<mixer>_params``
    for each mixer, ``ratio`` (Mamba-2 / Mamba-1, when both run) and ``mamba3_ratio`` (Mamba-3 /
    Mamba-2, when both run)."""
    import torch

    from ...eval import time_round_robin
    from ...eval.long_context import make_train_step
    from ...models import ModelConfig, build_model

    mixers = tuple(mixers)
    if not mixers or len(set(mixers)) != len(mixers) or any(m not in SSM_MIXERS for m in mixers):
        raise ValueError(
            f"mixers={list(mixers)!r} is not valid; valid: distinct names of "
            f"{', '.join(SSM_MIXERS)}"
        )
    rows = []
    cases = [(seq_len, d_state) for seq_len in seq_lens for d_state in d_states]
    for i, (seq_len, d_state) in enumerate(cases, 1):
        step_line(i, len(cases), f"timing {', '.join(mixers)} at seq_len {seq_len}, N {d_state}")
        steps_of, params = {}, {}
        for mixer in mixers:
            extra = {"headdim": headdim, "chunk_size": chunk_size} if mixer != "mamba1" else {}
            torch.manual_seed(seed)
            model = build_model(
                ModelConfig(
                    d_model=d_model,
                    n_layer=n_layer,
                    vocab_size=vocab_size,
                    mixer=mixer,
                    d_state=d_state,
                    **extra,
                )
            ).to(device)
            steps_of[mixer] = make_train_step(model, seq_len, batch, seed=seed)
            params[mixer] = model.num_parameters()
        seconds = time_round_robin(steps_of, steps=steps, warmup=warmup, device=device)
        rate = {m: batch * seq_len / statistics.median(s) for m, s in seconds.items()}
        row = {"seq_len": seq_len, "d_state": d_state}
        row.update({f"{m}_tok_s": round(rate[m]) for m in mixers})
        for key, top, bottom in (
            ("ratio", "mamba2", "mamba1"),
            ("mamba3_ratio", "mamba3", "mamba2"),
        ):
            if top in rate and bottom in rate:
                row[key] = round(rate[top] / rate[bottom], 2)
        row.update({f"{m}_params": params[m] for m in mixers})
        rows.append(row)
    return rows


# --- 2.5 evaluation -------------------------------------------------------------------------------


def evaluate_models(
    models: dict,
    tasks,
    *,
    tokenizer=None,
    limit=None,
    batch_size: int = 8,
    out_dir=None,
    device: str = "cpu",
    seed: int = 0,
    quiet: bool = True,
) -> tuple[list[dict], dict]:
    """Each model on lm-eval ``tasks`` (:func:`ssmkit.eval.run_lm_eval`; ``"offline"``: the tasks
    that ship with ssmkit, :data:`ssmkit.eval.OFFLINE_TASKS`; ``"plan"``: the plan's,
    :data:`ssmkit.eval.PLAN_TASKS`, which need the hub or its cache). ``models``: {name: an
    nn.Module or a model directory}. Results of each go to ``out_dir/<name>`` (results.json,
    results.md). ``quiet``: lm-eval's progress bars and log lines hidden (redrawn bars are hundreds
    of lines in a headless notebook); on an error their last lines are printed before it is raised.
    Returns (rows: one per model, task and metric, with its value and stderr; {name: lm-eval's
    results dict})."""
    from ...eval import OFFLINE_TASKS, PLAN_TASKS, run_lm_eval

    names = {"offline": list(OFFLINE_TASKS), "plan": list(PLAN_TASKS)}.get(tasks, tasks)
    rows, results = [], {}
    for i, (name, model) in enumerate(models.items(), 1):
        step_line(i, len(models), f"lm-eval on {name}: {', '.join(map(str, names))}")
        where = None if out_dir is None else Path(out_dir) / name.replace(" ", "_")
        with _quiet(quiet):
            res = run_lm_eval(
                model,
                names,
                tokenizer=tokenizer,
                batch_size=batch_size,
                limit=limit,
                out_dir=where,
                device=device,
                seed=seed,
            )
        results[name] = res
        for task, metrics in res["results"].items():
            for key, value in metrics.items():
                metric, comma, _filter = key.partition(",")  # "acc,none": metric, filter
                if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                    continue
                err = metrics.get(f"{metric}_stderr,{_filter}")
                rows.append(
                    {
                        "model": name,
                        "task": task,
                        "metric": metric,
                        "value": round(float(value), 4),
                        "stderr": round(float(err), 4) if isinstance(err, (int, float)) else None,
                    }
                )
    return rows, results


def score_table(rows: list[dict], digits: int = 4) -> list[dict]:
    """:func:`evaluate_models`' rows side by side: one row per task and metric, one column per
    model."""
    out: dict = {}
    for r in rows:
        row = out.setdefault((r["task"], r["metric"]), {"task": r["task"], "metric": r["metric"]})
        row[r["model"]] = round(r["value"], digits)
    return list(out.values())


@contextlib.contextmanager
def _quiet(on: bool):
    """stderr (tqdm bars) captured and lm-eval's loggers at ERROR while on; the capture's tail is
    printed if the body raises."""
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


def scaling_sweep(
    cfg, widths, tokens: int, data, val_data, *, out_dir, n_layer: int | None = None, callbacks=()
) -> list[dict]:
    """Models of ``cfg``'s recipe at each width (d_model; ``n_layer`` default the model's), each
    trained on the same ``tokens`` tokens (in the same order) with the Trainer in this process,
    evaluated once at the end, in ``out_dir/d<width>``. Rows: ``d_model``, ``n_layer``, ``params``,
    ``params_no_emb``, ``flops_per_token`` (:func:`ssmkit.eval.flops_per_token`), ``compute`` (=
    flops_per_token x tokens trained), ``tokens``, ``val_loss``, ``seconds``."""
    from ...data import TokenLoader
    from ...eval import flops_per_token
    from ...models import build_model
    from ...train import Trainer

    tokens = checks.integer(tokens, "tokens", minimum=1)
    vocab = TokenLoader(data, cfg.seq_len, 1).index["vocab_size"]
    steps = max(1, tokens // cfg.batch_tokens)
    rows = []
    for width in widths:
        over = {**cfg.model_overrides, "d_model": checks.integer(width, "width", minimum=8)}
        if n_layer is not None:
            over["n_layer"] = n_layer
        run_cfg = dataclasses.replace(
            cfg,
            model_overrides=over,
            max_steps=steps,
            max_tokens=None,
            eval_every=0,
            warmup_steps=min(cfg.warmup_steps, steps // 10),
            overwrite=True,
            out_dir=str(Path(out_dir) / f"d{width}"),
        )
        model = build_model(run_cfg.model_config(vocab_size=vocab), seed=run_cfg.seed)
        start = time.perf_counter()
        history = Trainer(
            model,
            run_cfg,
            data=data,
            val_data=val_data,
            callbacks=list(callbacks),
            name=f"d_model {width}",
        ).fit()
        evals = [r for r in history if r["kind"] == "eval"]
        fpt = flops_per_token(model, cfg.seq_len)
        trained = steps * cfg.batch_tokens
        rows.append(
            {
                "d_model": width,
                "n_layer": model.config.n_layer,
                "params": model.num_parameters(),
                "params_no_emb": model.num_parameters(exclude_embeddings=True),
                "flops_per_token": fpt,
                "compute": fpt * trained,
                "tokens": trained,
                "val_loss": round(evals[-1]["val_loss"], 4),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    return rows


def fit_power_law(x, y) -> dict:
    """Least squares of log y = log a - b log x: the power law y = a * x^-b through points (x, y) >
    0 (at least two distinct x). Returns ``a``, ``b`` (the exponent, positive when y falls), ``r2``
    (of the log-log fit) and ``points``."""
    xs, ys = [float(v) for v in x], [float(v) for v in y]
    if len(xs) != len(ys) or len(set(xs)) < 2 or min(xs + ys) <= 0:
        raise ValueError(
            f"fit_power_law needs >= 2 distinct positive x and positive y of the same length; "
            f"got x={xs}, y={ys}"
        )
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxx = sum((v - mx) ** 2 for v in lx)
    slope = sum((u - mx) * (v - my) for u, v in zip(lx, ly)) / sxx
    intercept = my - slope * mx
    total = sum((v - my) ** 2 for v in ly)
    resid = sum((v - (intercept + slope * u)) ** 2 for u, v in zip(lx, ly))
    return {
        "a": math.exp(intercept),
        "b": -slope,
        "r2": 1 - resid / total if total else 1.0,
        "points": len(xs),
    }


def predict_loss(fit: dict, compute: float) -> float:
    """The fitted power law at ``compute``: a * compute^-b."""
    return fit["a"] * float(compute) ** -fit["b"]


def model_compute(preset: str, tokens: int, *, vocab_size: int, seq_len: int) -> dict:
    """Parameters and training compute (:func:`ssmkit.eval.flops_per_token` x ``tokens``) of a model
    preset with ``vocab_size``, counted on the meta device (nothing allocated)."""
    import torch

    from ...eval import flops_per_token
    from ...models import ModelConfig, build_model

    with torch.device("meta"):
        model = build_model(ModelConfig.preset(preset, vocab_size=vocab_size))
    fpt = flops_per_token(model, seq_len)
    return {
        "preset": preset,
        "params": model.num_parameters(),
        "flops_per_token": fpt,
        "compute": fpt * tokens,
        "tokens": tokens,
    }


def plot_scaling(
    rows: list[dict],
    fit: dict,
    path,
    *,
    extra: dict | None = None,
    title: str | None = None,
    show: bool | None = None,
):
    """Validation loss against compute on log-log axes: the sweep's points, the fitted power law,
    and ``extra`` ({"label": (compute, loss)}, e.g. the prediction for 130M) as stars. Saved to
    ``path`` (written whole) and shown in a Jupyter kernel. Returns the figure."""

    from matplotlib.figure import Figure

    from ...plots import save_and_show

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.add_subplot()
    xs, ys = [r["compute"] for r in rows], [r["val_loss"] for r in rows]
    ax.loglog(
        xs,
        ys,
        "o",
        ms=6,
        label="sweep (d_model " + ", ".join(str(r["d_model"]) for r in rows) + ")",
    )
    lo, hi = min(xs), max([*xs, *(c for c, _ in (extra or {}).values())])
    grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    ax.loglog(
        grid,
        [predict_loss(fit, c) for c in grid],
        "-",
        lw=1.2,
        label=f"fit: L = {fit['a']:.3g} C^-{fit['b']:.3f} (R² {fit['r2']:.2f})",
    )
    for label, (c, loss) in (extra or {}).items():
        ax.loglog([c], [loss], "*", ms=12, label=f"{label}: {loss:.2f}")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return save_and_show(fig, path, show)
