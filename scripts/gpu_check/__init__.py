"""GPU readiness check: one prepared script for a lent GPU (--quick: a few seconds on a CPU).

This package is the check; ``scripts/gpu_check.py`` runs it.

Sections, run in this order, one module each (its docstring says what it measures); each returns a
dict with a ``status``: "ok", "skipped: <reason>" or "error" (an exception in one section is
recorded as {"status": "error", "error": ...} and the others still run):

  env         torch / CUDA / GPU / bf16 support, the backend each op takes, whether mamba_ssm and
              causal_conv1d import
  parity      every op of ssmkit's ``torch`` backend on the device against the ``reference`` backend
              on the CPU, forward and backward, fp32 and bf16 (the kernels' own suites' tolerances,
              :mod:`ssmkit.ops.tolerances`, as tests/unit/ops/test_low_precision.py)
  kernels     (CUDA, when mamba_ssm / causal_conv1d import) their ops against ssmkit's torch backend
              on the same GPU: parity and speed at the 130M models' shapes
  train_step  130M Mamba-1 and Mamba-2 training steps (bf16 autocast, AdamW): tokens/s and MFU,
              beside transformers' Mamba / Mamba2 with the same weights and a matched Llama (SDPA)
  generation  prefill and decode of the same ssmkit models and the Llama (KV cache) at prompts 2K
              and 16K, batch 1 and 8
  notebook    notebooks/01_prototype_130m.ipynb under papermill (``ssmkit workbook run``) with
              params/gpu-a100.yaml, offline and 30 steps: wall time, the metrics it wrote. Needs
              papermill + ipykernel (the workbook extra): skipped, saying so, where they are missing

:mod:`.context` holds what they share (the :class:`~.context.Context`, seeded tensors, fp32 without
TF32); :mod:`.models` the models train_step and generation build.

Without CUDA, kernels and notebook are "skipped: no CUDA device"; parity runs on the CPU (torch vs
reference); train_step and generation run tiny models on the CPU with --quick (the code path, not a
measurement), and are skipped without it. Everything is offline (HF_HUB_OFFLINE=1 before
transformers is imported); nothing is compiled or downloaded; nothing is imported from tests/.

Run it on a lent GPU from the repository root (a bare image: ssmkit need not be installed):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/gpu_check.py --out $OUT/gpu_check.json \
        2>&1 | tee $OUT/log

or ``make gpu-check`` in the project's venv. Options:

    --device DEV        cuda (default when available) | cuda:N | cpu
    --quick             tiny shapes and models (seconds; what the CPU test runs)
    --only S[,S]        run only these sections;  --skip S[,S]: all but these
    --time-budget SEC   a section that would start after SEC s is skipped (default 480; env always
                        runs)
    --precision P       bf16 (default on CUDA) | fp32 (default on CPU): autocast of train_step,
                        generation
    --out FILE          also write the JSON there, atomically, after every section (a run stopped
                        from outside leaves what it measured)
    --json-only         print only the JSON line

The last stdout line is one JSON object: {"ok", "partial", "failed", "device", "quick", "wall_s",
"status": {section: status}, "sections": {section: {...}}}. Exit status 0 when no section errored
and none failed its check ("pass": false: a parity case, a kernel's parity, an ssmkit model's step
or generation), else 1. Estimated seconds per section on one H200: :data:`ESTIMATE_S`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import torch

from . import env, generation, kernels, notebook, parity, train_step
from .context import Context, free

SECTION_NAMES = ("env", "parity", "kernels", "train_step", "generation", "notebook")
# guesses of seconds per section on one H200 (stock CUDA torch; kernels only when mamba_ssm
# imports, else skipped at once); replace them once measured
ESTIMATE_S = {
    "env": 5,
    "parity": 20,
    "kernels": 90,
    "train_step": 120,
    "generation": 75,
    "notebook": 200,
}
ESTIMATE_QUICK_CPU_S = {
    "env": 1,
    "parity": 8,
    "kernels": 0,
    "train_step": 10,
    "generation": 5,
    "notebook": 0,
}
DEVICE_COMMAND = (
    "PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/gpu_check.py "
    "--out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log"
)

SECTIONS = {
    "env": env.run,
    "parity": parity.run,
    "kernels": kernels.run,
    "train_step": train_step.run,
    "generation": generation.run,
    "notebook": notebook.run,
}


def run_section(ctx: Context, name: str) -> dict:
    """SECTIONS[name](ctx), timed; an exception becomes {"status": "error", "error",
    "traceback"}."""
    t0 = time.perf_counter()
    try:
        result = dict(SECTIONS[name](ctx) or {})
        result.setdefault("status", "ok")
    except Exception as exc:
        tb = traceback.format_exc().strip().splitlines()
        result = {
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": tb[-12:],
        }
    finally:
        free()
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def _clean(obj):
    """JSON-safe: NaN / inf -> None, tuples -> lists, tensors and dtypes -> numbers or strings."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float):  # 4 significant digits: a readable line
        return float(f"{obj:.4g}") if math.isfinite(obj) else None
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return _clean(obj.item())
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


def _names(value: str, flag: str, parser) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in SECTION_NAMES]
    if bad or not names:
        parser.error(
            f"{flag}: unknown section(s) {bad or [value]}; valid: {', '.join(SECTION_NAMES)}"
        )
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", help="cuda (default when available), cuda:N or cpu")
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes and models: seconds (the CPU test)"
    )
    p.add_argument("--only", help=f"comma-separated sections to run ({', '.join(SECTION_NAMES)})")
    p.add_argument("--skip", help="comma-separated sections to leave out")
    p.add_argument(
        "--time-budget",
        type=float,
        default=480.0,
        help="seconds; a section that would start after it is skipped (default 480)",
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        help="train_step / generation: bf16 autocast (default on CUDA) or fp32 (default on CPU)",
    )
    p.add_argument("--json-only", action="store_true", help="print only the JSON line")
    p.add_argument("--out", help="also write the JSON summary to this file (atomically)")
    args = p.parse_args(argv)
    if args.only and args.skip:
        p.error("give --only or --skip, not both")
    args.selected = (
        _names(args.only, "--only", p)
        if args.only
        else [
            n
            for n in SECTION_NAMES
            if n not in (_names(args.skip, "--skip", p) if args.skip else [])
        ]
    )
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here (torch {torch.__version__})")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device {args.device}: only cuda and cpu are supported")
    args.device = device
    if args.time_budget < 0:
        p.error("--time-budget must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda *a: None) if args.json_only else (lambda *a: print(*a, flush=True))
    precision = args.precision or ("bf16" if args.device.type == "cuda" else "fp32")
    ctx = Context(args.device, args.quick, args.time_budget, precision, log)
    if args.quick and not ctx.cuda:
        torch.set_num_threads(1)  # the code path, not a measurement: steadier on a busy shared CPU
    estimates = ESTIMATE_QUICK_CPU_S if args.quick and not ctx.cuda else ESTIMATE_S
    log(
        f"ssmkit GPU check: device {args.device}, {'quick' if args.quick else 'full'}, "
        f"precision {precision}, time budget {args.time_budget:.0f} s, "
        f"sections {', '.join(args.selected)}"
    )
    log(
        "on a lent GPU, from the repository root (nothing installed, nothing downloaded):\n"
        f"  {DEVICE_COMMAND}\n"
        "  (device tool: timeout_s 600; in the project's venv: make gpu-check)"
    )
    where = " on one H200 (guesses until measured)" if estimates is ESTIMATE_S else " here"
    log(
        f"estimated seconds per section{where}: "
        + ", ".join(f"{n} {estimates[n]}" for n in SECTION_NAMES)
        + f"; total ~{sum(estimates.values())}"
    )
    sections = {}

    def summary(partial: bool) -> dict:
        """partial: written after each section (--out), the sections not reached yet marked so."""
        every = {
            n: sections.get(n, {"status": "not reached (the run was stopped)"})
            for n in SECTION_NAMES
        }
        failed = [n for n, s in every.items() if s["status"] == "error" or s.get("pass") is False]
        return {
            "ok": not failed and not partial,
            "partial": partial,
            "failed": failed,
            "device": str(args.device),
            "quick": args.quick,
            "precision": precision,
            "time_budget_s": args.time_budget,
            "wall_s": round(ctx.elapsed(), 1),
            "command": DEVICE_COMMAND,
            "status": {n: s["status"] for n, s in every.items()},
            "sections": every,
        }

    def write(result: dict) -> str:
        text = json.dumps(_clean(result), allow_nan=False)
        if args.out:  # after every section: a run stopped from outside still leaves its results
            from ssmkit.io import write_atomically

            write_atomically(args.out, text + "\n")
        return text

    for name in SECTION_NAMES:
        if name not in args.selected:
            why = f"--only {args.only}" if args.only else f"--skip {args.skip}"
            sections[name] = {"status": f"skipped: not selected ({why})"}
            continue
        if name != "env" and ctx.elapsed() >= args.time_budget:
            sections[name] = {
                "status": f"skipped: time budget of {args.time_budget:.0f} s spent "
                f"({ctx.elapsed():.0f} s elapsed)"
            }
            log(f"[{name}] {sections[name]['status']}")
            continue
        log(f"[{name}] (estimate {estimates[name]} s, {ctx.elapsed():.0f} s elapsed)")
        sections[name] = run_section(ctx, name)
        log(
            f"[{name}] {sections[name]['status']} in {sections[name]['seconds']:.1f} s"
            + (f": {sections[name]['error']}" if sections[name]["status"] == "error" else "")
        )
        write(summary(partial=True))
    result = summary(partial=False)
    text = write(result)
    verdict = "OK" if result["ok"] else "FAILED: " + ", ".join(result["failed"])
    log(f"{verdict} in {ctx.elapsed():.0f} s")
    print(text, flush=True)
    return 0 if result["ok"] else 1
