r"""Note 05, Mamba-3: what papers/05_mamba3.ipynb calls. "Mamba-3: Improved Sequence Modeling using
State Space Principles" (Lahoti, Li, Chen, Wang, Bick, Kolter, Dao & Gu 2026, arXiv 2603.15569).

The paper changes Mamba-2's recurrence in three ways (its abstract names them): (1) a recurrence
from a better discretisation of the continuous SSM, the exponential-trapezoidal rule; (2) a
complex-valued state, written as rotations of pairs of real state dimensions; (3) MIMO, a rank-R
state update that does more arithmetic per byte of state read in decoding. With α_t = exp(Δ_t A_t)
and λ_t = sigmoid(trap_t):

$$ h_t = \alpha_t h_{t-1} + (1-\lambda_t)\,\Delta_t\,\alpha_t\, x_{t-1} k_{t-1}^\top
        + \lambda_t\,\Delta_t\, x_t k_t^\top, \qquad y_t = h_t\, q_t, $$

$$ k_t = R(\theta_t)(B_t + b_B), \quad q_t = R(\theta_t)(C_t + b_C), \quad
   \theta_t = \theta_{t-1} + \pi \tanh(\dot\theta_t)\,\Delta_t . $$

λ = 1 is Mamba-2's exponential-Euler step (:func:`ssmkit.ops.ssd.ssd_reference`). Rotating k and q
by the absolute angle (a data-dependent rotary embedding) equals a complex state that turns by
e^{-iΔθ} each step: :func:`complex_loop` and :func:`rotated_state_loop` are that state written out,
:func:`trapezoid_loop` the recurrence as a plain loop, all three independent of ssmkit's
:mod:`ssmkit.ops.mamba3_ref`, which the note checks them against.

Glossary: Δ = ``dt``, A = ``A`` (per token here, one per head in Mamba-2), λ = sigmoid(``trap``),
θ̇ = ``angles``, N = ``dstate``, P = ``headdim``, R = ``rank`` (MIMO), S = the number of rotated
pairs (``nangles`` <= N/2), Q = ``chunk``.
"""

from __future__ import annotations

import math
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from .. import checks
from ..data import make_task
from ..env import torch_threads
from ..models import ModelConfig, build_model
from ..ops.mamba3 import mamba3_chunked, mamba3_quadratic, mamba3_step
from ..ops.mamba3_ref import mamba3_reference, zero_states
from ..ops.ssd import ssd_reference
from ..train import train_on_task
from ..workbook.params import DEVICE, Param, Parameters, check_out_dir
from .claims import MIN_SEEDS, Claim, ClaimBook

TITLE = "Mamba-3 (Lahoti et al. 2026)"
ARXIV = "2603.15569"
PAPER = "Mamba-3 (Lahoti et al. 2026)"
QUESTION = (
    "What do a trapezoidal discretisation, a complex (rotating) state and a MIMO update add to "
    "Mamba-2's recurrence, and are they still one computation in recurrent and chunked form?"
)

# The parity recipe, fixed before the first judged run (after one pilot at 150 steps, 1 layer,
# strings of up to 16 bits, lr 1e-2: no model left chance level); judged from PARITY_STEPS on.
PARITY_STEPS = 500
PARITY = dict(seq_len=12, min_bits=2)  # 2 .. 10 bits, "=", the answer
PARITY_MODEL = dict(d_model=32, n_layer=1, vocab_size=4)
PARITY_SSM = dict(d_state=16, headdim=16)
PARITY_BATCH = 32
PARITY_LR = 1e-2
# The decode-step timing, fixed before any run: one layer's state at the paper-like head shape
# (P = 64, N = 128), rank 1 against MIMO_RANK, in fp32; MIMO "does not add latency" is checked as
# a step time of at most MIMO_TIME_BOUND x the rank-1 step's for MIMO_RANK x the contractions.
STEP_SHAPE = dict(batch=4, nheads=8, headdim=64, dstate=128)
RANKS = (1, 2, 4, 8)
MIMO_RANK = 4
MIMO_TIME_BOUND = 2.0

_METHOD = "{} (method section; number not verified offline)"
CLAIMS = [
    Claim("trap-loop", PAPER, "Abstract, contribution (1): the recurrence from SSM discretisation",
          "identity",
          "the recurrence written as a plain loop in this note equals ssmkit's mamba3_reference"),
    Claim("trap-dual", PAPER, _METHOD.format("the recurrence's masked (SSD-like) form"),
          "identity",
          "the recurrence equals its masked quadratic form (L ∘ W ∘ q kᵀ) x"),
    Claim("trap-chunked", PAPER, _METHOD.format("the chunked algorithm, SISO and MIMO"),
          "identity",
          "the chunked form equals the recurrence at every chunk size tried, SISO and MIMO"),
    Claim("trap-gradients", PAPER, _METHOD.format("the chunked algorithm"), "identity",
          "the gradients of every input agree between the chunked form and the recurrence"),
    Claim("euler-limit", PAPER, _METHOD.format("exponential-Euler as the λ = 1 case"), "identity",
          "with λ = 1, no rotation, no biases and a constant A per head, Mamba-3 is Mamba-2's "
          "recurrence"),
    Claim("complex-state", PAPER,
          "Abstract, contribution (2): the complex-valued state and its rotary form", "identity",
          "a complex state turning by e^{-iΔθ} per step = a real state turned by 2x2 rotations "
          "= rotating B and C (ssmkit's rotary form)"),
    Claim("parity-mamba2", PAPER, _METHOD.format("the state-tracking experiments"), "ordering",
          "on parity, Mamba-3 is more accurate than Mamba-2 of the same size"),
    Claim("parity-rotation", PAPER, _METHOD.format("the state-tracking ablation"), "ordering",
          "on parity, Mamba-3 is more accurate than itself with the rotation switched off"),
    Claim("mimo-intensity", PAPER, _METHOD.format("MIMO's arithmetic intensity in decoding"),
          "identity",
          "the decode step's FLOPs and state bytes from the formulas equal those counted on "
          "mamba3_step's own tensors, at every rank"),
    Claim("mimo-latency", PAPER,
          "Abstract, contribution (3): MIMO without increasing decode latency", "threshold",
          f"on this CPU, a rank-{MIMO_RANK} decode step ({MIMO_RANK}x the contractions) takes at "
          f"most {MIMO_TIME_BOUND:g}x the rank-1 step's time at the same state size"),
    Claim("lm-scale", PAPER, "Abstract (arXiv v1)", "cited",
          "1.5B language models: Mamba-3 over the next best model (Gated DeltaNet) in average "
          "downstream accuracy, MIMO further",
          paper_value="+0.6 percentage points; MIMO +1.2 more (1.8 in total)"),
]  # fmt: skip


def claim_book() -> ClaimBook:
    """This note's claims, none checked yet."""
    return ClaimBook(CLAIMS)


# fmt: off
PARAMETERS = Parameters(
    Param("seeds",        [0, 1, 2],     checks.integers, "one parity training per seed and model; "
                                                          "one timing per seed (claims judged on 3 "
                                                          "or more)", minimum=0),
    Param("mamba3_steps", PARITY_STEPS,  checks.integer, "training steps per parity model (claims "
                                                         f"judged from {PARITY_STEPS} on)",
          minimum=1),
    DEVICE,
    Param("out_dir",      "../runs/papers/05_mamba3", check_out_dir,
          "where figures and claims.json go"),
)
# fmt: on


def judged(p: dict) -> bool:
    """Whether this run is the recipe's size (>= PARITY_STEPS steps, >= MIN_SEEDS seeds): only then
    are its ordering and threshold claims judged pass or fail."""
    return p["mamba3_steps"] >= PARITY_STEPS and len(p["seeds"]) >= MIN_SEEDS


# --- the recurrence, three ways -----------------------------------------------------------------


def random_mamba3(length=48, nheads=2, headdim=4, dstate=8, rank=1, nangles=None, batch=2, seed=0,
                  dtype=torch.float64) -> dict:  # fmt: skip
    """Random inputs of :func:`~ssmkit.ops.mamba3_ref.mamba3_reference`, keyed by its argument names
    in its order: x (batch, L, H, P); dt (batch, L, H) > 0; A (batch, L, H) < 0; trap (batch, L,
    H); B, C (batch, L, rank, 1, N); angles (batch, L, H, S), S = ``nangles`` (default N/4, as
    rope_fraction 0.5); B_bias, C_bias (H, rank, N); mimo_x (H, rank, P) when rank > 1. The angles
    turn by up to about a radian a step, so the rotations matter."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    out = dict(
        x=rand(batch, length, nheads, headdim),
        dt=torch.nn.functional.softplus(rand(batch, length, nheads) - 1),
        A=-torch.rand(batch, length, nheads, generator=g, dtype=dtype) - 0.2,
        trap=rand(batch, length, nheads),
        B=rand(batch, length, rank, 1, dstate),
        C=rand(batch, length, rank, 1, dstate),
        angles=2 * rand(batch, length, nheads, nangles or dstate // 4),
        B_bias=rand(nheads, rank, dstate),
        C_bias=rand(nheads, rank, dstate),
    )
    if rank > 1:
        out["mimo_x"] = rand(nheads, rank, headdim)
    return out


def turn_pairs(v: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """v (..., N) with its pairs (2i, 2i+1), i < S, turned by theta (..., S) counter-clockwise; the
    other dimensions unchanged."""
    S = theta.shape[-1]
    a, b = v[..., 0 : 2 * S : 2], v[..., 1 : 2 * S : 2]
    turned = torch.stack((a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()), -1)
    return torch.cat((turned.flatten(-2), v[..., 2 * S :]), dim=-1)


def trapezoid_loop(x, dt, A, trap, B, C, angles, B_bias, C_bias) -> torch.Tensor:
    """The exponential-trapezoidal recurrence (SISO, one group), one step at a time, straight from
    the equations in the module docstring. Shapes as :func:`random_mamba3` (rank 1); returns y
    (batch, L, H, P)."""
    b, L, H, P = x.shape
    lam, N = torch.sigmoid(trap), B.shape[-1]
    theta = x.new_zeros(b, H, angles.shape[-1])
    h, x_prev, k_prev = x.new_zeros(b, H, P, N), x.new_zeros(b, H, P), x.new_zeros(b, H, N)
    ys = []
    for t in range(L):
        theta = theta + math.pi * torch.tanh(angles[:, t]) * dt[:, t, :, None]
        k = turn_pairs(B[:, t, 0, 0, None] + B_bias[:, 0], theta)  # (b, H, N)
        q = turn_pairs(C[:, t, 0, 0, None] + C_bias[:, 0], theta)
        alpha = torch.exp(dt[:, t] * A[:, t])[..., None, None]
        prev = ((1 - lam[:, t]) * dt[:, t])[..., None, None] * alpha
        now = (lam[:, t] * dt[:, t])[..., None, None]
        h = alpha * h + prev * x_prev[..., None] * k_prev[..., None, :]
        h = h + now * x[:, t, ..., None] * k[..., None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, q))
        x_prev, k_prev = x[:, t], k
    return torch.stack(ys, dim=1)


def views(inputs: dict, chunks=(1, 4, 16, 48)) -> dict:
    """y of every view of one Mamba-3 scan: {"loop" (SISO only), "reference", "quadratic",
    "chunked Q=1", ...}, each like :func:`mamba3_reference`'s y ((batch, L, rank, H, P) for
    MIMO)."""
    out = {"reference": mamba3_reference(**inputs), "quadratic": mamba3_quadratic(**inputs)}
    if "mimo_x" not in inputs:
        out["loop"] = trapezoid_loop(**inputs)
    for q in chunks:
        out[f"chunked Q={q}"] = mamba3_chunked(**inputs, chunk_size=q)
    return out


def gradients(fn, inputs: dict) -> torch.Tensor:
    """d(sum of fn(**inputs) * a fixed random weight)/d(every input), flattened into one vector."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    y = fn(**leaves)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    grads = torch.autograd.grad((y * w).sum(), list(leaves.values()))
    return torch.cat([g.flatten() for g in grads])


def euler_limit(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(Mamba-3's y, Mamba-2's y) on the same x, Δ, B, C with λ = 1 (trap = 50: sigmoid is 1.0 in
    float64), no rotation (angles 0), no biases and A constant per head (A[0, 0]); Mamba-2's is
    :func:`~ssmkit.ops.ssd.ssd_reference`, h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_tᵀ."""
    A_head = inputs["A"][0, 0]  # (H,)
    zero = {k: torch.zeros_like(inputs[k]) for k in ("angles", "B_bias", "C_bias")}
    m3 = dict(inputs, trap=torch.full_like(inputs["trap"], 50.0), A=A_head.expand_as(inputs["A"]))
    m3.update(zero)
    y2 = ssd_reference(
        inputs["x"], inputs["dt"], A_head, inputs["B"][:, :, 0], inputs["C"][:, :, 0]
    )
    return mamba3_reference(**m3), y2


def _biased(inputs: dict, name: str) -> torch.Tensor:
    """B_t + b_B (or C's) per head, (batch, L, H, N), SISO, one group."""
    return inputs[name][:, :, 0, 0, None] + inputs[f"{name}_bias"][:, 0]


def complex_loop(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence with a complex state z (batch, H, P, N/2) in complex128, every pair rotated
    (S = N/2): b̂ = B[2i] + i B[2i+1], and each step turns the state and the trapezoid's previous-
    input term by e^{-iΔθ}: z_t = e^{-iδ_t}(α_t z_{t-1} + β_t x_{t-1} b̂_{t-1}) + γ_t x_t b̂_t,
    y_t = Re Σ conj(ĉ_t) z_t. Returns (y (batch, L, H, P), the last z)."""
    x, dt, lam = inputs["x"], inputs["dt"], torch.sigmoid(inputs["trap"])
    Bz = torch.view_as_complex(_biased(inputs, "B").unflatten(-1, (-1, 2)).contiguous())
    Cz = torch.view_as_complex(_biased(inputs, "C").unflatten(-1, (-1, 2)).contiguous())
    spin = torch.exp(-1j * math.pi * torch.tanh(inputs["angles"]) * dt[..., None])  # e^{-iδ_t}
    z = torch.zeros(*x.shape[:1], *x.shape[2:], Bz.shape[-1], dtype=torch.complex128)
    ys, prev = [], torch.zeros_like(z)
    for t in range(x.shape[1]):
        alpha = torch.exp(dt[:, t] * inputs["A"][:, t])[..., None, None]
        now = x[:, t, ..., None] * Bz[:, t, :, None, :]  # x_t b̂_tᵀ
        beta, gamma = (1 - lam[:, t]) * dt[:, t], lam[:, t] * dt[:, t]
        z = spin[:, t, :, None] * (alpha * (z + beta[..., None, None] * prev))
        z = z + gamma[..., None, None] * now
        ys.append(torch.einsum("bhps,bhs->bhp", z, Cz[:, t].conj()).real)
        prev = now
    return torch.stack(ys, dim=1), z


def rotated_state_loop(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`complex_loop` in real numbers: a state h (batch, H, P, N) whose pairs (2i, 2i+1) are
    turned by the 2x2 rotation R(-δ_t) each step; B and C are not rotated. Returns (y, the last
    h)."""
    x, dt, lam = inputs["x"], inputs["dt"], torch.sigmoid(inputs["trap"])
    Bt, Ct = _biased(inputs, "B"), _biased(inputs, "C")
    delta = math.pi * torch.tanh(inputs["angles"]) * dt[..., None]  # (batch, L, H, S)
    h = x.new_zeros(*x.shape[:1], *x.shape[2:], Bt.shape[-1])
    ys, prev = [], torch.zeros_like(h)
    for t in range(x.shape[1]):
        alpha = torch.exp(dt[:, t] * inputs["A"][:, t])[..., None, None]
        beta, gamma = (1 - lam[:, t]) * dt[:, t], lam[:, t] * dt[:, t]
        h = turn_pairs(alpha * (h + beta[..., None, None] * prev), -delta[:, t, :, None])
        prev = x[:, t, ..., None] * Bt[:, t, :, None, :]
        h = h + gamma[..., None, None] * prev
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ct[:, t]))
    return torch.stack(ys, dim=1), h


# --- parity: the rotation against Mamba-2 -------------------------------------------------------


def parity_models() -> dict[str, ModelConfig]:
    """The parity comparison's models, one width, depth and state size: Mamba-3 (its default rotary
    half of the state), Mamba-3 whose rotation :func:`without_rotation` switches off, Mamba-2."""
    m3 = ModelConfig(**PARITY_MODEL, mixer="mamba3", mamba3=PARITY_SSM)
    return {
        "mamba3": m3,
        "mamba3 no rotation": m3,
        "mamba2": ModelConfig(**PARITY_MODEL, mixer="mamba2", mamba2=PARITY_SSM),
    }


def without_rotation(model):
    """Switch off every Mamba-3 layer's rotation: the rows of in_proj that make the angles θ̇ are
    zeroed and kept at zero (their gradient is zeroed, so AdamW leaves them at 0): tanh(0) = 0, no
    turn. Returns the model."""
    for layer in model.modules():
        S = getattr(layer, "nangles", 0)
        if S and hasattr(layer, "in_proj"):
            with torch.no_grad():
                layer.in_proj.weight[-S:] = 0
            layer.in_proj.weight.register_hook(lambda g, S=S: torch.cat((g[:-S], 0 * g[-S:])))
    return model


def parity_runs(seeds, steps: int, device="cpu") -> list[dict]:
    """Train every model of :func:`parity_models` on parity (``make_task("parity", **PARITY)``)
    once per seed (:func:`train_on_task`, batch PARITY_BATCH, lr PARITY_LR) and score it on 256
    held-out strings, on one thread (:func:`ssmkit.env.torch_threads`): rows {"model", "seed",
    "accuracy", "loss", "seconds"}."""
    task = make_task("parity", **PARITY)
    with torch_threads(1):
        return [
            _parity_run(task, name, cfg, seed, steps, device)
            for name, cfg in parity_models().items()
            for seed in seeds
        ]


def _parity_run(task, name: str, cfg: ModelConfig, seed: int, steps: int, device) -> dict:
    """One model trained and scored: a row of :func:`parity_runs`."""
    model = build_model(cfg, seed=seed).to(device)
    if name.endswith("no rotation"):
        without_rotation(model)
    fit = train_on_task(model, task, steps=steps, batch=PARITY_BATCH, lr=PARITY_LR, seed=seed)
    return {"model": name, "seed": seed, **{k: fit[k] for k in ("accuracy", "loss", "seconds")}}


# --- MIMO: arithmetic intensity of the decode step ----------------------------------------------


def step_flops(N: int, P: int, R: int) -> int:
    """The contractions of one decode step per head: R outer products x_r k_rᵀ for the new input, R
    for the trapezoid's previous one, R reads h q_r, each P·N multiply-adds: 6·R·P·N FLOPs (the
    elementwise decay and weights, ~5·P·N more, are not counted)."""
    return 6 * R * P * N


def step_bytes(N: int, P: int, R: int, S: int, itemsize: int = 4) -> int:
    """Bytes of decode state per head, read and written once each step: h (P·N), the last rotated
    k (R·N), the last input x (P) and the angles (S)."""
    return 2 * itemsize * (P * N + R * N + P + S)


def intensity(N: int, P: int, R: int, S: int) -> float:
    """FLOPs per byte of state moved in one decode step (fp32): grows about linearly in R, the
    state's size does not change."""
    return step_flops(N, P, R) / step_bytes(N, P, R, S)


def decode_inputs(rank: int, batch, nheads, headdim, dstate, seed=0, dtype=torch.float32):
    """(states, inputs) of one :func:`~ssmkit.ops.mamba3.mamba3_step` at the given shape (one group,
    S = N/4): the states are the state after a random prefix."""
    one = random_mamba3(1, nheads, headdim, dstate, rank, None, batch, seed, dtype)
    states = zero_states(one["x"][:, 0], rank, dstate, one["angles"].shape[-1])
    for s in states:
        s.normal_(generator=torch.Generator().manual_seed(seed))
    inputs = {k: v if k in ("B_bias", "C_bias", "mimo_x") else v[:, 0] for k, v in one.items()}
    return states, inputs


def counted_step(rank: int, batch=2, nheads=2, headdim=8, dstate=16) -> dict:
    """The step's FLOPs as torch counts them (FlopCounterMode: every matmul / einsum) and its state
    bytes as its tensors hold them (read + written), next to the formulas: {"rank", "flops",
    "formula flops", "bytes", "formula bytes"}."""
    states, inputs = decode_inputs(rank, batch, nheads, headdim, dstate)
    S = states.angle.shape[-1]
    with FlopCounterMode(display=False) as counter:
        mamba3_step(states, **inputs, backend="torch")
    heads = batch * nheads
    return {
        "rank": rank,
        "flops": counter.get_total_flops(),
        "formula flops": heads * step_flops(dstate, headdim, rank),
        "bytes": 2 * sum(s.nbytes for s in states),
        "formula bytes": heads * step_bytes(dstate, headdim, rank, S, states.ssm.element_size()),
    }


def counted_vs_formula(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(counted, formula) as int64 vectors from rows of :func:`counted_step`: the state bytes at
    every rank and the FLOPs at rank >= 2 (at rank 1 the contraction over r has length 1 and torch
    runs it as a broadcast multiply, which FlopCounterMode does not count)."""
    pick = [(r["bytes"], r["formula bytes"]) for r in rows]
    pick += [(r["flops"], r["formula flops"]) for r in rows if r["rank"] > 1]
    return torch.tensor([c for c, _ in pick]), torch.tensor([f for _, f in pick])


def time_steps(seeds, ranks=RANKS, shape=STEP_SHAPE, n: int = 30) -> list[dict]:
    """Milliseconds of one :func:`mamba3_step` (fp32, no grad, one thread) at each rank, the state
    size fixed (P, N of ``shape``): per seed the fastest of ``n`` rounds, each round stepping every
    rank once (interleaved, so a busy moment of the machine hits every rank alike). Rows {"rank",
    "seed", "ms", "intensity"}."""
    rows = []
    for seed in seeds:
        made = {rank: decode_inputs(rank, **shape, seed=seed) for rank in ranks}
        best = dict.fromkeys(ranks, math.inf)
        with torch.no_grad(), torch_threads(1):
            for _ in range(n):
                for rank, (states, inputs) in made.items():
                    start = time.perf_counter()
                    mamba3_step(states, **inputs, backend="torch")
                    best[rank] = min(best[rank], time.perf_counter() - start)
        for rank, (states, _) in made.items():
            S = states.angle.shape[-1]
            ratio = intensity(shape["dstate"], shape["headdim"], rank, S)
            rows.append({"rank": rank, "seed": seed, "ms": 1e3 * best[rank], "intensity": ratio})
    return rows


def latency_ratios(rows: list[dict], rank: int = MIMO_RANK) -> dict:
    """{seed: step time at ``rank`` / step time at rank 1} from :func:`time_steps`."""
    ms = {(r["seed"], r["rank"]): r["ms"] for r in rows}
    return {s: ms[(s, rank)] / ms[(s, 1)] for s, _ in ms if (s, rank) in ms}
