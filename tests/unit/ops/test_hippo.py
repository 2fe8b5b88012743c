"""HiPPO-LegS (ssmkit.ops.hippo): the matrices, S4's NPLR form, S4D's initialisations, the memory.

Oracles: the matrix formula written entry by entry; the dense matrix rebuilt from its structured
form; the eigenvalues of the normal part by a general eigensolver; the S4D paper's closed forms;
numpy's Legendre polynomials; the history of a smooth signal, read back from the state.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ssmkit import ops


def test_legs_is_the_formula_entry_by_entry():
    N = 7
    A, B = ops.legs(N)
    for n in range(N):
        assert B[n] == math.sqrt(2 * n + 1)
        for k in range(N):
            want = (
                -math.sqrt(2 * n + 1) * math.sqrt(2 * k + 1)
                if n > k
                else -(n + 1)
                if n == k
                else 0.0
            )
            assert math.isclose(float(A[n, k]), want, rel_tol=1e-15), (n, k)


@pytest.mark.parametrize("N", [1, 8, 64])
def test_nplr_form_rebuilds_the_dense_matrix(N):
    """A = V Λ V* - P Qᵀ (S4, section 3.3) to 1e-8, with V unitary, P = Q = √(n + ½) and every
    mode's real part -½ (the normal part is -I/2 plus a skew-symmetric matrix)."""
    A, _ = ops.legs(N)
    Lambda, V, P, Q = ops.legs_nplr(N)
    dense = ops.nplr_to_dense(Lambda, V, P, Q)
    assert float((dense - A).abs().max() / A.abs().max()) < 1e-8
    assert float(dense.imag.abs().max()) < 1e-8 * float(A.abs().max())
    eye = torch.eye(N, dtype=V.dtype)
    assert float((V.conj().T @ V - eye).abs().max()) < 1e-10
    assert torch.equal(P, Q) and torch.allclose(P**2, torch.arange(N, dtype=P.dtype) + 0.5)
    assert torch.allclose(Lambda.real, torch.full((N,), -0.5, dtype=torch.float64))


def test_s4d_inits_are_the_papers_closed_forms():
    N, n = 16, torch.arange(8, dtype=torch.float64)
    lin, inv = ops.s4d_init("lin", N), ops.s4d_init("inv", N, channels=3)
    assert lin.shape == (1, 8) and inv.shape == (3, 8)
    assert torch.allclose(lin[0], torch.complex(torch.full_like(n, -0.5), math.pi * n))
    want = N / math.pi * (N / (2 * n + 1) - 1)
    assert torch.allclose(inv, torch.complex(torch.full_like(n, -0.5), want).expand(3, -1))
    # S4D-LegS: the normal part's eigenvalues, by a general eigensolver on the dense matrix
    A, _ = ops.legs(N)
    P = torch.sqrt(torch.arange(N, dtype=torch.float64) + 0.5)
    eig = torch.linalg.eigvals(A + P[:, None] * P[None, :])
    upper = eig[eig.imag > 0]
    upper = upper[upper.imag.argsort()]
    legs = ops.s4d_init("legs", N)[0]
    assert float((legs - upper).abs().max() / upper.abs().max()) < 1e-8
    # S4D-Inv approximates S4D-LegS: the same frequencies (in reverse order) within 30%
    ratio = inv[0].imag.flip(-1) / legs.imag
    assert bool(((ratio > 0.7) & (ratio < 1.0)).all()), ratio


def test_random_init_is_stable_and_differs_per_channel():
    A = ops.s4d_init("random", 8, channels=4, generator=torch.Generator().manual_seed(0))
    assert A.shape == (4, 4) and bool((A.real < 0).all())
    assert not torch.equal(A[0], A[1])
    B = ops.s4d_init("random", 8, channels=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(A, B)


@pytest.mark.parametrize(
    "kind,N,message",
    [("hippo", 8, "init='hippo' is not an S4D initialisation"), ("lin", 7, "must be even")],
)
def test_bad_inits_name_what_is_valid(kind, N, message):
    with pytest.raises(ValueError, match=message):
        ops.s4d_init(kind, N)


def test_legendre_polynomials_equal_numpys():
    x = torch.linspace(-1, 1, 11, dtype=torch.float64)
    P = ops.legendre(6, x)
    for n in range(6):
        want = np.polynomial.legendre.legval(x.numpy(), [0] * n + [1])
        assert np.allclose(P[n].numpy(), want, rtol=0, atol=1e-13)


def _signal(L: int) -> torch.Tensor:
    s = torch.arange(L, dtype=torch.float64) / L
    return torch.sin(2 * math.pi * 1.5 * s) + 0.5 * torch.cos(2 * math.pi * 4 * s) + s


def test_legs_memory_reconstructs_a_smooth_history_better_with_more_state():
    """HiPPO's online function approximation: after L samples the state of size N holds the whole
    history; read back with the Legendre polynomials it matches the signal, the more closely the
    larger N."""
    L = 2000
    f = _signal(L)
    errors = {}
    for N in (4, 8, 16, 32):
        c = ops.legs_memory(f, N)
        assert c.shape == (L, N)
        errors[N] = float(((ops.legs_reconstruct(c[-1], L) - f) ** 2).mean().sqrt())
    assert errors[4] > errors[8] > errors[16] > errors[32], errors
    assert errors[32] < 5e-3 * float(f.abs().max()), errors


def test_legs_memory_holds_the_projection_of_the_history():
    """The state is HiPPO's coefficients c_n(t) = (1/t) ∫_0^t f(s) √(2n+1) P_n(2s/t - 1) ds, here
    by the midpoint rule over the samples, at two times."""
    L, N = 4000, 8
    f = _signal(L)
    c = ops.legs_memory(f, N)
    for t in (L // 2, L):
        s = (torch.arange(t, dtype=torch.float64) + 0.5) / t
        basis = ops.legendre(N, 2 * s - 1) * torch.sqrt(2 * torch.arange(N) + 1.0)[:, None]
        want = basis @ f[:t] / t
        assert float((c[t - 1] - want).abs().max()) < 2e-3, t
