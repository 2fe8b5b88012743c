r"""The S4D mixer (Gu, Gupta, Goel & Ré 2022, arXiv 2206.11893): H independent diagonal SSMs, each
run as one long convolution, between a linear projection in and a GLU out.

Every channel h is a linear time-invariant SSM (:mod:`ssmkit.ops.lti`) with a diagonal A of N/2
complex modes. Kept with its conjugate, each mode stands for two real state dimensions, so the
kernel of the real SSM of state size N is twice the real part of the half's (S4D section 3):

$$ \bar K_l = 2\,\mathrm{Re} \sum_{n < N/2} C_n \bar B_n \bar A_n^l, \qquad
   y = \mathrm{GLU}(W_{out}\, \mathrm{GELU}(\bar K * u + D u)), \quad u = W_{in} x. $$

Parameter names, shapes and initialisation follow state-spaces' standalone ``models/s4/s4d.py``
(its ``S4DKernel`` is :class:`DiagonalSSM` here, which :mod:`ssmkit.models.h3` uses too), with
ssmkit's projections around it so that the layer maps d_model to d_model like every mixer:

    in_proj         (H, d_model)      u = in_proj(x): H = expand · d_model channels (ssmkit's)
    ssm.log_dt      (H,)              Δ = exp(log_dt), log-uniform in [dt_min, dt_max]     fp32
    ssm.log_A_real  (H, N/2)          Re A = -exp(log_A_real) < 0: every mode decays       fp32
    ssm.A_imag      (H, N/2)          Im A; A's init by ``init`` (ssmkit.ops.s4d_init)     fp32
    ssm.C           (H, N/2, 2)       C as (re, im), each N(0, 1/2); B = 1 (C absorbs it)  fp32
    D               (H,)              the skip D u, N(0, 1)                                fp32
    out_proj        (2 · d_model, H)  then a GLU (s4d.py's ``output_linear``: 1x1 conv + GLU)

A is rebuilt from log_A_real and A_imag, so its real part stays negative whatever training does.
S4D trains A, Δ at a lower learning rate (0.001) in its recipes; ssmkit's optimizer exempts them
from weight decay only (:mod:`ssmkit.train.optim`).

Two modes, equal (tests/unit/models/test_s4d.py): :meth:`S4D.forward`, the FFT convolution (training
and prefill; with a state it continues from it and leaves the next one), and :meth:`S4D.step`, one
token of the recurrence x = Āx + B̄u, y = 2 Re(Cx) (generation, O(1) per token).

Glossary (code -> paper): ``u`` = u, the SSM's input; H = ``channels``; N = ``d_state`` (real), N/2
complex modes; ``log_dt`` = log Δ; ``Ab``, ``Bb`` = Ā, B̄; ``K`` = K̄, the SSM kernel; ``state`` =
x (complex, N/2 per channel); ``disc`` = the discretisation (ZOH, bilinear).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from .cache import LTIState
from .mixer_parts import KeepsFp32, check_packed, zero_padding
from .ssm_config import S4DConfig


class DiagonalSSM(KeepsFp32, nn.Module):
    """H diagonal SSMs of N/2 complex modes: their parameters, kernel and steps (s4d.py's
    ``S4DKernel``). Works in fp32 / complex64 whatever the model's dtype."""

    FP32_PARAMS = ("log_dt", "log_A_real", "A_imag", "C")

    def __init__(self, channels: int, d_state: int, init: str, disc: str, dt_min, dt_max):
        super().__init__()
        self.channels, self.d_state, self.init, self.disc = channels, d_state, init, disc
        self.dt_min, self.dt_max = dt_min, dt_max
        half = d_state // 2
        self.log_dt = nn.Parameter(torch.empty(channels))
        self.log_A_real = nn.Parameter(torch.empty(channels, half))
        self.A_imag = nn.Parameter(torch.empty(channels, half))
        self.C = nn.Parameter(torch.empty(channels, half, 2))
        for p in (self.log_dt, self.log_A_real, self.A_imag):
            p._no_weight_decay = True
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """s4d.py's init: log Δ uniform in [log dt_min, log dt_max], A by ``init``, C ~ N(0, 1)
        complex."""
        lo, hi = math.log(self.dt_min), math.log(self.dt_max)
        self.log_dt.copy_(torch.rand(self.channels) * (hi - lo) + lo)
        with torch.device("cpu"):  # HiPPO's eigenvalues are computed, even for a meta model
            A = ops.s4d_init(self.init, self.d_state, self.channels)
        self.log_A_real.copy_(torch.log(-A.real))
        self.A_imag.copy_(A.imag)
        C = torch.randn(self.channels, self.d_state // 2, dtype=torch.cfloat)  # re, im N(0, 1/2)
        self.C.copy_(torch.view_as_real(C))

    def A(self) -> torch.Tensor:
        """A = -exp(log_A_real) + i A_imag: (H, N/2) complex64."""
        return torch.complex(-torch.exp(self.log_A_real.float()), self.A_imag.float())

    def discrete(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Ā, B̄, C), each (H, N/2) complex64: A and B = 1 discretised with Δ
        (:func:`ssmkit.ops.discretize`)."""
        A = self.A()
        Ab, Bb = ops.discretize(A, torch.ones_like(A), torch.exp(self.log_dt.float()), self.disc)
        return Ab, Bb, torch.view_as_complex(self.C.float().contiguous())

    def kernel(self, L: int) -> torch.Tensor:
        """K̄ (H, L) fp32: 2 Re of the half's Vandermonde kernel (S4D section 3)."""
        Ab, Bb, C = self.discrete()
        return 2 * ops.kernel_vandermonde(Ab, Bb, C, L).real

    def forward(self, u: torch.Tensor, state: torch.Tensor | None = None, seq_idx=None):
        """The convolution mode. u: (*batch, H, L) -> (y (*batch, H, L) fp32, the state after the
        last input (*batch, H, N/2) complex64, or None without ``state``).

        state: the state before u (a cache's): its decay adds 2 Re(C Ā^{t+1} x) to y_t. seq_idx:
        (batch, L) packed samples (u then (batch, ..., H, L)), each convolved on its own."""
        with torch.autocast(u.device.type, enabled=False):
            u, L = u.float(), u.shape[-1]
            Ab, Bb, C = self.discrete()
            K = 2 * ops.kernel_vandermonde(Ab, Bb, C, L).real
            y = ops.ssm_convolve(K, u, seq_idx)
            if state is None:
                return y, None
            y = y + 2 * ops.state_response(Ab, C, state, L).real
            return y, ops.state_after(Ab, Bb, u, state)

    def step(self, u: torch.Tensor, state: torch.Tensor):
        """The recurrent mode, one input: u (*batch, H) -> (y (*batch, H) fp32, the next state
        (*batch, H, N/2)); x = Ā x + B̄ u, y = 2 Re(C x) (:func:`ssmkit.ops.ssm_step`)."""
        with torch.autocast(u.device.type, enabled=False):
            Ab, Bb, C = self.discrete()
            y, state = ops.ssm_step(Ab, Bb, C, state, u.float())
            return 2 * y.real, state


class S4D(KeepsFp32, nn.Module):
    """S4D as a mixer: u = in_proj(x); y = GELU(K̄ * u + D u); out = GLU(out_proj(y)).
    (batch, seqlen, d_model) -> (batch, seqlen, d_model). ``cfg``: the model's ``s4d`` group."""

    FP32_PARAMS = ("D",)

    def __init__(self, d_model: int, cfg: S4DConfig):
        super().__init__()
        self.d_model, self.channels, self.d_state = d_model, cfg.d_inner(d_model), cfg.d_state
        self.in_proj = nn.Linear(d_model, self.channels, bias=cfg.bias)
        self.ssm = DiagonalSSM(
            self.channels, cfg.d_state, cfg.init, cfg.disc, cfg.dt_min, cfg.dt_max
        )
        self.D = nn.Parameter(torch.randn(self.channels))
        self.out_proj = nn.Linear(self.channels, 2 * d_model, bias=cfg.bias)

    def allocate_state(self, batch_size, dtype, device) -> LTIState:
        half = self.d_state // 2
        return LTIState(
            ssm=torch.zeros(batch_size, self.channels, half, dtype=torch.complex64, device=device)
        )

    def _output(self, y: torch.Tensor, u: torch.Tensor, dtype) -> torch.Tensor:
        """GLU(out_proj(GELU(y + D u))): y, u (..., H) -> (..., d_model)."""
        y = F.gelu(y + self.D.float() * u.float())
        return F.glu(self.out_proj(y.to(dtype)), dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,
        state: LTIState | None = None,
        mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: (batch, seqlen, d_model) -> (batch, seqlen, d_model), by the FFT convolution.
        With ``state`` the layer continues from it and leaves the next one there. mask: (batch,
        seqlen), 0 at left padding: u = 0 there leaves the state at zero, as if the row started
        later. seq_idx: (batch, seqlen) packed samples, each convolved alone."""
        check_packed(state, mask, seq_idx)
        if state is not None and hidden.shape[1] == 1 and mask is None:
            return self.step(hidden, state)
        u = zero_padding(self.in_proj(hidden), mask)  # (batch, seqlen, H)
        y, after = self.ssm(u.transpose(1, 2), None if state is None else state.ssm, seq_idx)
        if state is not None:
            state.ssm = after
        return self._output(y.transpose(1, 2), u, hidden.dtype)

    def step(self, hidden: torch.Tensor, state: LTIState) -> torch.Tensor:
        """One token: (batch, 1, d_model) -> (batch, 1, d_model), O(1) in the sequence length."""
        u = self.in_proj(hidden[:, 0])  # (batch, H)
        y, state.ssm = self.ssm.step(u, state.ssm)
        return self._output(y, u, hidden.dtype)[:, None]
