"""``ssmkit.env_report()``: what this machine offers and which backend each op will use."""

from __future__ import annotations

import platform
import sys
from contextlib import contextmanager

import torch

from .checks import device_name
from .ops import backend as _backend
from .ops import compiled as _compiled


def module_status(name: str) -> str:
    """What importing ``name`` gives: its version ("installed" if it has none), "not installed", or
    "broken (<error>)": a CUDA extension built against another torch raises more than
    ImportError."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        return "not installed"
    try:
        module = __import__(name)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"broken ({type(exc).__name__}: {first})"
    return getattr(module, "__version__", "installed")


def env_report() -> str:
    """A multi-line report: Python, torch, device, kernels, and the backend of every op."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = [
        f"python       {sys.version.split()[0]} ({platform.platform()})",
        f"torch        {torch.__version__} (threads: {torch.get_num_threads()})",
        f"device       {device}",
    ]
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"gpu          {props.name}, {props.total_memory / 2**30:.1f} GiB, "
            f"bf16: {torch.cuda.is_bf16_supported()}"
        )
    else:
        lines.append("gpu          none (CUDA not available)")
    unchecked = "not checked (no CUDA)"
    lines.append(f"mamba_ssm    {module_status('mamba_ssm') if device == 'cuda' else unchecked}")
    lines.append(
        f"causal_conv1d {module_status('causal_conv1d') if device == 'cuda' else unchecked}"
    )
    lines.append(
        f"offline      hub: {'yes' if offline('hub') else 'no'}, "
        f"datasets: {'yes' if offline('datasets') else 'no'} (HF_HUB_OFFLINE, ...)"
    )
    forced = _backend.forced_backend()
    lines.append(f"SSMKIT_BACKEND {forced or 'unset (automatic)'}")
    lines.append(
        f"compiled scans {'on' if _compiled.enabled() else 'off'} (the torch backend's S6 and SSD "
        "through torch.compile: ssmkit.ops.compile_scan / SSMKIT_COMPILE_SCAN)"
    )
    lines.append(f"backends on {device}:")
    lines += [f"  {op:<24} {choice}" for op, choice in _backend.describe(device).items()]
    return "\n".join(lines)


_LIBC = None
_MALLOC_MODE: str | None = None  # glibc's own (None), "reuse" or "measure": the last one set


def _mallopt(*settings: tuple[int, tuple[int, ...]]) -> bool:
    """glibc's ``mallopt(param, value)`` for each ``(param, candidate values)``, taking the first
    value glibc accepts; False without glibc (musl, macOS) or when a parameter takes none."""
    global _LIBC
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return all(any(_LIBC.mallopt(param, v) == 1 for v in values) for param, values in settings)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to do
        return False


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def reuse_freed_memory() -> bool:
    """Keep freed CPU memory in the process instead of handing it back to the OS (glibc only).

    glibc serves blocks above a threshold (at most 32 MiB by default) with ``mmap`` and returns them
    with ``munmap`` when freed, so every training step maps its large activations (the logits of a
    50K vocabulary: 400 MB a micro-batch) afresh and page-faults them in, which can take a large
    share of a CPU step in the kernel (``benchmarks/profile_train_step.py`` counts the page faults
    per step). Raising the mmap and trim thresholds lets freed blocks be reused. The price is memory
    the process keeps: a higher peak RSS. Process-wide; applied again at every call, so it also ends
    :func:`measure_freed_memory`. ``SSMKIT_REUSE_MEMORY=0`` turns it off (less memory, slower
    steps). Returns whether it is in effect.
    """
    import os

    global _MALLOC_MODE
    if os.environ.get("SSMKIT_REUSE_MEMORY", "1") == "0":
        return False
    # glibc versions that cap the mmap threshold (at 32 MiB) still reuse blocks up to the cap
    if _mallopt((M_MMAP_THRESHOLD, (1 << 30, 1 << 25)), (M_TRIM_THRESHOLD, (1 << 31,))):
        _MALLOC_MODE = "reuse"
        return True
    return False


def release_freed_memory() -> float | None:
    """Hand the CPU memory the process freed back to the OS now: ``gc.collect()``, then glibc's
    ``malloc_trim(0)``. Under :func:`reuse_freed_memory` freed blocks stay in the process (that is
    its point during training), so after a run a notebook's kernel would hold its largest step's
    activations until it exits; :meth:`ssmkit.train.Trainer.fit` calls this when it ends on a CPU.
    Live tensors are untouched. Returns the MiB the resident set shrank by (None: not measurable
    here, or not glibc)."""
    import gc

    gc.collect()
    before = rss_mb()
    if before is None or not _mallopt() or _LIBC is None:
        return None
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:  # not glibc
        return None
    after = rss_mb()
    return None if after is None else round(before - after, 1)


def rss_mb() -> float | None:
    """This process's resident set in MiB (``/proc/self/statm``); None elsewhere."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def measure_freed_memory(mmap_threshold: int = 128 * 1024) -> bool:
    """The memory-measuring setting: every block above ``mmap_threshold`` bytes gets its own
    ``mmap``, so a freed tensor leaves the resident set at once and RSS follows the live tensors
    (glibc otherwise raises its threshold as large blocks are freed, after which they stay in the
    heap). The price is a page fault for every page a large tensor touches: calls run slower than
    under :func:`reuse_freed_memory`. Process-wide until that is called. Returns False without
    glibc."""
    global _MALLOC_MODE
    if _mallopt((M_MMAP_THRESHOLD, (int(mmap_threshold),))):
        _MALLOC_MODE = "measure"
        return True
    return False


def malloc_mode() -> str | None:
    """The allocator setting last applied by this module: "reuse", "measure", or None (glibc's
    own)."""
    return _MALLOC_MODE


# the variables that keep Hugging Face's libraries off the network, per library
OFFLINE_VARIABLES = {
    "hub": ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"),
    "datasets": ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"),
}


def offline(library: str = "hub") -> bool:
    """Whether the user switched Hugging Face's ``library`` off the network: "hub" (models and
    tokenizers: ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``) or "datasets" (``HF_HUB_OFFLINE`` or
    ``HF_DATASETS_OFFLINE``) set to 1 / true / yes / on. Says nothing about whether a network
    exists."""
    import os

    if library not in OFFLINE_VARIABLES:
        raise ValueError(f"library={library!r} is not valid; valid: {', '.join(OFFLINE_VARIABLES)}")
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in OFFLINE_VARIABLES[library]
    )


def pick_device(device: str = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` if a GPU is visible, else ``"mps"`` (Apple), else ``"cpu"``.

    An explicit device that is not available raises ValueError saying what is.
    """
    device_name(device)  # the spelling; whether it exists is checked here
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    kind, _, index = device.partition(":")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} requested but CUDA is not available here "
            f"(torch {torch.__version__}); use device='auto' or 'cpu'"
        )
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} GPU(s) visible")
    if kind == "mps" and not mps:
        raise ValueError(
            f"device={device!r} requested but MPS is not available; use 'auto' or 'cpu'"
        )
    return device


@contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block, restored after it (also on an error).
    For models so small that a second thread only adds synchronisation: a companion note's task
    models (width 32-64) spend more CPU time waiting than computing on two threads, several times
    more on a busy 2-core machine."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"torch_threads: n must be an integer >= 1; got {n!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
