r"""The linear time-invariant (LTI) state space model of S4 and S4D: discretisation, the convolution
kernel computed two ways, and the model run two equal ways (a recurrence, an FFT convolution).

S4 ("Efficiently Modeling Long Sequences with Structured State Spaces", Gu, Goel & Ré 2021, arXiv
2111.00396), equation (1): a continuous-time SSM maps an input u(t) to an output y(t) through a
state x(t) of size N,

$$ x'(t) = A x(t) + B u(t), \qquad y(t) = C x(t) + D u(t). $$

Discretised with a step Δ (S4 equation (3); :func:`discretize`) it becomes a recurrence,

$$ x_k = \bar A x_{k-1} + \bar B u_k, \qquad y_k = C x_k + D u_k, $$

and, unrolled from x_{-1} = 0 (S4 equations (4)-(5)), a convolution with the SSM kernel

$$ y = \bar K * u + D u, \qquad \bar K = (C\bar B,\ C\bar A\bar B,\ \dots,\ C\bar A^{L-1}\bar B). $$

:func:`kernel_by_powers` builds K̄ by multiplying Ā in L times; for a diagonal Ā (S4D, "On the
Parameterization and Initialization of Diagonal State Space Models", Gu, Gupta, Goel & Ré 2022,
arXiv 2206.11893, section 3) :func:`kernel_vandermonde` gets it in one product with the Vandermonde
matrix of Ā's entries. :func:`ssm_recurrent` runs the recurrence (one step: :func:`ssm_step`) and
:func:`ssm_convolve` the convolution by FFT: the same outputs (tests/unit/ops/test_lti.py). The D u
skip is left to the caller in both.

Shapes: H independent SSMs (channels), each with its own Ā, B̄, C: dense Ā (H, N, N) or diagonal Ā
(H, N) (the diagonal's entries), B̄ and C (H, N); u (*batch, H, L). Any leading dims of the
parameters broadcast, so one SSM is (N, N) / (N,) with u (*batch, L). A diagonal Ā is complex in
S4D; a real SSM whose complex modes come in conjugate pairs keeps one mode of each pair, and its
kernel and outputs are 2·Re of what these functions return for that half
(:class:`ssmkit.models.s4d.DiagonalSSM`).

Glossary (code -> paper): ``A``, ``B``, ``C`` = A, B, C; ``dt`` = Δ; ``Ab``, ``Bb`` = Ā, B̄ (the
discrete parameters); ``K`` = K̄, the SSM kernel; ``x`` = the state x; ``u``, ``y`` = input and
output; N = state size, L = sequence length, H = channels.
"""

from __future__ import annotations

import torch

from .packing import check_seq_idx, positions_in_sample

METHODS = ("zoh", "bilinear")


def _is_dense(A: torch.Tensor, B: torch.Tensor) -> bool:
    """Whether A is a matrix (..., N, N) beside B (..., N), or the diagonal (..., N) of one."""
    N = B.shape[-1]
    if A.dim() == B.dim() + 1 and A.shape[-2:] == (N, N):
        return True
    if A.shape[-1] == N and A.dim() == B.dim():
        return False
    raise ValueError(
        f"A must be (..., N, N) (dense) or (..., N) (diagonal) beside B (..., N); got A "
        f"{tuple(A.shape)}, B {tuple(B.shape)}"
    )


def discretize(A: torch.Tensor, B: torch.Tensor, dt, method: str = "zoh"):
    r"""(Ā, B̄): the continuous (A, B) discretised with step Δ = ``dt``.

    A: (..., N, N) dense, or (..., N) the entries of a diagonal A; B: (..., N); dt: a number, or a
    tensor of A's batch shape (...) (one Δ per SSM). Returns Ā of A's shape and B̄ (..., N). Work
    in float64 or complex for exact identities.

    * ``"bilinear"`` (S4 equation (3), Tustin's method):
      Ā = (I - Δ/2·A)⁻¹ (I + Δ/2·A),  B̄ = (I - Δ/2·A)⁻¹ Δ B;
    * ``"zoh"`` (zero-order hold: u held constant over each step, exact for such inputs):
      Ā = exp(ΔA),  B̄ = (ΔA)⁻¹ (exp(ΔA) - I) Δ B, for a diagonal A entrywise
      (exp(ΔA) - 1) / A · B (S4D's ZOH). For a dense A the exponential of the block matrix
      [[ΔA, ΔB], [0, 0]] holds both, [[Ā, B̄], [0, 1]] (Van Loan 1978), which needs no inverse.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not supported; valid: {', '.join(METHODS)}")
    dense = _is_dense(A, B)
    real = A.real.dtype if A.is_complex() else A.dtype
    dt = torch.as_tensor(dt, dtype=real, device=A.device)
    N = B.shape[-1]
    if not dense:
        dtA = dt[..., None] * A
        if method == "bilinear":
            return (1 + dtA / 2) / (1 - dtA / 2), dt[..., None] * B / (1 - dtA / 2)
        Ab = torch.exp(dtA)
        return Ab, (Ab - 1) / A * B
    eye = torch.eye(N, dtype=A.dtype, device=A.device)
    dtA = dt[..., None, None] * A
    if method == "bilinear":
        left = eye - dtA / 2
        Ab = torch.linalg.solve(left, eye + dtA / 2)
        return Ab, torch.linalg.solve(left, (dt[..., None] * B)[..., None])[..., 0]
    dtB = (dt[..., None] * B).to(dtA.dtype)
    shape = torch.broadcast_shapes(dtA.shape[:-2], dtB.shape[:-1])
    M = torch.zeros(*shape, N + 1, N + 1, dtype=dtA.dtype, device=A.device)
    M[..., :N, :N] = dtA
    M[..., :N, N] = dtB
    E = torch.linalg.matrix_exp(M)
    return E[..., :N, :N], E[..., :N, N]


def shift_ssm(N: int, dtype=torch.float64, device=None):
    """(Ā, B̄) of the shift SSM (H3, Fu et al. 2022, section 3.1): Ā (N, N) shifts the state down by
    one (ones below the diagonal), B̄ = e₁ (N,) writes the input into its first entry. The state
    holds the last N inputs, so its kernel is C itself, (C₀, ..., C_{N-1}, 0, 0, ...): a causal
    convolution of N learned taps (:func:`kernel_by_powers` of it equals C)."""
    A = torch.diag(torch.ones(N - 1, dtype=dtype, device=device), -1)
    B = torch.zeros(N, dtype=dtype, device=device)
    B[0] = 1
    return A, B


def kernel_by_powers(Ab: torch.Tensor, Bb: torch.Tensor, C: torch.Tensor, L: int) -> torch.Tensor:
    """K̄ = (C B̄, C Ā B̄, ..., C Ā^{L-1} B̄) (S4 equation (5)) by applying Ā L times to B̄.

    Ab: (..., N, N) dense or (..., N) diagonal; Bb, C: (..., N). Returns (..., L)."""
    dense = _is_dense(Ab, Bb)
    v, out = Bb, []
    for _ in range(L):
        out.append((C * v).sum(-1))
        v = (Ab @ v[..., None])[..., 0] if dense else Ab * v  # Ā^{l+1} B̄
    return torch.stack(out, dim=-1)


def vandermonde(Ab: torch.Tensor, L: int) -> torch.Tensor:
    """The Vandermonde matrix of a diagonal Ā: V[..., n, l] = Ā_n^l, l = 0..L-1, as exp(l · log Ā)
    (S4D's "log-Vandermonde"; complex, so a negative real Ā_n has its logarithm). Ab: (..., N) ->
    (..., N, L)."""
    if not Ab.is_complex():
        Ab = Ab.to(torch.complex128 if Ab.dtype == torch.float64 else torch.complex64)
    ell = torch.arange(L, device=Ab.device, dtype=Ab.real.dtype)
    return torch.exp(torch.log(Ab)[..., None] * ell)


def kernel_vandermonde(Ab: torch.Tensor, Bb: torch.Tensor, C: torch.Tensor, L: int) -> torch.Tensor:
    """K̄ for a diagonal Ā in one product (S4D section 3): K̄_l = Σ_n C_n B̄_n Ā_n^l, i.e. the row
    (C ∘ B̄) times the Vandermonde matrix of Ā. Ab, Bb, C: (..., N) -> (..., L), complex (take the
    real part of a real SSM's)."""
    V = vandermonde(Ab, L)
    return torch.einsum("...n,...nl->...l", (C * Bb).to(V.dtype), V)


def ssm_step(Ab, Bb, C, x, u):
    """One step of the recurrence: x' = Ā x + B̄ u, y = C x' (S4 equation (3); D u left out).

    Ab: (H, N, N) dense or (H, N) diagonal; Bb, C: (H, N); x: (*batch, H, N); u: (*batch, H).
    Returns (y (*batch, H), x' (*batch, H, N))."""
    Bu = Bb * u[..., None]
    x = (Ab @ x[..., None])[..., 0] + Bu if _is_dense(Ab, Bb) else Ab * x + Bu
    return (C * x).sum(-1), x


def ssm_recurrent(Ab, Bb, C, u, x0=None, return_state: bool = False):
    """The SSM as its recurrence, one step at a time (:func:`ssm_step`), from x0 (zeros if None).

    Ab: (H, N, N) dense or (H, N) diagonal; Bb, C: (H, N); u: (*batch, H, L); x0: (*batch, H, N).
    Returns y (*batch, H, L) (complex if the parameters are), and the last state with
    ``return_state``."""
    if x0 is None:
        dtype = torch.promote_types(torch.promote_types(Ab.dtype, Bb.dtype), u.dtype)
        x0 = torch.zeros(*u.shape[:-1], Bb.shape[-1], dtype=dtype, device=u.device)
    x, ys = x0, []
    for t in range(u.shape[-1]):
        y, x = ssm_step(Ab, Bb, C, x, u[..., t])
        ys.append(y)
    y = torch.stack(ys, dim=-1)
    return (y, x) if return_state else y


def state_after(Ab, Bb, u, x0=None):
    """The state after L inputs for a diagonal Ā, without the loop: with x_{-1} = x0,

        x_{L-1} = Ā^L x0 + Σ_s Ā^{L-1-s} B̄ u_s

    (the Vandermonde matrix again, read backwards: what a prefill leaves for generation). Ab, Bb:
    (H, N); u: (*batch, H, L); x0: (*batch, H, N) or None. Returns (*batch, H, N), complex."""
    L = u.shape[-1]
    V = vandermonde(Ab, L + 1)  # Ā^0 .. Ā^L
    x = torch.einsum("...hl,hnl->...hn", u.flip(-1).to(V.dtype), V[..., :L]) * Bb.to(V.dtype)
    return x if x0 is None else x + V[..., L] * x0.to(V.dtype)


def state_response(Ab, C, x0, L: int):
    """The outputs an initial state gives for a diagonal Ā when the inputs are zero:
    y_t = C Ā^{t+1} x0, t = 0..L-1 (what continuing from a cache adds to the convolution).
    Ab, C: (H, N); x0: (*batch, H, N). Returns (*batch, H, L), complex."""
    V = vandermonde(Ab, L + 1)[..., 1:]  # Ā^1 .. Ā^L
    return torch.einsum("...hn,hnl->...hl", x0.to(V.dtype) * C.to(V.dtype), V)


def ssm_convolve(K: torch.Tensor, u: torch.Tensor, seq_idx: torch.Tensor | None = None):
    """y = K̄ * u, the causal convolution y_t = Σ_{s<=t} K̄_{t-s} u_s (S4 equation (5)), by FFT.

    K: (..., H, L') real with L' >= L (broadcast against u's channels); u: (*batch, H, L) real.
    Returns (*batch, H, L). Both are zero padded to length 2L before the FFT: the product of FFTs
    is a circular convolution, and 2L leaves room for every K̄_{t-s} u_s of the linear one, so
    nothing wraps around from the end onto the start (O(L log L) instead of O(L²)).

    seq_idx: (batch, L), the sample each position of a packed row belongs to
    (:mod:`ssmkit.ops.packing`; u then (batch, ..., L)): each sample is convolved on its own, as
    if it ran alone (y_t sums only the s of t's sample)."""
    L = u.shape[-1]
    if K.shape[-1] < L:
        raise ValueError(f"the kernel has {K.shape[-1]} taps, fewer than the {L} inputs")
    if seq_idx is not None:
        return _convolve_packed(K[..., :L], u, seq_idx)
    n = 2 * L
    y = torch.fft.irfft(torch.fft.rfft(K[..., :L], n=n) * torch.fft.rfft(u, n=n), n=n)
    return y[..., :L]


def _convolve_packed(K, u, seq_idx):
    """:func:`ssm_convolve` of packed rows: every sample moved to a row of its own (zeros after its
    end, which a causal convolution never reads), convolved at once, and moved back."""
    batch, L = u.shape[0], u.shape[-1]
    check_seq_idx(seq_idx, batch, L)
    pos = positions_in_sample(seq_idx).reshape(-1)  # (batch·L,) offset within its sample
    sample = (pos == 0).long().cumsum(0) - 1  # (batch·L,) which sample, counted over all rows
    rest = u.shape[1:-1]
    flat = u.movedim(-1, 1).reshape(batch * L, *rest)  # one row per position
    rows = u.new_zeros(int(sample[-1]) + 1, int(pos.max()) + 1, *rest)
    rows[sample, pos] = flat
    y = ssm_convolve(K, rows.movedim(1, -1)).movedim(-1, 1)  # (samples, longest, *rest)
    return y[sample, pos].reshape(batch, L, *rest).movedim(1, -1)


__all__ = [
    "METHODS",
    "discretize",
    "kernel_by_powers",
    "kernel_vandermonde",
    "shift_ssm",
    "ssm_convolve",
    "ssm_recurrent",
    "ssm_step",
    "state_after",
    "state_response",
    "vandermonde",
]
