r"""Opt-in: the torch backend's scans through ``torch.compile`` (inductor's generated C++ on CPU).

Why: :class:`ssmkit.ops.s6.SelectiveScanFn` runs the S6 recurrence one time step per PyTorch op and
everything else in (T, batch, dim, dstate) passes over memory, about twenty of them per chunk in
forward and backward; on a CPU the profile of a small Mamba-1 train step puts most of the step there
(``benchmarks/profile_train_step.py`` measures it on this machine). Here each chunk of ``CHUNK``
steps is one function with its loops unrolled, which inductor fuses: in forward Ā_t = exp2(Δ_t A
log2 e) is computed where it is used and h_t stays in registers; backward recomputes the chunk's
states, runs the adjoint and writes each (T, b, d, n) value once. Mamba-2's
:func:`~ssmkit.ops.ssd.ssd_chunked` is compiled whole (forward and backward through AOTAutograd).
What each saves is measured, as a ratio to the eager path, by
``benchmarks/train_step_cpu.py --compile-scan``.

The S6 math is :class:`~ssmkit.ops.s6.SelectiveScanFn`'s (its comments derive the backward); the
loop over chunks, D, the gate and softplus stay in eager PyTorch, and only the state entering each
chunk is saved. The last chunk is padded with Δ = 0 (Ā = 1, no input: the state passes through
unchanged), so every chunk has one shape. With per-sample states the chunks are also cut at every
sample start (:func:`~ssmkit.ops.packing.sample_pieces`: a new sample's initial state replaces the
carried one in its row between two chunks), and each shorter piece is padded the same way: no new
shape, no recompile.

Turn it on with ``ssmkit.ops.compile_scan(True)`` or ``SSMKIT_COMPILE_SCAN=1`` (the CLI reads the
environment). It needs what inductor needs at run time -- a C++ compiler on CPU, Triton on GPU;
without one the first call raises :class:`~ssmkit.ops.backend.BackendError` saying so, and the
commands (``train``, ``generate``, ``eval``, ``convert``) say it at startup (:func:`check_setting`),
as they do for a value of SSMKIT_COMPILE_SCAN that is none of 0, 1, false, true. The first
call for each shape compiles (tens of seconds for S6 forward + backward), so it pays off in
training runs, not in short experiments; after torch's recompile limit (8 shapes) the functions run
eagerly, unrolled.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from .backend import BackendError
from .packing import sample_pieces

LOG2_E = math.log2(math.e)
CHUNK = 16  # unrolled steps per compiled chunk: compile time grows with it
_ENABLED: bool | None = None  # None: read SSMKIT_COMPILE_SCAN


def compile_scan(enabled: bool = True) -> None:
    """Turn the compiled scans (S6 chunks, the SSD) on or off for this process (overrides
    SSMKIT_COMPILE_SCAN); only the ``torch`` backend is affected, never the CUDA kernels. On, an
    automatic S6 call on CPU runs this compiled torch path instead of the fused CPU kernel
    (:mod:`ssmkit.ops.s6_cpu`)."""
    global _ENABLED
    _ENABLED = bool(enabled)


class CompileScanError(BackendError, ValueError):
    """SSMKIT_COMPILE_SCAN holds no valid value, or asks for the compiled scan where no C++
    compiler works; a ValueError too, as the commands report a user's setting."""


def enabled() -> bool:
    """Whether the torch backend of :func:`~ssmkit.ops.selective_scan` and
    :func:`~ssmkit.ops.ssd_scan` runs compiled; a value of SSMKIT_COMPILE_SCAN other than 0 / 1 /
    false / true is a :class:`CompileScanError`."""
    if _ENABLED is not None:
        return _ENABLED
    raw = os.environ.get("SSMKIT_COMPILE_SCAN", "")
    value = raw.strip().lower()
    if value not in ("", "0", "1", "false", "true"):
        raise CompileScanError(
            f"SSMKIT_COMPILE_SCAN={raw.strip()!r}: valid values are 0, 1, false, true (or unset)"
        )
    return value in ("1", "true")


def check_setting() -> None:
    """What a command checks at startup, before it prepares data or loads a model (not at the
    first forward pass): SSMKIT_COMPILE_SCAN's value and, when the compiled scan is on, that
    inductor finds a working C++ compiler (it runs ``CXX --version``; on CPU the scan is C++, and
    Triton builds its launcher with one on GPU). :class:`CompileScanError` otherwise, one line."""
    if not enabled():
        return
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # InvalidCxxCompiler: none of inductor's candidates runs
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CompileScanError(
            f"the compiled scan is on (SSMKIT_COMPILE_SCAN / compile_scan) but no C++ compiler "
            f"works here ({first}); install one (g++, or set CXX to it), or turn the compiled "
            "scan off with SSMKIT_COMPILE_SCAN=0"
        ) from None


def chunk_forward(dt, u, A2, B, C, h, keep):
    """One chunk of the recurrence. dt, u: (T, b, g, c); A2 = A log2 e: (g, c, n); B, C: (T, b, g,
    n); h: (b, g, c, n) entering state; keep: (T, b), 0 where a packed sample starts.
    Returns y (T, b, g, c) with y_t = C_t^T h_t, and h_{T-1}."""
    bx = (dt * u)[..., None]  # Δ_t x_t
    ys = []
    for t in range(dt.shape[0]):
        a = torch.exp2(dt[t, ..., None] * A2) * keep[t, :, None, None, None]  # Ā_t (0 at a reset)
        h = a * h + bx[t] * B[t, :, :, None, :]  # h_t = Ā_t h_{t-1} + Δ_t x_t B_t
        ys.append((h * C[t, :, :, None, :]).sum(-1))  # y_t = C_t^T h_t
    return torch.stack(ys), h


def chunk_backward(dt, u, A2, B, C, h, keep, dy, carry):
    """Gradients of one chunk (the derivation is above ``SelectiveScanFn.backward``).

    dy: (T, b, g, c) = ∂L/∂y; carry: (b, g, c, n) = ∂L/∂h_{T-1} from the chunk after.
    Returns carry for the chunk before (∂L/∂h_entering), dB, dC (T, b, g, n), ddt, du (T, b, g,
    c) -- du without the skip's D dy -- and ∂L/∂A summed over the chunk (g, c, n)."""
    T = dt.shape[0]
    a = torch.exp2(dt[..., None] * A2) * keep[:, :, None, None, None]  # Ā: (T, b, g, c, n)
    dtu = dt * u  # Δ x
    hs = [h]  # h_{t-1} for t = 0 .. T
    for t in range(T):
        hs.append(a[t] * hs[-1] + dtu[t, ..., None] * B[t, :, :, None, :])
    H = torch.stack(hs)
    gs, g = [None] * T, carry
    for t in reversed(range(T)):  # g_t = C_t dy_t + Ā_{t+1} g_{t+1}
        g = g + dy[t, ..., None] * C[t, :, :, None, :]
        gs[t] = g
        g = a[t] * g  # Ā_t g_t: into step t - 1
    G = torch.stack(gs)
    dC = (H[1:] * dy[..., None]).sum(-2)  # Σ_c h_t dy_t
    dB = (G * dtu[..., None]).sum(-2)  # Σ_c g_t Δ_t x_t
    dbx = (G * B[:, :, :, None, :]).sum(-1)  # ∂L/∂(Δ_t x_t)
    d_delta_a = G * H[:-1] * a  # ∂L/∂(Δ_t A)
    dA = (d_delta_a * dt[..., None]).sum((0, 1))
    ddt = (d_delta_a * (A2 / LOG2_E)).sum(-1) + dbx * u
    return g, dB, dC, ddt, dbx * dt, dA


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` through ``torch.compile`` (one compiled graph per input shape); a
    platform where inductor cannot build is a :class:`BackendError` that says how to turn this
    off."""
    try:
        return _compiled(fn)(*args, **kwargs)
    except Exception as exc:
        from torch._dynamo.exc import BackendCompilerFailed  # torch.compile has imported both
        from torch._inductor.exc import InductorError

        if not isinstance(
            exc, (InductorError, BackendCompilerFailed)
        ):  # no compiler, no Triton, ...
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise BackendError(
            f"the compiled scan could not be built ({type(exc).__name__}: {first}); it needs "
            "a C++ compiler on CPU (Triton on GPU). Turn it off with "
            "ssmkit.ops.compile_scan(False) or SSMKIT_COMPILE_SCAN=0"
        ) from exc


def _padded(M: torch.Tensor, L_pad: int, value: float = 0.0) -> torch.Tensor:
    """(L, ...) -> (L_pad, ...), new steps filled with ``value``."""
    if M.shape[0] == L_pad:
        return M
    return F.pad(M, (0, 0) * (M.dim() - 1) + (0, L_pad - M.shape[0]), value=value)


class CompiledScanFn(torch.autograd.Function):
    """Same contract as :class:`ssmkit.ops.s6.SelectiveScanFn` (all fp32): u, delta, z: (b, d, L);
    A: (d, n); B, C: (b, g, n, L); D, delta_bias: (d,) or None; h0: (b, d, n); keep: (b, L) or None;
    spans (the packed samples' rows and positions) and h_samples (n_samples, d, n) or None for
    per-sample states. Returns y: (b, d, L), h_L: (b, d, n) and the samples' final states."""

    @staticmethod
    def forward(
        ctx,
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        h0,
        softplus,
        keep=None,
        spans=None,
        h_samples=None,
    ):
        batch, dim, L = u.shape
        groups, dstate = B.shape[1], A.shape[1]
        state = (batch, groups, dim // groups, dstate)
        T = CHUNK
        # (b, ..., L) -> a contiguous (L, b, ...): the compiled loops read contiguous rows
        tm = lambda M: M.permute(-1, *range(M.dim() - 1)).contiguous()  # noqa: E731
        dt_raw = tm(delta) if delta_bias is None else tm(delta) + delta_bias
        dt = F.softplus(dt_raw) if softplus else dt_raw  # Δ: (L, b, d)
        grp = lambda M: M.reshape(M.shape[0], *state[:3])  # noqa: E731  (k, b, d) -> (k, b, g, c)
        u_t = tm(u)
        dt_g, u_g, B_t, C_t = grp(dt), grp(u_t), tm(B), tm(C)
        keep_t = u.new_ones(L, batch) if keep is None else keep.t().contiguous()
        A2 = A.reshape(state[1:]) * LOG2_E
        pieces = sample_pieces(spans, L, T)  # chunks of T steps, cut at sample starts if any
        finals = u.new_zeros(0 if spans is None else len(spans[0]), *state[1:])
        # detached: this Function computes the gradients itself, and a start state that requires
        # grad (an initial state) would make dynamo compile every chunk function a second time
        h, starts, ys = h0.detach().reshape(state), [], []
        for s, e, enter, leave in pieces:
            if enter is not None:  # new samples begin in these rows, from their own states
                rows, ids = enter
                new = (
                    h.new_zeros(len(rows), *state[1:])
                    if h_samples is None
                    else h_samples.detach()[ids].reshape(-1, *state[1:])
                )
                h = h.index_copy(0, rows, new)
            starts.append(h)
            y, h = run(
                chunk_forward,
                _padded(dt_g[s:e], T),  # padded steps: Δ = 0
                _padded(u_g[s:e], T),
                A2,
                _padded(B_t[s:e], T),
                _padded(C_t[s:e], T),
                h,
                _padded(keep_t[s:e], T, 1.0),
            )
            ys.append(y[: e - s])
            if leave is not None:  # samples that end here: their final states
                rows, ids = leave
                finals[ids] = h[rows]
        ys = torch.cat(ys).reshape(L, batch, dim)  # C h, before D and z
        pre = ys if D is None else ys + u_t * D  # skip connection
        z_t = None if z is None else tm(z)
        out = pre if z is None else pre * F.silu(z_t)  # gate
        ctx.save_for_backward(u_t, dt_raw, A, D, z_t, pre, dt_g, u_g, B_t, C_t, keep_t, *starts)
        ctx.softplus, ctx.delta_bias = softplus, delta_bias is not None
        ctx.pieces, ctx.sample_states = pieces, h_samples is not None
        return (
            out.permute(1, 2, 0),
            h.reshape(batch, dim, dstate).clone(),
            finals.reshape(finals.shape[0], dim, dstate),
        )

    @staticmethod
    def backward(ctx, dout, dh_last, dfinals):
        u_t, dt_raw, A, D, z_t, pre, dt_g, u_g, B_t, C_t, keep_t, *starts = ctx.saved_tensors
        L, batch, dim = u_t.shape
        groups, dstate = B_t.shape[2], A.shape[1]
        state = (batch, groups, dim // groups, dstate)
        T = CHUNK
        dout = torch.zeros_like(u_t) if dout is None else dout.permute(2, 0, 1).contiguous()
        dz = None
        if z_t is not None:  # out = pre * silu(z)
            dz = torch.ops.aten.silu_backward(dout * pre, z_t)
            dout = dout * F.silu(z_t)
        dD = None if D is None else (dout * u_t).sum((0, 1))
        dy = dout.reshape(L, *state[:3])
        A2 = A.reshape(state[1:]) * LOG2_E
        carry = u_t.new_zeros(state) if dh_last is None else dh_last.reshape(state)
        d_samples = u_t.new_zeros(dfinals.shape[0], *state[1:]) if ctx.sample_states else None
        dA = torch.zeros_like(A2)
        parts = []
        for k in reversed(range(len(starts))):
            s, e, enter, leave = ctx.pieces[k]
            if leave is not None and dfinals is not None:  # a sample's final state is h_{e-1}
                rows, ids = leave
                carry = carry.index_add(0, rows, dfinals[ids].reshape(-1, *state[1:]))
            carry, dB, dC, ddt, du, dA_k = run(
                chunk_backward,
                _padded(dt_g[s:e], T),
                _padded(u_g[s:e], T),
                A2,
                _padded(B_t[s:e], T),
                _padded(C_t[s:e], T),
                starts[k],
                _padded(keep_t[s:e], T, 1.0),
                _padded(dy[s:e], T),
                carry,
            )
            dA = dA + dA_k
            parts.append(tuple(M[: e - s] for M in (dB, dC, ddt, du)))
            if enter is not None:  # a sample's initial state entered here, not the carried one
                rows, ids = enter
                if d_samples is not None:
                    d_samples[ids] = carry[rows]
                carry = carry.index_fill(0, rows, 0.0)
        dB, dC, ddt, du = (torch.cat(p[::-1]) for p in zip(*parts))
        ddt, du = ddt.reshape(L, batch, dim), du.reshape(L, batch, dim)
        if D is not None:
            du = du + dout * D
        if ctx.softplus:  # Δ = softplus(δ + bias)
            ddt = torch.ops.aten.softplus_backward(ddt, dt_raw, 1.0, 20.0)
        dbias = ddt.sum((0, 1)) if ctx.delta_bias else None
        t_last = lambda M: None if M is None else M.permute(*range(1, M.dim()), 0)  # noqa: E731
        return (
            t_last(du),
            t_last(ddt),
            dA.reshape(dim, dstate),
            t_last(dB),
            t_last(dC),
            dD,
            t_last(dz),
            dbias,
            carry.reshape(batch, dim, dstate),
            None,
            None,
            None,
            None if d_samples is None else d_samples.reshape(d_samples.shape[0], dim, dstate),
        )
