r"""HiPPO-LegS: its matrices, S4's normal-plus-low-rank form, S4D's diagonal initialisations, and
the online memory they define (a signal's history reconstructed from the state).

HiPPO ("Recurrent Memory with Optimal Polynomial Projections", Gu, Dao, Ermon, Rudra & Ré 2020,
arXiv 2008.07069) keeps, at every time t, the coefficients c(t) of the input's history f on [0, t]
in the Legendre polynomials scaled to that interval (LegS). They follow the ODE

$$ c'(t) = \tfrac{1}{t} \left( A\,c(t) + B\,f(t) \right), $$

$$ A_{nk} = -\begin{cases} \sqrt{2n+1}\sqrt{2k+1} & n > k \\ n + 1 & n = k \\ 0 & n < k
   \end{cases}, \qquad B_n = \sqrt{2n+1} $$

(S4, Gu, Goel & Ré 2021, arXiv 2111.00396, equation (2), the HiPPO matrix S4 initialises A with:
:func:`legs`). S4 (section 3.3, Theorem 1) writes it as normal plus low rank (NPLR):
A = V Λ V* - P Qᵀ, with P = Q = (√(n + 1/2))_n: A + P Pᵀ = -I/2 + S, S skew-symmetric, so it is
normal and V (unitary) diagonalises it (:func:`legs_nplr`, :func:`nplr_to_dense`).

S4D (Gu, Gupta, Goel & Ré 2022, arXiv 2206.11893, section 4) drops the low-rank term: A = Λ, N/2
complex modes (one of each conjugate pair) standing for a real state of size N
(:func:`s4d_init`): S4D-LegS (Λ of the normal part above), S4D-Inv and S4D-Lin (closed forms
approximating it), and, as an ablation, random.

:func:`legs_memory` runs the LegS ODE over a sampled signal (bilinear steps, Δ/t = 1/k at step k)
and :func:`legs_reconstruct` reads the history back from the state: the figure of HiPPO's online
function approximation.

Glossary (code -> paper): ``A``, ``B`` = A, B (HiPPO-LegS); ``Lambda`` = Λ, ``V`` = V,
``P``, ``Q`` = P, Q (S4's NPLR form); ``c`` = the coefficients c(t) (HiPPO's state); N = the state
size (``d_state``); n, k = indices of the state.
"""

from __future__ import annotations

import math

import torch

S4D_INITS = ("legs", "lin", "inv", "random")


def legs(N: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """HiPPO-LegS's (A (N, N), B (N,)), the formula of the module docstring (S4 equation (2))."""
    q = torch.arange(N, dtype=dtype)
    r = torch.sqrt(2 * q + 1)
    A = -torch.tril(r[:, None] * r[None, :], diagonal=-1) - torch.diag(q + 1)
    return A, r.clone()


def legs_nplr(N: int, dtype=torch.float64):
    """S4's normal plus low rank form of HiPPO-LegS: (Λ (N,), V (N, N), P (N,), Q (N,)) with

        A = V diag(Λ) V* - P Qᵀ,   P = Q = √(n + 1/2),

    V unitary. A + P Pᵀ = -I/2 + S with S skew-symmetric; i·S is Hermitian, so its eigenvalues μ
    are real and ``torch.linalg.eigh`` gives them with an exactly unitary V: Λ = -1/2 - i·μ (real
    part -1/2 for every mode). The modes come in conjugate pairs (S is real), sorted by μ."""
    A, _ = legs(N, dtype)
    P = torch.sqrt(torch.arange(N, dtype=dtype) + 0.5)
    S = A + P[:, None] * P[None, :] + 0.5 * torch.eye(N, dtype=dtype)
    cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    mu, V = torch.linalg.eigh(1j * S.to(cdtype))
    return -0.5 - 1j * mu.to(cdtype), V, P, P.clone()


def nplr_to_dense(Lambda, V, P, Q) -> torch.Tensor:
    """V diag(Λ) V* - P Qᵀ: the dense matrix of an NPLR form (complex, imaginary part ~0 for
    HiPPO-LegS's)."""
    normal = (V * Lambda[None, :]) @ V.conj().T
    return normal - (P[:, None] * Q[None, :]).to(normal.dtype)


def s4d_init(
    kind: str, N: int, channels: int = 1, generator: torch.Generator | None = None
) -> torch.Tensor:
    """S4D's diagonal A (S4D section 4): (channels, N/2) complex128, one mode of each conjugate
    pair of a real state of size N (even), n = 0 .. N/2 - 1:

    * ``"legs"``: S4D-LegS, the eigenvalues Λ of HiPPO-LegS's normal part (:func:`legs_nplr`)
      with positive imaginary part, sorted by it: -1/2 + i·ω_n;
    * ``"inv"``: S4D-Inv, -1/2 + i·(N/π)·(N/(2n+1) - 1), a closed form close to S4D-LegS;
    * ``"lin"``: S4D-Lin, -1/2 + i·π·n (frequencies evenly spaced, as Fourier's);
    * ``"random"``: the ablation, A not from HiPPO: -exp(N(0, 1)) + i·N(0, 1), each channel its
      own (state-spaces' ``hippo.nplr("random")``), stable as the real part is negative.

    The others are the same for every channel."""
    if kind not in S4D_INITS:
        raise ValueError(f"init={kind!r} is not an S4D initialisation; valid: {S4D_INITS}")
    if N < 2 or N % 2:
        raise ValueError(
            f"d_state must be even and >= 2 (N/2 complex modes for N real dimensions); got {N}"
        )
    n = torch.arange(N // 2, dtype=torch.float64)
    if kind == "random":
        real = -torch.exp(torch.randn(channels, N // 2, dtype=torch.float64, generator=generator))
        imag = torch.randn(channels, N // 2, dtype=torch.float64, generator=generator)
        return torch.complex(real, imag)
    if kind == "legs":
        Lambda = legs_nplr(N)[0]
        imag = Lambda.imag[Lambda.imag > 0].sort().values
    elif kind == "inv":
        imag = N / math.pi * (N / (2 * n + 1) - 1)
    else:
        imag = math.pi * n
    return torch.complex(torch.full_like(imag, -0.5), imag).expand(channels, -1).clone()


def legendre(n_max: int, x: torch.Tensor) -> torch.Tensor:
    """Legendre polynomials P_0 .. P_{n_max-1} at x (any shape) -> (n_max, *x.shape), by Bonnet's
    recurrence (n+1) P_{n+1} = (2n+1) x P_n - n P_{n-1}."""
    out = [torch.ones_like(x), x]
    for n in range(1, n_max - 1):
        out.append(((2 * n + 1) * x * out[n] - n * out[n - 1]) / (n + 1))
    return torch.stack(out[:n_max])


def legs_memory(f: torch.Tensor, N: int) -> torch.Tensor:
    """HiPPO-LegS's state after every sample of f: f (..., L) -> c (..., L, N), c[..., k, :] the
    Legendre coefficients of f_0..f_k (float64).

    Sample k (k = 1..L) is time t = k; the ODE c' = (A c + B f) / t, discretised bilinearly with
    A/k and B/k (HiPPO's LegS discretisation; S4 equation (3) with Δ A = A/k):
    c_k = (I - A/2k)⁻¹ ((I + A/2k) c_{k-1} + B f_k / k)."""
    f = f.double()
    L = f.shape[-1]
    A, B = legs(N)
    k = torch.arange(1, L + 1, dtype=torch.float64)
    eye = torch.eye(N, dtype=torch.float64)
    left = eye - A / (2 * k[:, None, None])  # (L, N, N)
    Ab = torch.linalg.solve(left, eye + A / (2 * k[:, None, None]))
    Bb = torch.linalg.solve(left, (B / k[:, None])[..., None])[..., 0]  # (L, N)
    c, out = f.new_zeros(*f.shape[:-1], N), []
    for i in range(L):
        c = (Ab[i] @ c[..., None])[..., 0] + Bb[i] * f[..., i, None]
        out.append(c)
    return torch.stack(out, dim=-2)


def legs_reconstruct(c: torch.Tensor, points: int) -> torch.Tensor:
    """The history a LegS state c (..., N) holds, at ``points`` evenly spaced instants of it (the
    midpoints of ``points`` equal pieces of [0, t], oldest first): f(s) ≈ Σ_n c_n √(2n+1) P_n(2s/t -
    1) (HiPPO's scaled Legendre basis, orthonormal on [0, t]). Returns (..., points)."""
    N = c.shape[-1]
    s = (torch.arange(points, dtype=c.dtype) + 0.5) / points  # s / t in (0, 1)
    basis = legendre(N, 2 * s - 1) * torch.sqrt(2 * torch.arange(N, dtype=c.dtype) + 1)[:, None]
    return c @ basis


__all__ = [
    "S4D_INITS",
    "legendre",
    "legs",
    "legs_memory",
    "legs_nplr",
    "legs_reconstruct",
    "nplr_to_dense",
    "s4d_init",
]
