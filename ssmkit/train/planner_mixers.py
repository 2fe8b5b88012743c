r"""The memory planner's activation formulas: the bytes each part of a block saves for the backward
pass. :mod:`ssmkit.train.planner` adds them up over the layers, with the weights, gradients,
optimizer state and workspace; this module knows what each mixer's code keeps.

Per token (B·L of them) of one layer, from the tensors ssmkit's code saves for the backward pass.
``[a]``: the compute dtype (4 bytes fp32, 2 bf16/fp16), ``[f]``: fp32 always. d = d_model, E =
d_inner, N = d_state, R = dt_rank, W = d_conv, H = SSM heads, P = headdim, G = ngroups, Q =
chunk_size, C = E + 2GN (Mamba-2's conv channels), h = the MLP width, V = the padded vocabulary; for
Mamba-3 also r = the MIMO rank (1: SISO), S = the rotation angles (``ssmkit.ops.rope_angles``), I =
2E + 2GNr + 3H + S (its in_proj's width):

    norm (each)   torch: residual d [f] + rstd 1 [f] + normed d [f], the next matmul's input d [a]
                  cuda (Triton rms_norm): residual d [f] + rstd 1 [f], the next matmul's input d [a]
    Mamba-1       torch: in_proj out 2E + conv (taps over the padded input E(L+W-1)/L, pre-SiLU E,
                  output E) + x_proj out R+2N + out_proj in E [a]; the S6 Function's time-major u,
                  Δ+bias, Δ, y+Dx (4E) and B, C (2N) [f]; per sequence the chunk states
                  B·E·N·(2T+1+⌈L/T⌉) [f], T = min(L, 64, 2^20 // (B·E·N)): one state per chunk of T
                  steps and two T-step buffers
                  cpu (the fused S6 Function of ssmkit.ops.s6_cpu saves its inputs and the chunk
                  states): the conv's taps over the padded input E(L+W-1)/L and its pre-SiLU E
                  (it computes in fp32), Δ before its bias E, B and C's grouped copies 2N [f]; the
                  conv's output x E, x_proj out R+2N, out_proj in E [a]; and 2E [f]: in fp32
                  in_proj's output (z, a view of it, is an input of the Function), in bf16/fp16
                  the Function's fp32 copies of u and z; per sequence the state entering each
                  chunk of 64 steps B·E·N·⌈L/64⌉ [f]
                  cuda (selective_scan_fn + causal_conv1d_fn): in_proj out 2E, conv out E, x_proj
                  out R+2N, the kernel's contiguous u, Δ, z, B, C (3E + 2N), its y before the gate
                  E, the gated y E [a]; per sequence 2N·E·⌈L/2048⌉ [f] (its chunk states)
    Mamba-2       torch, up to ssmkit.ops.ssd.RECOMPUTE_FROM tokens (B·L; ssd_chunked in autograd):
                  in_proj out 2E+2GN+H, conv C(L+W-1)/L + C + C, out_proj in E [a]; the gated norm
                  4E + G and softplus H [f]; per padded token (L rounded up to Q) 4E + 3H + 2HQ + GQ
                  + 4GN + HN + 2EN/Q + H/Q [f] (Δx, the decay matrix L and L∘CBᵀ of the diagonal
                  blocks, the copies torch.einsum makes for its matmuls, the states entering chunks)
                  torch, more tokens (ssd_chunked_recompute; the conv + SiLU and the gated norm with
                  out_proj recomputed in the backward): in_proj out 2E+2GN+H, conv out C, the scan's
                  output E [a]; per sequence HPN [f] per segment of RECOMPUTE_SEGMENT steps after
                  the first
                  cuda (mamba_chunk_scan_combined + rmsnorm_fn): in_proj out 2E+2GN+H, conv out E,
                  scan out E, gated-norm out E [a]; dA_cumsum H (per padded token) + rstd G [f]
    Mamba-3       torch (ssmkit.ops.mamba3_chunked in autograd, chunks of Q' = min(Q, 64 // r) on a
                  CPU): in_proj out I, out_proj in E [a]; Δ's softplus input, Δ, λ, 1-λ, A (5H) and
                  A's activation (heavy-tail: its two branches 2H, and a 1-byte mask H; softplus: H)
                  [f]; B and C normed and their rstd 2Gr(N+1), per head and biased 2rHN, the angles'
                  tanh, π·tanh·Δ, cos and sin 4HS [f]; the output: SISO y+Dx and silu(z) 2E, MIMO
                  x·mimo_x, z·mimo_z, y+Dx, the gate and the gated y 5rE [f] (with is_outproj_norm:
                  SISO 4E + H, MIMO 7rE + rH: the norm's input, rstd, output and product with its
                  weight); per padded token (L rounded up to Q') the angles θ HS, the chunks' decays
                  3H + (H if r = 1 else 2rH), q and k padded 2rHN, the decay matrix HQ' and the
                  weights W = L∘w HQ'r² [f]; the matmuls' operands q, kᵀ, q·decay, k·decay 4rHN, x
                  twice 2rHP (MIMO with L a multiple of Q': once), and q kᵀ, (q kᵀ)∘W 2HQ'r² [a];
                  per chunk the state entering it HPN [f] and its transposed copy HPN [a]. bf16/fp16
                  add fp32 copies of a, B, C, x, z (H + 2GNr + 2E) [f]
                  cuda (mamba3_siso_combined, SISO): in_proj out I, the kernel's output and its
                  pre-gate output 2E, its rotated q and scaled k 2HN, λ's contiguous copy H, B
                  and C normed and their inputs' copies 4GN [a]; Δ's softplus input, Δ, A and
                  its activation (as torch), the kernel's A·Δ, Δ, cumulative decay, q·k, scale
                  and γ (6H), rstd 2G, the cumulative angles HS (and, in bf16, the angles' fp32
                  copy HS) [f]; per chunk its state HPN in bf16 (2 bytes) and its decay sum H
                  [f]. (mamba3_mimo, MIMO: it saves its inputs and recomputes the rest) in_proj
                  out I, the output E, x's and z's contiguous copies 2E, λ's copy H, B, C and
                  their inputs' copies 4GNr [a]; Δ, A as torch, A·Δ and Δ copies 2H, the
                  angles' copy and their cumulative sum 2HS, rstd 2Gr [f]. is_outproj_norm:
                  SISO + the norm's output E [a] and rstd H [f]; MIMO the norm on r outputs:
                  z·mimo_z, its input and output 3rE and rstd rH [f]
    S4D, H3       (ssmkit's PyTorch path on every backend; H = S4D's channels E, H3's heads, n = N/2
                  complex modes, c = 8 bytes a complex64) the diagonal SSM, per sequence whatever
                  the batch: the Vandermonde matrix Ā^l c·H·n·L, K̄ padded to 2L and its FFT
                  4·2HL + c·H(L+1), and Ā, B̄, C and their intermediates (6 complex + 2 fp32
                  (H, n) with ZOH, 9 + 2 with the bilinear rule) + Δ H + the powers L [f]
                  S4D: u (D·u's operand) 4E, u padded to 2L for the FFT 8E and its FFT cE(L+1)/L,
                  GELU's input 4E [f]; out_proj's input (a copy, transposed) E, the GLU's 2d [a]
                  H3 (P = head_dim, k vᵀ has dP entries a token): k 4d, the shift conv's taps over
                  the padded k 4d(L+W-1)/L, the einsums' copies of k̄, v, q 12d, k vᵀ 4dP (D·k vᵀ's
                  operand), padded 8dP and its FFT c·dP(L+1)/L, y's copy for the read-out 4dP
                  [f]; out_proj's input d [a]
    attention     in_proj out (heads + 2 kv heads)·head_dim (+ mlp_dim), SDPA's output
                  heads·head_dim [a], its log-sum-exp H_attn [f]; rotary: rotated q, k and their
                  cos, sin; GQA: a copy of the output; d_conv: the conv's taps and output; a window
                  shorter than L/2: the blocks' output
    MLP           fc1 out 2h + SiLU(gate) h + product h [a] (after norm2)
    MoE           (the MLP of cfg.moe_layers; X = num_experts, k = num_experts_per_tok) the
                  router's softmax X [f] and the aux loss's X [f], the top-k indices 8k; per routed
                  copy (k per token) the gathered input d, the expert's MLP 4h, its output d and
                  weight 1, the weighted output d (index_add_ keeps its source) [a], the token's
                  and rank's indices 16 (after norm2)

Backends: ``cpu`` is what a CPU run takes by default: the fused C++ S6 scan for Mamba-1
(:mod:`ssmkit.ops.s6_cpu`) and ssmkit's pure-PyTorch path for every other part; ``torch`` the
pure-PyTorch path everywhere (``SSMKIT_BACKEND=torch``, a CPU where the fused scan does not build, a
GPU without the kernels). tests/unit/train/test_planner.py checks both against autograd's saved
tensors, in fp32, and ``cpu`` against measured peaks. ``cuda`` is the kernels (from their
``save_for_backward``; not yet measured on a GPU). Where a row names no ``cpu`` formula, ``cpu`` is
``torch``'s. In bf16/fp16 the torch formulas assume autocast casts the operands of a matmul (the
saved copies are then [a]), and elementwise products stay fp32.
"""

from __future__ import annotations

import math

from ..models.mlp import mlp_width
from ..ops import rope_angles
from ..ops import ssd as _ssd
from ..ops.mamba3 import CPU_CHUNK_SIZE as MAMBA3_CPU_CHUNK
from ..ops.recompute import segment_bounds
from ..ops.s6_cpu import CHUNK as FUSED_SCAN_CHUNK

SCAN_CHUNK_ELEMENTS = 1 << 20  # ssmkit.ops.s6: the torch scan's chunk holds ~2^20 floats of states
CUDA_SCAN_CHUNK = 2048  # mamba_ssm's selective scan keeps a state every 2048 steps
# the backends whose parts run ssmkit's PyTorch code: all of them on "torch", all but Mamba-1's scan
# on "cpu"
PYTORCH_BACKENDS = ("cpu", "torch")

# Temporaries of a part's backward, as a fraction of what the part saved (measured on CPU, torch
# backend, tests/unit/train/test_planner.py): the S6 Function's backward allocates all its gradients
# and two T-step buffers before its saved tensors go; Mamba-2's and Mamba-3's chunked scans are many
# small autograd ops, each freeing as it goes (Mamba-3's largest, the (Q'r)² blocks, leave twice
# Mamba-2's share).
BACKWARD_TEMPS = {
    "mamba1": 0.7,
    "mamba2": 0.1,
    "mamba3": 0.2,
    "s4d": 0.4,
    "h3": 0.6,
    "attn": 0.3,
    "swa": 0.3,
    "mlp": 0.3,
    "moe": 0.3,  # its experts' temporaries are the MLP's, k copies of them
}
# ... on the "cpu" backend (measured the same way, one thread): Mamba-1's fused S6 backward
# allocates du, Δ's and z's gradients (3E of the part's ~9E per token) and frees its saved tensors
# as it returns. With t threads and fewer than t rows it also keeps dB and dC partials, up to
# min(t, E/N)·2N per token (a tenth more temporaries at 16 threads, d_state 16), left out.
CPU_BACKWARD_TEMPS = {**BACKWARD_TEMPS, "mamba1": 0.3}


def norm_bytes(cfg, backend: str, a: int) -> float:
    """Bytes per token a pre-norm saves, with the input it hands the next matmul (module
    docstring)."""
    d = cfg.d_model
    normed = d * 4 if backend in PYTORCH_BACKENDS else 0
    return d * (4 if cfg.residual_in_fp32 else a) + 4 + normed + d * a


def _mamba1(cfg, backend: str, B: int, L: int, a: int) -> float:
    m = cfg.mamba1
    E, N, W = m.d_inner(cfg.d_model), m.d_state, m.d_conv
    tok = B * L
    R = m.dt_rank_value(cfg.d_model)
    extra = (2 * (R + 2 * N) + 3) * 4 * tok if m.mixer_rms_eps is not None else 0  # Δ, B, C norms
    A = E * N * 4  # A = -exp(A_log), fp32
    if backend == "torch":
        T = max(1, min(L, 64, SCAN_CHUNK_ELEMENTS // max(1, B * E * N)))
        states = B * E * N * (2 * T + 1 + math.ceil(L / T)) * 4
        u_copy = 0 if B == 1 and a == 4 else E  # one fp32 row: time-major u is the conv output
        per_tok = (6 * E + E * (W - 1) / L + R + 2 * N) * a + (3 * E + u_copy + 2 * N) * 4
        return tok * per_tok + states + 2 * A + extra
    if backend == "cpu":  # the fused S6 (module docstring)
        per_tok = (E * (L + W - 1) / L + 4 * E + 2 * N) * 4 + (2 * E + R + 2 * N) * a
        states = B * E * N * math.ceil(L / FUSED_SCAN_CHUNK) * 4
        return tok * per_tok + states + 2 * A + extra
    return (
        tok * (8 * E + R + 4 * N) * a
        + B * E * 2 * N * math.ceil(L / CUDA_SCAN_CHUNK) * 4
        + A
        + extra
    )


def _mamba2(cfg, backend: str, B: int, L: int, a: int) -> float:
    m = cfg.mamba2
    E, N, W, P = m.d_inner(cfg.d_model), m.d_state, m.d_conv, m.headdim
    H, G, Q = m.nheads(cfg.d_model), m.ngroups, m.chunk_size
    tok = B * L
    C = E + 2 * G * N
    padded = B * math.ceil(L / Q) * Q
    if backend in PYTORCH_BACKENDS and _ssd.recomputes(tok):  # the SSD by segments, and more
        segments = len(segment_bounds(L, _ssd.RECOMPUTE_SEGMENT, Q))
        return tok * (2 * E + 2 * G * N + H + C + E) * a + B * (segments - 1) * H * P * N * 4
    if backend in PYTORCH_BACKENDS:
        per_tok = (2 * E + 2 * G * N + H + C * (L + W - 1) / L + 2 * C + E) * a + (
            4 * E + G + H
        ) * 4
        per_padded = 4 * E + 3 * H + 2 * H * Q + G * Q + 4 * G * N + H * N + 2 * E * N / Q + H / Q
        return tok * per_tok + padded * per_padded * 4
    return tok * ((2 * E + 2 * G * N + H + C + 2 * E) * a + G * 4) + padded * H * 4


def _mamba3(cfg, backend: str, B: int, L: int, a: int) -> float:
    """Mamba-3 (ssmkit.models.Mamba3 with ssmkit.ops.mamba3_scan): the module docstring's
    formulas."""
    m = cfg.mamba3
    E, N, H, P, G = m.d_inner(cfg.d_model), m.d_state, m.nheads(cfg.d_model), m.headdim, m.ngroups
    r = m.mimo_rank if m.is_mimo else 1
    S = rope_angles(N, m.rope_fraction)
    mimo, normed, half = m.is_mimo, m.is_outproj_norm, a == 2
    tok = B * L
    width = 2 * E + 2 * G * N * r + 3 * H + S  # in_proj's output: z, x, B, C, Δ, A, λ, θ
    heavy = m.a_activation == "heavy_tail"
    # Δ = softplus(Δ + bias): its input and output; A = -max(f(a), A_floor): f's saved values, A
    # itself
    dt_a = (2 + (2 if heavy else 1) + 1 + half) * H * 4 + (H if heavy else 0)
    if backend in PYTORCH_BACKENDS:
        Q = max(1, min(m.chunk_size, MAMBA3_CPU_CHUNK // r))  # the chunk the op takes on a CPU
        chunks = math.ceil(L / Q)
        padded = B * chunks * Q
        if mimo:
            out = 7 * r * E + r * H if normed else 5 * r * E
        else:
            out = 4 * E + H if normed else 2 * E
        per_tok = (
            (width + E) * a
            + 4 * (2 * H + 2 * G * r * (N + 1) + 2 * r * H * N + 4 * H * S + out)
            + dt_a
        )
        per_tok += 4 * (2 * G * N * r + 2 * E) * half  # the fp32 copies of B, C (normed), x and z
        decays = 3 * H + (H if r == 1 else 2 * r * H)
        # x's chunks: the two matmuls copy them, but MIMO's x·mimo_x is laid out (b, L, h, r, p);
        # unpadded (L a multiple of Q'), its chunks are one copy that both matmuls read
        xs = 1 if r > 1 and H > 1 and L % Q == 0 else 2
        per_padded = 4 * (H * S + decays + 2 * r * H * N + H * Q + H * Q * r * r) + a * (
            4 * r * H * N + xs * r * H * P + 2 * H * Q * r * r
        )
        return tok * per_tok + padded * per_padded + B * chunks * H * P * N * (4 + a)
    # cuda: mamba_ssm's kernels (ssmkit.ops.mamba3.mamba3_cuda)
    chunks = math.ceil(L / m.chunk_size)
    bc = 4 * G * N * r * a + 2 * G * r * 4  # B, C normed, inputs' copies; rstd
    if mimo:
        per_tok = (
            (width + E + E + (0 if normed else E) + H) * a + 4 * (2 * H + 2 * H * S) + bc + dt_a
        )
        if normed:
            per_tok += 4 * (3 * r * E + r * H) + 4 * E * half
        return tok * per_tok
    per_tok = (width + 2 * E + 2 * H * N + H) * a + 4 * (6 * H + H * S * (1 + half)) + bc + dt_a
    if normed:
        per_tok += E * a + 4 * H
    return tok * per_tok + B * chunks * H * (P * N * 2 + 4)


def _diagonal_ssm(H: int, n: int, L: int, disc: str) -> float:
    """What :class:`ssmkit.models.s4d.DiagonalSSM` saves once per sequence: H channels of n
    complex modes (module docstring)."""
    params = (6 if disc == "zoh" else 9) * 8 + 2 * 4
    return 8 * H * n * L + 4 * H * 2 * L + 8 * H * (L + 1) + params * H * n + 4 * H + 4 * L


def _s4d(cfg, B: int, L: int, a: int) -> float:
    m = cfg.s4d
    E, d = m.d_inner(cfg.d_model), cfg.d_model
    per_tok = (4 + 8 + 8 * (L + 1) / L + 4) * E + (E + 2 * d) * a
    return B * L * per_tok + _diagonal_ssm(E, m.d_state // 2, L, m.disc)


def _h3(cfg, B: int, L: int, a: int) -> float:
    m = cfg.h3
    d, P, W = cfg.d_model, m.head_dim, m.shift_size
    entries = d * P  # of k vᵀ, a token
    per_tok = 4 * d * (1 + (L + W - 1) / L + 3) + entries * (4 + 8 + 8 * (L + 1) / L + 4) + d * a
    return B * L * per_tok + _diagonal_ssm(m.nheads(d), m.d_state // 2, L, m.disc)


def _attention(cfg, kind: str, B: int, L: int, a: int) -> float:
    """mamba_ssm's MHA ("attn", "swa")."""
    c = cfg.attn_cfg
    heads, kv, hd = c["num_heads"], c["num_heads_kv"], c["head_dim"]
    mlp = math.ceil(c["mlp_dim"] / 256) * 256
    qkv = hd * (heads + 2 * kv)
    per_tok = (qkv + mlp + heads * hd) * a + heads * 4
    if c["rotary_emb_dim"]:  # rotated q, k; cos and sin for each
        per_tok += (heads + kv) * hd * a + 2 * c["rotary_emb_dim"] * 4
    if kv != heads:  # GQA: SDPA's output is copied for out_proj
        per_tok += heads * hd * a
    if c["d_conv"]:
        per_tok += qkv * (1 + (c["d_conv"] - 1) / L + 1) * a
    if mlp:
        per_tok += (mlp // 2 + heads * hd + mlp // 2) * a
    if kind == "swa" and L > 2 * c["window_size"]:
        per_tok += heads * hd * a
    return B * L * per_tok


def mixer_bytes(cfg, kind: str, backend: str, B: int, L: int, a: int) -> float:
    """Bytes one layer's mixer ``kind`` saves for the backward, for B sequences of L tokens, compute
    dtype of ``a`` bytes (4 fp32, 2 bf16/fp16)."""
    if kind == "mamba1":
        return _mamba1(cfg, backend, B, L, a)
    if kind == "mamba2":
        return _mamba2(cfg, backend, B, L, a)
    if kind == "mamba3":
        return _mamba3(cfg, backend, B, L, a)
    if kind == "s4d":  # no kernels: the PyTorch path on every backend
        return _s4d(cfg, B, L, a)
    if kind == "h3":
        return _h3(cfg, B, L, a)
    return _attention(cfg, kind, B, L, a)


def block_parts(
    cfg, kind: str, backend: str, B: int, L: int, a: int, moe: bool = False
) -> list[tuple[str, float]]:
    """(kind, bytes saved for the backward) of one block's parts in forward order: norm + mixer,
    then norm2 + MLP when the block has one (``moe``: a mixture of experts, a layer of
    ``cfg.moe_layers``)."""
    tokens = B * L
    parts = [
        (kind, tokens * norm_bytes(cfg, backend, a) + mixer_bytes(cfg, kind, backend, B, L, a))
    ]
    if moe:
        X, k, h = cfg.num_experts, cfg.num_experts_per_tok, mlp_width(cfg.d_intermediate)
        routed = k * ((3 * cfg.d_model + 4 * h + 1) * a + 16)
        parts.append(("moe", tokens * (norm_bytes(cfg, backend, a) + 8 * X + 8 * k + routed)))
    elif cfg.d_intermediate:
        mlp = tokens * (norm_bytes(cfg, backend, a) + 4 * mlp_width(cfg.d_intermediate) * a)
        parts.append(("mlp", mlp))
    return parts


def backward_peak(parts: list[tuple[str, float]], backend: str) -> float:
    """The most a backward pass over ``parts`` (forward order) holds above what precedes them: the
    parts run backward last first, each freeing its saved tensors when done, and a part's
    temporaries (:data:`BACKWARD_TEMPS`, :data:`CPU_BACKWARD_TEMPS` on ``backend`` "cpu") exist
    while it and every part before it are still saved."""
    temps = CPU_BACKWARD_TEMPS if backend == "cpu" else BACKWARD_TEMPS
    held, peak = sum(b for _, b in parts), 0.0
    for kind, saved in reversed(parts):
        peak = max(peak, held + temps[kind] * saved)
        held -= saved
    return peak
