r"""One step of the selective SSM, for recurrent generation (Mamba-1 and Mamba-2): O(1) per token.

The recurrence of :mod:`ssmkit.ops.s6` (eq. 2a, 2b of Gu & Dao 2023) applied to a single time step,

$$ h_t = \exp(\Delta_t A)\, h_{t-1} + \Delta_t\, x_t B_t^\top, \qquad
   y_t = (h_t C_t + D x_t) \cdot \mathrm{silu}(z_t) $$

with the state updated in place. Mamba-2 uses it with one scalar A (and Δ) per head broadcast over
(headdim, dstate), mamba_ssm's ``selective_state_update`` layout; the cuda backend calls that
kernel.

Several tokens in one call (speculative decoding's verification step): every per-token argument
takes a token axis T after the batch axis, x (batch, T, dim) or (batch, T, nheads, headdim), B and
C (batch, T, [ngroups,] dstate): FlashInfer's multi-token ``selective_state_update`` layout
(mamba_ssm's kernel takes one token; vLLM's flattens the tokens of all sequences with
``cu_seqlens``). The call equals T one-token calls; the cuda backend makes them, one kernel call per
token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend as _backend


def selective_state_update(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, backend=None
):
    """One step of the recurrence, updating ``state`` in place (generation, O(1) per token), or T
    steps in one call.

    Mamba-1 shapes: state (batch, dim, dstate); x, dt, z (batch, dim); A (dim, dstate);
    B, C (batch, dstate) or (batch, ngroups, dstate); D, dt_bias (dim,).
    Mamba-2 shapes: state (batch, nheads, headdim, dstate); x, dt, z (batch, nheads, headdim);
    A (nheads, headdim, dstate); B, C (batch, ngroups, dstate); D, dt_bias (nheads, headdim).
    T tokens: x, dt, z (batch, T, dim) or (batch, T, nheads, headdim); B, C (batch, T, dstate) or
    (batch, T, ngroups, dstate); the others as above. The same as T one-token calls in a row.
    Returns y shaped like x.
    """
    tokens = x.dim() == state.dim()  # a token axis: T one-token steps
    if tokens:
        _check_tokens(state, x, dt, A, B, C, D, z, dt_bias)
    name = _backend.select("selective_state_update", state, backend=backend)
    if not tokens:
        if name != "cuda":
            _check_step(state, x, dt, A, B, C, D, z, dt_bias)
        return _update(name, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    ys = [
        _update(
            name,
            state,
            x[:, t],
            dt[:, t],
            A,
            B[:, t],
            C[:, t],
            D,
            None if z is None else z[:, t],
            dt_bias,
            dt_softplus,
        )
        for t in range(x.shape[1])
    ]  # on cuda one kernel call per token: mamba_ssm's takes one
    return torch.stack(ys, dim=1)


def _update(name, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    """One token on backend ``name`` (shapes checked), the state updated in place."""
    if name == "cuda":
        fn = _backend.kernel_module("selective_state_update").selective_state_update
        if dt_bias is None:
            # the kernel reads dt_bias.stride(-1) whenever A and Δ are broadcast per head (its
            # tie_hdim test), None or not: a zero bias of stride 0 adds nothing
            dt_bias = torch.zeros((), device=x.device).expand(x.shape[1:])
        return fn(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
    heads = state.dim() == 4
    if name == "torch" and _in_place_ok(state, x, dt, A, B, C, D, z, dt_bias):
        return _state_update_in_place(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    if not heads:  # Mamba-1 as a single "head" whose headdim is dim: (batch, 1, dim, dstate)
        state4, x, dt, A = state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0)
        z = z.unsqueeze(1) if z is not None else None
        D = D.unsqueeze(0) if D is not None else None
        dt_bias = dt_bias.unsqueeze(0) if dt_bias is not None else None
    else:
        state4 = state
    nheads, hdim = state4.shape[1], state4.shape[2]
    Bh, Ch = _shared(B, heads, nheads, hdim), _shared(C, heads, nheads, hdim)
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    xf = x.float()
    h_prev = state4.to(torch.float32, copy=True)  # a copy: the state is overwritten below
    h = (
        torch.exp(dt[..., None] * A.float()) * h_prev + (dt * xf)[..., None] * Bh
    )  # eq. 2a, one step
    state4.copy_(h.to(state4.dtype))  # differentiable: gradients can flow across steps
    y = (h * Ch).sum(-1)  # eq. 2b
    if D is not None:
        y = y + xf * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return y if heads else y.squeeze(1)


def _check_tokens(state, x, dt, A, B, C, D, z, dt_bias):
    """The shapes of :func:`selective_state_update`'s T-token form: x (batch, T, ...) and the
    per-token arguments with the same (batch, T) in front, the rest as for one token."""
    batch, T = x.shape[:2]
    layout = (
        "T tokens: x, dt, z (batch, T, dim) or (batch, T, nheads, headdim); "
        "B, C (batch, T, dstate) or (batch, T, ngroups, dstate)"
    )
    if T == 0:
        raise ValueError(f"x must hold at least one token ({layout}); got {tuple(x.shape)}")
    for name, t in (("dt", dt), ("z", z)):
        if t is not None and t.shape != x.shape:
            raise ValueError(
                f"{name} must be shaped as x {tuple(x.shape)} ({layout}); got {tuple(t.shape)}"
            )
    for name, M in (("B", B), ("C", C)):
        if M.dim() not in (3, 4) or tuple(M.shape[:2]) != (batch, T):
            raise ValueError(
                f"{name} must be (batch={batch}, T={T}, [ngroups,] dstate) ({layout}); "
                f"got {tuple(M.shape)}"
            )
    try:  # the rest as for one token
        z0 = None if z is None else z[:, 0]
        _check_step(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, z0, dt_bias)
    except ValueError as err:
        raise ValueError(f"{err} (per token; {layout})") from None


def _shared(M, heads: bool, nheads: int, hdim: int) -> torch.Tensor:
    """B or C, (batch, dstate) or (batch, ngroups, dstate), in fp32 and broadcastable against the
    state: Mamba-2 heads share their group's (-> (batch, nheads, 1, dstate)); Mamba-1 channels share
    their group's (-> (batch, 1, dim, dstate))."""
    Mg = (M if M.dim() == 3 else M.unsqueeze(1)).float()
    if heads:
        return Mg.repeat_interleave(nheads // Mg.shape[1], dim=1)[:, :, None, :]
    return Mg.repeat_interleave(hdim // Mg.shape[1], dim=1)[:, None, :, :]


def _in_place_ok(state, *tensors) -> bool:
    """The torch backend's decode step may update an fp32, contiguous state in place when no
    gradient can flow through it (generation: inference mode / no_grad); otherwise the functional
    step above runs."""
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (state, *tensors)
    )
    return not grads and state.dtype == torch.float32 and state.is_contiguous()


def _state_update_in_place(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    """The step of :func:`selective_state_update` for generation: the same equations (2a, 2b), with
    the state read and written in place and no (batch, ..., dstate) temporaries beyond the decay.

    Mamba-2 (A, Δ and dt_bias one scalar per head, broadcast over headdim and dstate as the mixer
    passes them, like the kernel's ``tie_hdim``): the decay exp(Δ a) is computed once per (batch,
    head), not per state element, and h += (Δ x) Bᵀ is one batched outer product (``baddbmm_``); y =
    h C a ``vecdot``."""
    heads = state.dim() == 4
    if not heads:  # Mamba-1: (batch, dim, dstate), a single "head" of headdim = dim
        state, x, dt, A = state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0)
        z = None if z is None else z.unsqueeze(1)
        D = None if D is None else D.unsqueeze(0)
        dt_bias = None if dt_bias is None else dt_bias.unsqueeze(0)
    batch, nheads, hdim, dstate = state.shape
    Bg = (B if B.dim() == 3 else B.unsqueeze(1)).float()  # (batch, ngroups, dstate)
    Cg = (C if C.dim() == 3 else C.unsqueeze(1)).float()
    xf = x.float()
    tied = (
        heads
        and A.stride(-1) == 0
        and A.stride(-2) == 0
        and dt.stride(-1) == 0
        and (dt_bias is None or dt_bias.stride(-1) == 0)
    )
    if tied:  # one Δ and one a per (batch, head)
        dt_h = dt[..., 0].float() + (0.0 if dt_bias is None else dt_bias[:, 0].float())
        dt_h = F.softplus(dt_h) if dt_softplus else dt_h  # (batch, nheads)
        state.mul_(torch.exp(dt_h * A[:, 0, 0].float())[..., None, None])  # a_t h_{t-1}
        rows = (xf * dt_h[..., None]).reshape(batch * nheads, hdim, 1)  # Δ x
        Bh = Bg.repeat_interleave(nheads // Bg.shape[1], dim=1).reshape(batch * nheads, 1, dstate)
        Ch = Cg.repeat_interleave(nheads // Cg.shape[1], dim=1)[:, :, None, :]  # (b, h, 1, n)
        state.view(batch * nheads, hdim, dstate).baddbmm_(rows, Bh)  # + Δ x Bᵀ
        y = torch.linalg.vecdot(state, Ch)  # h C: (b, h, p)
        if D is not None:
            y = y + xf * D.float()
    else:
        dtf = dt.float() + (0.0 if dt_bias is None else dt_bias.float())
        dtf = F.softplus(dtf) if dt_softplus else dtf  # (b, h, p)
        Bh, Ch = _shared(B, heads, nheads, hdim), _shared(C, heads, nheads, hdim)
        state.mul_(torch.exp(dtf[..., None] * A.float())).addcmul_((dtf * xf)[..., None], Bh)
        y = torch.linalg.vecdot(state, Ch)  # (b, h, p)
        if D is not None:
            y = y + xf * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return y if heads else y.squeeze(1)


def _check_step(state, x, dt, A, B, C, D, z, dt_bias):
    """Shapes of :func:`selective_state_update`'s arguments, in either layout."""
    if state.dim() == 3:
        batch, dim, dstate = state.shape
        lead, A_shape, vec = (
            f"(batch={batch}, dim={dim})",
            f"(dim={dim}, dstate={dstate})",
            f"(dim={dim},)",
        )
        sizes = {lead: (batch, dim), A_shape: (dim, dstate), vec: (dim,)}
        layout = "Mamba-1: state (batch, dim, dstate)"
    elif state.dim() == 4:
        batch, nheads, hdim, dstate = state.shape
        lead = f"(batch={batch}, nheads={nheads}, headdim={hdim})"
        A_shape, vec = (
            f"(nheads={nheads}, headdim={hdim}, dstate={dstate})",
            f"(nheads={nheads}, headdim={hdim})",
        )
        sizes = {lead: (batch, nheads, hdim), A_shape: (nheads, hdim, dstate), vec: (nheads, hdim)}
        layout = "Mamba-2: state (batch, nheads, headdim, dstate)"
    else:
        raise ValueError(
            f"state must be (batch, dim, dstate) or (batch, nheads, headdim, dstate); "
            f"got {tuple(state.shape)}"
        )
    expected = {"x": lead, "dt": lead, "z": lead, "A": A_shape, "D": vec, "dt_bias": vec}
    for name, t in (("x", x), ("dt", dt), ("A", A), ("z", z), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and tuple(t.shape) != sizes[expected[name]]:
            raise ValueError(f"{name} must be {expected[name]} for {layout}; got {tuple(t.shape)}")
    split = state.shape[1]  # channels (Mamba-1) or heads (Mamba-2) are split into groups
    for name, M in (("B", B), ("C", C)):
        ok = (M.dim() == 2 and state.dim() == 3 and tuple(M.shape) == (batch, dstate)) or (
            M.dim() == 3
            and M.shape[0] == batch
            and M.shape[2] == dstate
            and split % M.shape[1] == 0
        )
        if not ok:
            raise ValueError(
                f"{name} must be (batch={batch}, dstate={dstate}) or (batch, ngroups, dstate) "
                f"with ngroups dividing {split} for {layout}; got {tuple(M.shape)}"
            )
