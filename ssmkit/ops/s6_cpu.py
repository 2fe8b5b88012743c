r"""The ``cpu`` backend of :func:`~ssmkit.ops.selective_scan`: a fused C++ S6 scan, the default on
CPU tensors wherever it builds.

The math is :mod:`ssmkit.ops.s6`'s (Algorithm 2 of Gu & Dao 2023, eqs. 2a, 2b, 4; the backward is
derived above :class:`~ssmkit.ops.s6.SelectiveScanFn.backward`); the kernel is
``csrc/selective_scan_cpu.cpp``. One op does what the torch backend does in many passes over
memory: Δ = softplus(δ + bias), the recurrence, y = C h, the D skip and the z gate, forward and
backward, vectorised over a block of 16 channels (the d_state values of a block stay in L1), threads
over batch x channel blocks (``at::parallel_for``: torch's intra-op threads), fp32 whatever the
input dtype. The backward keeps no (batch, dim, seqlen, dstate) tensor: the forward saves the state
entering each chunk of :data:`CHUNK` steps and the backward recomputes one chunk at a time, as
mamba_ssm's CUDA kernel does.

Build: at the first call, never at install or import, with ``torch.utils.cpp_extension.load``
(a C++ compiler and ninja), into ``$SSMKIT_KERNEL_CACHE`` (default ``<ssmkit cache>/kernels``,
:func:`ssmkit.io.cache_dir`), in a folder keyed by a hash of the source, the flags, torch's version,
Python's extension suffix, the compiler and the CPU (``-march=native`` on x86-64), so a machine
compiles it once and every later process only imports it. Concurrent first calls (pytest-xdist
workers) take turns under :class:`ssmkit.io.DirLock`; a build goes to a temporary folder renamed
into place, so a killed one leaves nothing a later process would load. Where it cannot build, one
line on stderr says what failed, that the ``torch`` backend runs instead and how to get the fast
path (:func:`kernel_error` says why; ``SSMKIT_BACKEND=cpu`` then raises instead).

Glossary: ``delta`` δ (Δ before bias and softplus), ``reset`` (batch, seqlen) 1 where a packed
sample starts (:func:`ssmkit.ops.packing.resets`), ``states`` (batch, chunks, dstate, dim) the
state entering each chunk.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from .. import io
from .packing import resets
from .precision import widen

SOURCE = Path(__file__).parent / "csrc" / "selective_scan_cpu.cpp"
CHUNK = 64  # steps per recomputed chunk: saved states are dstate / CHUNK of a (b, L, d) tensor
BUILD_WAIT = 900.0  # seconds a process waits for another one's build of the same kernel
_MODULE = None  # the built extension, once loaded
_ERROR: str | None = None  # why it could not be built, once tried


def kernel_dir() -> Path:
    """Where built kernels live: ``$SSMKIT_KERNEL_CACHE``, else ``<ssmkit cache>/kernels``."""
    env = os.environ.get("SSMKIT_KERNEL_CACHE", "").strip()
    return Path(env) if env else io.cache_dir() / "kernels"


def compiler() -> str:
    """The C++ compiler torch's extension builder runs: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "").strip() or "c++"


def flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags). OpenMP makes ``at::parallel_for`` parallel (the process already
    holds torch's libgomp, so no second runtime loads); -march=native lets the compiler use the
    CPU's vector width (the cache key then includes the CPU's flags); no errno and no trapping math
    let it vectorise what the kernel's polynomials need (neither changes a result)."""
    cflags, ldflags = ["-O3", "-fno-math-errno", "-fno-trapping-math"], []
    if sys.platform.startswith("linux"):
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    if platform.machine().lower() in ("x86_64", "amd64"):
        cflags.append("-march=native")
    return cflags, ldflags


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the
    platform's processor string."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in info.splitlines() if ln.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(sorted(set(keep)))


@functools.cache
def _compiler_id() -> str | None:
    """``$CXX --version``'s first line, or None when no compiler runs."""
    path = shutil.which(compiler())
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{path}: {(out.stdout.strip().splitlines() or [''])[0]}"


def build_key() -> str:
    """16 hex digits naming this build: source, flags, torch, Python ABI, compiler, CPU."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (
        repr(flags()),
        torch.__version__,
        sysconfig.get_config_var("EXT_SUFFIX") or sys.version,
        _compiler_id() or "",
        platform.machine(),
        _cpu_id(),
    ):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _names() -> tuple[str, Path]:
    key = build_key()
    return f"ssmkit_s6_cpu_{key}", kernel_dir() / f"s6_cpu-{key}"


def _library(target: Path, name: str) -> Path | None:
    """The built shared library in ``target``, if there is one."""
    found = sorted(target.glob(f"{name}*.so")) + sorted(target.glob(f"{name}*.pyd"))
    return found[0] if found else None


def _import(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build():
    """Import the cached build, or build it (one process at a time); returns the module."""
    from torch.utils import cpp_extension

    name, target = _names()
    found = _library(target, name)
    if found is not None:
        return _import(found, name)
    if _compiler_id() is None:
        raise RuntimeError(f"no C++ compiler ({compiler()!r} not found or does not run)")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja, which torch's extension builder needs, is not installed")
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with io.DirLock(root, "building the fused CPU selective scan", wait=BUILD_WAIT):
        found = _library(target, name)  # another process may have built it while we waited
        if found is not None:
            return _import(found, name)
        prefix = f".{target.name}.tmp-"
        io.remove_stale_temp_dirs(root, prefix)
        tmp = io.TempDir(root, prefix)
        try:
            cflags, ldflags = flags()
            start = time.perf_counter()
            module = cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(tmp.path),
                verbose=False,
            )
            (tmp.path / "build_seconds.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
            os.rename(tmp.path, target)
        finally:
            tmp.close()
            shutil.rmtree(tmp.path, ignore_errors=True)
    return module


def kernel_error() -> str | None:
    """None when the fused kernel is ready (built now, at the first call in this process, if need
    be), else why not. A failure prints one line on stderr, once per process."""
    global _MODULE, _ERROR
    if _MODULE is not None or _ERROR is not None:
        return _ERROR
    try:
        _MODULE = _build()
    except Exception as exc:  # no compiler, no ninja, a compile error, an unwritable cache, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        _ERROR = f"{type(exc).__name__}: {first}"
        print(
            f"ssmkit: the fused CPU selective scan could not be built ({_ERROR}); Mamba-1 runs "
            "the slower pure-PyTorch scan instead. For the fast path install a C++ compiler and "
            "ninja (e.g. `apt install g++ ninja-build` or `pip install ninja`), or set "
            "SSMKIT_BACKEND=torch to skip the attempt.",
            file=sys.stderr,
            flush=True,
        )
    return _ERROR


def status() -> str:
    """What an automatic CPU call of selective_scan runs, without building anything: for
    :func:`ssmkit.ops.backend.describe`."""
    if _MODULE is not None:
        return "cpu (fused C++ scan, loaded)"
    if _ERROR is not None:
        return f"torch (the fused CPU scan did not build: {_ERROR})"
    try:
        name, target = _names()
    except OSError as exc:
        return f"torch (the fused CPU scan's source is missing: {exc})"
    if _library(target, name) is not None:
        return f"cpu (fused C++ scan, built in {target})"
    if _compiler_id() is None:
        return f"torch (no C++ compiler for the fused CPU scan: {compiler()!r} not found)"
    return f"cpu (fused C++ scan, compiled at its first call into {target})"


def unsupported(u, A, B, initial_state) -> str | None:
    """Why the kernel cannot take these inputs (the dispatcher then runs the torch path), or None.
    float64 stays on the torch path, which keeps it (the kernel computes in fp32)."""
    if any(t is not None and t.dtype == torch.float64 for t in (u, A, B, initial_state)):
        return "float64 inputs (the kernel computes in fp32; the torch path keeps float64)"
    if u.numel() == 0 or A.numel() == 0:
        return "an empty input"
    if any(t is not None and not t.device.type == "cpu" for t in (u, A, B, initial_state)):
        return "the tensors are not on the CPU"
    return None


class SelectiveScanCpuFn(torch.autograd.Function):
    """The fused kernel with its backward. u, delta, z: (b, L, d) fp32 contiguous; A: (d, n);
    B, C: (b, L, g, n); D, delta_bias: (d,) or None; h0: (b, d, n) or None; reset: (b, L) uint8 or
    None. Returns out (b, L, d) and h_L (b, d, n). Saves the inputs and the chunk states only
    (batch x dim x dstate floats per :data:`CHUNK` steps)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, h0, softplus, reset):
        out, h_last, states = _MODULE.forward(
            u, delta, A, B, C, D, z, delta_bias, h0, reset, softplus, CHUNK, True
        )
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, reset, states)
        ctx.softplus, ctx.has_h0 = softplus, h0 is not None
        return out, h_last

    @staticmethod
    def backward(ctx, dout, dh_last):
        u, delta, A, B, C, D, z, delta_bias, reset, states = ctx.saved_tensors
        du, ddelta, dA, dB, dC, dD, dz, dbias, dh0 = _MODULE.backward(
            u,
            delta,
            A,
            B,
            C,
            D,
            z,
            delta_bias,
            reset,
            ctx.softplus,
            states,
            dout.contiguous(),
            dh_last.contiguous(),
            CHUNK,
        )
        # per-row (dA, dD, dbias) and per-superblock (dB, dC) partials: summed here
        return (
            du,
            ddelta,
            dA.sum(0),
            dB.sum(0),
            dC.sum(0),
            None if D is None else dD.sum(0),
            dz if z is not None else None,
            None if delta_bias is None else dbias.sum(0),
            dh0 if ctx.has_h0 else None,
            None,
            None,
        )


def fused_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    return_final_state=False,
    seq_idx=None,
):
    """The fused CPU selective scan on checked inputs (:func:`ssmkit.ops.s6.selective_scan_cpu`
    checks them): u, delta, z: (batch, dim, seqlen); A: (dim, dstate); B, C: (batch, ngroups,
    dstate, seqlen); D, delta_bias: (dim,); initial_state: (batch, dim, dstate); seq_idx: (batch,
    seqlen). Returns y (batch, dim, seqlen) in u's dtype and layout, and h_L (batch, dim, dstate)
    fp32 with ``return_final_state``, as :func:`~ssmkit.ops.s6.selective_scan_reference`. Raises
    :class:`~ssmkit.ops.backend.BackendError` where the kernel does not build or cannot take the
    inputs."""
    from .backend import BackendError

    why = unsupported(u, A, B, initial_state) or kernel_error()
    if why is not None:
        raise BackendError(f"the fused CPU selective scan cannot run: {why}")
    tm = lambda M: None if M is None else widen(M).transpose(1, 2).contiguous()  # noqa: E731
    f = lambda t: None if t is None else widen(t).contiguous()  # noqa: E731
    grouped = lambda M: widen(M).permute(0, 3, 1, 2).contiguous()  # noqa: E731  (b, L, g, n)
    reset = None if seq_idx is None else resets(seq_idx).to(torch.uint8).contiguous()
    z_t = None if z is None else widen(z).transpose(1, 2)  # (b, L, d): any row strides will do
    z_t = z_t if z_t is None or z_t.stride(2) == 1 else z_t.contiguous()
    args = (tm(u), tm(delta), f(A), grouped(B), grouped(C), f(D), z_t, f(delta_bias))
    h0 = f(initial_state)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (u, delta, A, B, C, D, z, delta_bias, h0)
    ):
        y, h = SelectiveScanCpuFn.apply(*args, h0, delta_softplus, reset)
    else:  # inference: no states saved for a backward
        y, h, _ = _MODULE.forward(*args, h0, reset, delta_softplus, CHUNK, False)
    y = y.transpose(1, 2).to(u.dtype)  # (b, d, L), channels-last: the mixer's layout
    channels_last = u.stride(1) == 1 and u.shape[1] > 1
    y = y if channels_last else y.contiguous()
    return (y, h) if return_final_state else y
