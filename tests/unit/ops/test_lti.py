"""The linear time-invariant SSM (ssmkit.ops.lti): its kernel two ways, and the model run two ways.

Oracles: the kernel by powers of Ā (S4 equation (5)) against the Vandermonde product (S4D) and
against the dense SSM diagonalised; the FFT convolution against the recurrence, one step at a time;
the discretisations against the continuous solutions in closed form. float64, relative 1e-8.
"""

from __future__ import annotations

import math

import pytest
import torch

from ssmkit import ops

REL = 1e-8


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def conjugate_pairs(H=3, half=4, seed=0):
    """A real SSM as N = 2·half complex modes in conjugate pairs: (A, B, C) each (H, N), complex128,
    stable (Re A < 0), and the half kept by S4D."""
    g = torch.Generator().manual_seed(seed)
    randc = lambda: torch.complex(  # noqa: E731
        torch.randn(H, half, generator=g, dtype=torch.float64),
        torch.randn(H, half, generator=g, dtype=torch.float64),
    )
    A = torch.complex(
        -torch.rand(H, half, generator=g, dtype=torch.float64) - 0.1,
        3 * torch.randn(H, half, generator=g, dtype=torch.float64),
    )
    B, C = randc(), randc()
    full = [torch.cat([t, t.conj()], dim=-1) for t in (A, B, C)]
    return full, (A, B, C)


@pytest.mark.parametrize("method", ["zoh", "bilinear"])
def test_kernel_by_powers_vandermonde_fft_and_loop_agree(method):
    (A, B, C), (Ah, Bh, Ch) = conjugate_pairs()
    dt = torch.tensor([0.01, 0.1, 0.5], dtype=torch.float64)
    L = 37
    Ab, Bb = ops.discretize(A, B, dt, method)
    by_powers = ops.kernel_by_powers(Ab, Bb, C, L)  # (H, L), complex, imaginary ~0
    assert by_powers.imag.abs().max() < 1e-12 * by_powers.abs().max()
    K = by_powers.real
    assert rel(ops.kernel_vandermonde(Ab, Bb, C, L), by_powers) < REL
    Abh, Bbh = ops.discretize(Ah, Bh, dt, method)
    assert rel(2 * ops.kernel_vandermonde(Abh, Bbh, Ch, L).real, K) < REL  # the half, 2·Re
    u = torch.randn(2, 5, 3, L, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loop = ops.ssm_recurrent(Ab, Bb, C, u)
    assert loop.imag.abs().max() < 1e-12 * loop.abs().max()
    conv = ops.ssm_convolve(K, u)
    assert rel(conv, loop.real) < REL
    naive = torch.stack(  # y_t = Σ_{s<=t} K_{t-s} u_s, written out
        [(K.flip(-1)[:, L - 1 - t :] * u[..., : t + 1]).sum(-1) for t in range(L)], dim=-1
    )
    assert rel(conv, naive) < REL


@pytest.mark.parametrize("method", ["zoh", "bilinear"])
def test_dense_ssm_equals_its_diagonalisation(method):
    """A dense real A, discretised and unrolled, against the same SSM in A's eigenbasis (A = VΛV⁻¹,
    B' = V⁻¹B, C' = CV): discretising commutes with the change of basis, so the kernels agree."""
    g = torch.Generator().manual_seed(2)
    N = 5
    A = torch.randn(N, N, generator=g, dtype=torch.float64) - 3 * torch.eye(N, dtype=torch.float64)
    B, C = torch.randn(2, N, generator=g, dtype=torch.float64)
    Ab, Bb = ops.discretize(A, B, 0.2, method)
    K = ops.kernel_by_powers(Ab, Bb, C, 25)
    lam, V = torch.linalg.eig(A)
    Bd, Cd = torch.linalg.solve(V, B.to(V.dtype)), C.to(V.dtype) @ V
    Abd, Bbd = ops.discretize(lam, Bd, 0.2, method)
    assert rel(ops.kernel_vandermonde(Abd, Bbd, Cd, 25).real, K) < REL
    u = torch.randn(3, 25, generator=g, dtype=torch.float64)
    assert rel(ops.ssm_convolve(K, u), ops.ssm_recurrent(Ab, Bb, C, u)) < REL


def test_discretisations_are_the_papers_formulas():
    g = torch.Generator().manual_seed(3)
    N, dt = 4, 0.3
    A = torch.randn(N, N, generator=g, dtype=torch.float64) - 2 * torch.eye(N, dtype=torch.float64)
    B = torch.randn(N, generator=g, dtype=torch.float64)
    eye = torch.eye(N, dtype=torch.float64)
    Ab, Bb = ops.discretize(A, B, dt, "bilinear")  # S4 equation (3)
    left = torch.linalg.inv(eye - dt / 2 * A)
    assert rel(Ab, left @ (eye + dt / 2 * A)) < REL and rel(Bb, left @ (dt * B)) < REL
    Ab, Bb = ops.discretize(A, B, dt, "zoh")  # exp(ΔA), (ΔA)⁻¹(exp(ΔA) - I)ΔB
    E = torch.linalg.matrix_exp(dt * A)
    assert rel(Ab, E) < REL
    assert rel(Bb, torch.linalg.solve(dt * A, (E - eye) @ (dt * B))) < REL
    with pytest.raises(ValueError, match="method='euler' is not supported; valid: zoh, bilinear"):
        ops.discretize(A, B, dt, "euler")
    with pytest.raises(ValueError, match=r"A must be \(..., N, N\) \(dense\) or \(..., N\)"):
        ops.discretize(A[:, :3], B, dt)


def _step_response(A, B, C, t):
    """y(t) = C A⁻¹ (exp(At) - I) B: the continuous output for u = 1 from t = 0, x(0) = 0."""
    eye = torch.eye(A.shape[0], dtype=A.dtype)
    return torch.stack(
        [C @ torch.linalg.solve(A, (torch.linalg.matrix_exp(A * s) - eye) @ B) for s in t]
    )


def test_zoh_is_exact_for_held_inputs_and_bilinear_converges():
    """A constant input is held exactly by ZOH: its outputs are the continuous ones at every step
    size. The bilinear rule's error shrinks as Δ² (x10 less Δ: x100 less error) and is large at a
    large step, where the two differ."""
    g = torch.Generator().manual_seed(4)
    N = 4
    A = torch.randn(N, N, generator=g, dtype=torch.float64) - 3 * torch.eye(N, dtype=torch.float64)
    B, C = torch.randn(2, N, generator=g, dtype=torch.float64)
    errors = {}
    for dt in (1.0, 0.1, 0.01):
        L = round(2.0 / dt)
        t = dt * torch.arange(1, L + 1, dtype=torch.float64)
        exact = _step_response(A, B, C, t)  # x_k is the state at (k+1)Δ
        for method in ("zoh", "bilinear"):
            y = ops.ssm_recurrent(
                *ops.discretize(A, B, dt, method), C, torch.ones(L, dtype=A.dtype)
            )
            errors[method, dt] = rel(y, exact)
    assert max(errors["zoh", dt] for dt in (1.0, 0.1, 0.01)) < REL
    assert errors["bilinear", 0.01] < errors["bilinear", 0.1] / 50
    assert errors["bilinear", 1.0] > 1e-2


def test_both_discretisations_approach_the_continuous_solution_of_a_smooth_input():
    """x' = a x + b sin(ωt), x(0) = 0 has x(t) = b (ω e^{at} - a sin ωt - ω cos ωt) / (a² + ω²); the
    discrete SSMs (inputs sampled mid-step) converge to it as Δ -> 0 and differ at a large Δ."""
    a = torch.tensor([-0.5, -2.0, -6.0], dtype=torch.float64)[:, None]  # three channels, N = 1
    b, c, w, T = torch.ones_like(a), torch.ones_like(a), 3.0, 4.0
    err, outputs = {}, {}
    for dt in (0.4, 0.04, 0.004):
        L = round(T / dt)
        t = dt * torch.arange(1, L + 1, dtype=torch.float64)
        exact = (w * torch.exp(a * t) - a * torch.sin(w * t) - w * torch.cos(w * t)) / (a**2 + w**2)
        u = torch.sin(w * (t - dt / 2)).expand(3, L)
        for method in ("zoh", "bilinear"):
            y = ops.ssm_recurrent(*ops.discretize(a, b, dt, method), c, u)
            err[method, dt], outputs[method, dt] = rel(y, exact), y
    for method in ("zoh", "bilinear"):
        # second order with mid-step samples: x10 less Δ, x100 less error (50 allowed)
        assert err[method, 0.004] < err[method, 0.04] / 50 < err[method, 0.4] / 2500
        assert err[method, 0.004] < 2e-5
    assert rel(outputs["zoh", 0.4], outputs["bilinear", 0.4]) > 1e-2


def test_state_after_and_state_response_carry_a_state_across_a_convolution():
    (A, B, C), _ = conjugate_pairs(H=2, half=3, seed=5)
    Ab, Bb = ops.discretize(A, B, torch.tensor([0.1, 0.3], dtype=torch.float64))
    g = torch.Generator().manual_seed(6)
    u = torch.randn(4, 2, 30, generator=g, dtype=torch.float64)
    x0 = torch.randn(4, 2, 6, generator=g, dtype=torch.complex128)
    y, x = ops.ssm_recurrent(Ab, Bb, C, u, x0=x0, return_state=True)
    assert rel(ops.state_after(Ab, Bb, u, x0), x) < REL
    assert (
        rel(ops.state_after(Ab, Bb, u), ops.ssm_recurrent(Ab, Bb, C, u, return_state=True)[1]) < REL
    )
    free = ops.ssm_recurrent(Ab, Bb, C, torch.zeros_like(u), x0=x0)
    assert rel(ops.state_response(Ab, C, x0, 30), free) < REL
    # a sequence in two pieces: the second continues from the state the first left
    K = ops.kernel_by_powers(Ab, Bb, C, 30).real
    first, x = ops.ssm_convolve(K, u[..., :11]), ops.state_after(Ab, Bb, u[..., :11])
    second = ops.ssm_convolve(K, u[..., 11:]) + ops.state_response(Ab, C, x, 19).real
    assert rel(torch.cat([first, second], -1), ops.ssm_convolve(K, u)) < REL


def test_gradients_of_the_convolution_equal_those_of_the_recurrence():
    """The second path for the backward pass: d(loss)/d(A, B, C, u) through the Vandermonde kernel
    and the FFT against autograd through the loop."""
    _, (A, B, C) = conjugate_pairs(H=2, half=3, seed=7)
    u = torch.randn(2, 2, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    w = torch.randn_like(u)
    grads = []
    for path in ("conv", "loop"):
        leaves = [t.clone().requires_grad_() for t in (A, B, C, u)]
        a, b, c, x = leaves
        Ab, Bb = ops.discretize(a, b, 0.2)
        if path == "conv":
            y = ops.ssm_convolve(2 * ops.kernel_vandermonde(Ab, Bb, c, 20).real, x)
        else:
            y = 2 * ops.ssm_recurrent(Ab, Bb, c, x).real
        (y * w).sum().backward()
        grads.append([t.grad for t in leaves])
    for conv, loop in zip(*grads):
        assert rel(conv, loop) < REL


def test_packed_samples_are_convolved_alone():
    g = torch.Generator().manual_seed(9)
    K = torch.randn(3, 12, generator=g, dtype=torch.float64)
    u = torch.randn(2, 4, 3, 12, generator=g, dtype=torch.float64)  # (batch, extra, H, L)
    seq_idx = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 12])
    y = ops.ssm_convolve(K, u, seq_idx=seq_idx)
    for row, cuts in ((0, [(0, 5), (5, 9), (9, 12)]), (1, [(0, 12)])):
        for lo, hi in cuts:
            assert rel(y[row, ..., lo:hi], ops.ssm_convolve(K, u[row, ..., lo:hi])) < REL
    assert rel(ops.ssm_convolve(K, u), y) > 1e-3  # the control: unpacked, samples leak
    with pytest.raises(ValueError, match="fewer than the 12 inputs"):
        ops.ssm_convolve(K[:, :5], u)


def test_the_shift_ssm_is_a_convolution_with_its_C():
    A, B = ops.shift_ssm(4)
    C = torch.tensor([0.5, -1.0, 2.0, 3.0], dtype=torch.float64)
    K = ops.kernel_by_powers(A, B, C, 7)
    assert torch.equal(K, torch.cat([C, torch.zeros(3, dtype=torch.float64)]))
    u = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    y, x = ops.ssm_recurrent(A, B, C, u, return_state=True)
    assert torch.equal(x, u.flip(-1)[:4])  # the state: the last 4 inputs, newest first
    assert rel(ops.ssm_convolve(K, u), y) < REL


def test_vandermonde_is_the_powers():
    Ab = torch.tensor([0.9, -0.5, 0.3 + 0.4j, 1e-3], dtype=torch.complex128)
    V = ops.vandermonde(Ab, 6)
    assert rel(V, torch.stack([Ab**k for k in range(6)], -1)) < REL
    real = ops.vandermonde(torch.tensor([-0.5, 0.25], dtype=torch.float64), 5)
    assert (
        rel(
            real.real,
            torch.tensor(
                [[(-0.5) ** k for k in range(5)], [0.25**k for k in range(5)]], dtype=torch.float64
            ),
        )
        < REL
    )
    assert math.isclose(float(real.imag.abs().max()), 0.0, abs_tol=1e-12)
