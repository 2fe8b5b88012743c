"""Time and memory: seconds per step timed round-robin, tokens/s, and peak memory.

A shared machine's speed drifts by tens of percent, so peers are timed in one process, round-robin
(one call of each per round): drift hits all of them alike and their ratio holds when absolute
numbers don't.

    seconds = time_round_robin({"ssmkit": step_a, "peer": step_b}, steps=7, warmup=3)
    rate = tokens_per_step / statistics.median(seconds["ssmkit"])  # what throughput() returns
    throughput(step, tokens_per_step=8 * 256)                      # one callable alone
    peak_memory_mb(device)                                         # MiB, peak since start
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch

from .. import checks


def _sync(device: torch.device | None):
    """Wait for the device's queued work (a GPU call returns before its kernels finish)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device is not None and device.type == "mps":
        torch.mps.synchronize()


def time_round_robin(
    calls: dict[str, Callable[[], object]],
    steps: int,
    warmup: int = 1,
    *,
    skip: Callable[[str, int], bool] | None = None,
    on_round: Callable[[int], None] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each callable, called round-robin: ``warmup + steps`` rounds, each
    calling every callable once in the dict's order; the first ``warmup`` rounds are not timed.

    skip(name, round): True leaves that call out (e.g. a slow peer run only in rounds 0 and
    ``warmup``); on_round(round): called after each round (progress). device: a CUDA/MPS device is
    synchronized before and after each call, so the time covers its kernels. Returns {name: [seconds
    of each timed call]} (``steps`` entries unless skipped)."""
    steps, warmup = (
        checks.integer(steps, "steps", minimum=1),
        checks.integer(warmup, "warmup", minimum=0),
    )
    device = torch.device(device) if device is not None else None
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(warmup + steps):
        for name, call in calls.items():
            if skip is not None and skip(name, r):
                continue
            _sync(device)
            t0 = time.perf_counter()
            call()
            _sync(device)
            if r >= warmup:
                seconds[name].append(time.perf_counter() - t0)
        if on_round is not None:
            on_round(r)
    return seconds


def throughput(
    step: Callable[[], object],
    tokens_per_step: int,
    steps: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> float:
    """Tokens per second of ``step`` (a training step, a forward pass, ...) that handles
    ``tokens_per_step`` tokens: tokens_per_step / median(seconds per call) over ``steps`` timed
    calls after ``warmup``."""
    seconds = time_round_robin({"step": step}, steps, warmup, device=device)["step"]
    return tokens_per_step / statistics.median(seconds)


def peak_memory_mb(device: torch.device | str | None = None) -> float:
    """This process's peak memory in MiB.

    CUDA device: the most memory tensors held at once (``torch.cuda.max_memory_allocated``; restart
    the count with ``torch.cuda.reset_peak_memory_stats``). Otherwise (CPU, None): the peak resident
    set size of the process, Linux's ``VmHWM`` (``/proc/self/status``: this process's own, whereas
    ``ru_maxrss`` after fork + exec can still hold the parent's), else ``getrusage``'s
    ``ru_maxrss``."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024  # kB
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # macOS: bytes; Linux, BSD: KiB
