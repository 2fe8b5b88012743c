r"""Note 04, Mamba-2: what papers/04_mamba2.ipynb calls. "Transformers are SSMs: Generalized Models
and Efficient Algorithms Through Structured State Space Duality" (Dao & Gu 2024, arXiv 2405.21060).

The paper's one idea, state space duality (SSD): a selective SSM whose state matrix is a scalar
times the identity, a_t I, computes

$$ h_t = a_t h_{t-1} + \Delta_t x_t B_t^\top, \quad y_t = h_t C_t
   \qquad\Longleftrightarrow\qquad
   y = (L \circ C B^\top)(\Delta x), \quad L_{ts} = a_{s+1} \cdots a_t \ (t \ge s) $$

a linear recurrence on the left, a masked "attention" on the right (L is 1-semiseparable). The
chunked SSD algorithm (the paper's section 6) uses the quadratic form inside chunks of Q steps and
the recurrence between them. ssmkit implements the three views in :mod:`ssmkit.ops.ssd`; this
module adds a fourth, :func:`ssd_minimal`, the paper's short listing of the chunked algorithm
re-derived from its four steps, so the note checks the library against an independent copy.

Glossary: Δ = ``dt``, a_t = exp(Δ_t A), N = ``d_state``, P = ``headdim``, Q = ``chunk``.
"""

from __future__ import annotations

import math
import time

import torch

from .. import checks
from ..data import make_task
from ..models import ModelConfig
from ..ops.ssd import segsum, ssd_chunked, ssd_quadratic, ssd_reference
from ..train import train_each
from ..workbook.params import DEVICE, Param, Parameters, check_out_dir
from .claims import MIN_SEEDS, Claim, ClaimBook

TITLE = "Mamba-2 / SSD (Dao & Gu 2024)"
ARXIV = "2405.21060"
PAPER = "Mamba-2 (Dao & Gu 2024)"
QUESTION = (
    "Is a selective SSM with a scalar decay the same computation as a masked, attention-like "
    "quadratic form, and what does that duality buy?"
)

# The MQAR recipe, fixed before any run: the claims below are judged only at this size or larger.
MQAR_STEPS = 200
MQAR = dict(vocab_size=64, seq_len=64, num_kv_pairs=8)
MQAR_MODEL = dict(d_model=64, n_layer=2, vocab_size=64)
STATE_SIZES = (16, 128)
MQAR_BATCH = 16

CLAIMS = [
    Claim("ssd-dual", PAPER, "Section 5 (state space duality)", "identity",
          "the scalar-decay SSM's recurrence equals its masked quadratic form (L ∘ C Bᵀ)(Δ x)"),
    Claim("ssd-chunked", PAPER, "Section 6 (the SSD algorithm)", "identity",
          "the chunked algorithm equals the recurrence, for every chunk size tried"),
    Claim("ssd-minimal", PAPER, "Section 6, Listing 1 (the minimal SSD code)", "identity",
          "the paper's minimal chunked algorithm, re-derived in this note, equals ssmkit's"),
    Claim("ssd-gradients", PAPER, "Section 6 (the SSD algorithm)", "identity",
          "the gradients of x, Δ, A, B and C agree between the recurrence and the chunked form"),
    Claim("segsum-stable", PAPER, "Section 6, Listing 1 (segsum)", "threshold",
          "in float32 the stable segment sum keeps the decay mask L to 1e-5 relative at L = 2048"),
    Claim("segsum-naive", PAPER, "Section 6, Listing 1 (segsum)", "threshold",
          "in float32 the naive segment sum (a difference of prefix sums) is at least 10x less "
          "accurate than the stable one at L = 2048"),
    Claim("cost-scaling", PAPER, "Section 6 (cost of the quadratic and the chunked forms)",
          "threshold",
          "the quadratic form's time grows faster in L than the chunked form's (log-log slope "
          "larger by >= 0.4 between the shortest and the longest length)"),
    Claim("mqar-state", PAPER, "Section 9.1 (synthetic associative recall)", "ordering",
          "on MQAR, Mamba-2 with state size N = 128 recalls better than with N = 16"),
    Claim("mqar-mamba1", PAPER, "Section 9.1 (synthetic associative recall)", "ordering",
          "on MQAR, Mamba-2 recalls better than Mamba-1 of the same width, depth and state size "
          "(N = 16)"),
]  # fmt: skip


def claim_book() -> ClaimBook:
    """This note's claims, none checked yet."""
    return ClaimBook(CLAIMS)


# fmt: off
PARAMETERS = Parameters(
    Param("seeds",       [0, 1, 2],   checks.integers, "one MQAR training per seed and model "
                                                       "(claims judged on 3 or more)", minimum=0),
    Param("mqar_steps",  MQAR_STEPS,  checks.integer, "training steps per MQAR model (claims "
                                                      f"judged from {MQAR_STEPS} on)", minimum=1),
    Param("lengths",     [256, 512, 1024, 2048], checks.integers,
          "sequence lengths timed for each form's cost", minimum=8),
    DEVICE,
    Param("out_dir",     "../runs/papers/04_mamba2", check_out_dir,
          "where figures and claims.json go"),
)
# fmt: on


def judged(p: dict) -> bool:
    """Whether this run is the recipe's size (>= MQAR_STEPS steps, >= MIN_SEEDS seeds): only then
    are its ordering claims judged pass or fail."""
    return p["mqar_steps"] >= MQAR_STEPS and len(p["seeds"]) >= MIN_SEEDS


# --- the four views of one computation -----------------------------------------------------------


def random_ssd(length=64, nheads=2, headdim=4, dstate=8, batch=2, seed=0, dtype=torch.float64):
    """Random SSD inputs: x (batch, L, H, P), dt (batch, L, H) > 0, A (H,) < 0, B and C
    (batch, L, 1, N), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    x = rand(batch, length, nheads, headdim)
    dt = torch.nn.functional.softplus(rand(batch, length, nheads) - 1)
    A = -torch.rand(nheads, generator=g, dtype=dtype) - 0.5
    return x, dt, A, rand(batch, length, 1, dstate), rand(batch, length, 1, dstate)


def ssd_minimal(x, dt, A, B, C, chunk: int):
    """The chunked SSD in the paper's four steps (section 6), written from the equations.

    x: (b, L, H, P); dt: (b, L, H); A: (H,); B, C: (b, L, 1, N); L a multiple of ``chunk``.
    Returns y (b, L, H, P) and the final state (b, H, P, N).

    1. inside each chunk, the quadratic form (L ∘ C Bᵀ)(Δ x);
    2. each chunk's final state from its own inputs;
    3. the states passed from chunk to chunk by the recurrence h_c = (decay of chunk c-1) h_{c-1}
       + state_{c-1}, itself an SSM over chunks (its mask is segsum of the chunk totals);
    4. each position reads the state entering its chunk, decayed to it, through C.
    """
    b, length, H, P = x.shape
    c = length // chunk
    if c * chunk != length:
        raise ValueError(f"length {length} is not a multiple of chunk {chunk}")
    X = (x * dt[..., None]).reshape(b, c, chunk, H, P)
    Bc = B[:, :, 0].reshape(b, c, chunk, -1)
    Cc = C[:, :, 0].reshape(b, c, chunk, -1)
    logA = (dt * A).reshape(b, c, chunk, H).permute(0, 3, 1, 2)  # (b, H, c, l)
    cum = torch.cumsum(logA, dim=-1)
    mask = torch.exp(segsum(logA))  # (b, H, c, l, s)
    y_diag = torch.einsum("bcln,bcsn,bhcls,bcshp->bclhp", Cc, Bc, mask, X)  # step 1
    to_end = torch.exp(cum[..., -1:] - cum)  # decay from each step to its chunk's end
    states = torch.einsum("bcln,bhcl,bclhp->bchpn", Bc, to_end, X)  # step 2
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)  # h entering chunk 0
    across = torch.exp(segsum(torch.nn.functional.pad(cum[..., -1], (1, 0))))  # (b, H, c+1, c+1)
    states = torch.einsum("bhzc,bchpn->bzhpn", across, states)  # step 3
    entering, final = states[:, :-1], states[:, -1]
    y_off = torch.einsum("bcln,bchpn,bhcl->bclhp", Cc, entering, torch.exp(cum))  # step 4
    return (y_diag + y_off).reshape(b, length, H, P), final


def views(x, dt, A, B, C, chunks=(4, 16, 64)) -> dict:
    """y of every view of the SSD: {"recurrence", "quadratic", "chunked Q=4", ..., "minimal Q=..."}
    (tensors like x)."""
    out = {"recurrence": ssd_reference(x, dt, A, B, C), "quadratic": ssd_quadratic(x, dt, A, B, C)}
    for q in chunks:
        out[f"chunked Q={q}"] = ssd_chunked(x, dt, A, B, C, chunk_size=q)
        if x.shape[1] % q == 0:
            out[f"minimal Q={q}"] = ssd_minimal(x, dt, A, B, C, q)[0]
    return out


def gradients(fn, inputs) -> list[torch.Tensor]:
    """d(sum of fn(*inputs) * a fixed random weight)/d(each input), float64."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*inputs)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    return list(torch.autograd.grad((y * w).sum(), inputs))


# --- segment sums: naive and stable ---------------------------------------------------------------


def naive_segsum(a: torch.Tensor) -> torch.Tensor:
    """out[t, s] = cumsum(a)[t] - cumsum(a)[s] for t >= s, -inf above: the obvious way, which
    subtracts two large prefix sums to get a small difference. a: (..., T) -> (..., T, T)."""
    cum = torch.cumsum(a, dim=-1)
    out = cum[..., :, None] - cum[..., None, :]
    causal = torch.ones(a.shape[-1], a.shape[-1], dtype=torch.bool).tril()
    return out.masked_fill(~causal, -math.inf)


def mask_errors(length: int = 2048, seed: int = 0) -> dict:
    """Relative error of the decay mask exp(segsum(log a)) in float32, naive and stable, against
    float64: {"naive": max |L32 - L64| / max |L64|, "stable": ...}. log a ~ -U(0.5, 1.5) per step,
    so prefix sums reach about -length."""
    g = torch.Generator().manual_seed(seed)
    log_a = -(torch.rand(length, generator=g, dtype=torch.float64) + 0.5)
    truth = torch.exp(segsum(log_a))
    out = {}
    for name, fn in (("naive", naive_segsum), ("stable", segsum)):
        approx = torch.exp(fn(log_a.float())).double()
        out[name] = ((approx - truth).abs().max() / truth.abs().max()).item()
    return out


# --- cost against length --------------------------------------------------------------------------


def time_views(lengths, repeats: int = 3, nheads=4, headdim=16, dstate=16) -> list[dict]:
    """Seconds of one forward pass of the quadratic and the chunked (Q = 64) forms at each length
    (float32, batch 1; best of 3 per repetition): rows {"form", "length", "seconds", "repeat"}."""
    rows = []
    forms = {"quadratic": ssd_quadratic, "chunked": lambda *t: ssd_chunked(*t, chunk_size=64)}
    for r in range(repeats):
        for length in lengths:
            inputs = random_ssd(length, nheads, headdim, dstate, 1, r, torch.float32)
            for form, fn in forms.items():
                best = math.inf
                for _ in range(3):
                    start = time.perf_counter()
                    with torch.no_grad():
                        fn(*inputs)
                    best = min(best, time.perf_counter() - start)
                rows.append({"form": form, "length": length, "seconds": best, "repeat": r})
    return rows


def slope(rows: list[dict], form: str, repeat: int) -> float:
    """The log-log slope of time against length between the shortest and the longest length."""
    pts = sorted((r["length"], r["seconds"]) for r in rows if r["form"] == form
                 and r["repeat"] == repeat)  # fmt: skip
    (l0, t0), (l1, t1) = pts[0], pts[-1]
    return math.log(t1 / t0) / math.log(l1 / l0)


# --- MQAR: state size, and Mamba-2 against Mamba-1 ------------------------------------------------


def mqar_models() -> dict[str, ModelConfig]:
    """The models of the MQAR comparison: Mamba-2 at each of STATE_SIZES and Mamba-1 (N = 16),
    the same width and depth."""
    out = {
        f"mamba2 N={n}": ModelConfig(
            **MQAR_MODEL, mixer="mamba2", mamba2={"d_state": n, "headdim": 32, "chunk_size": 64}
        )
        for n in STATE_SIZES
    }
    out["mamba1 N=16"] = ModelConfig(**MQAR_MODEL, mixer="mamba1", mamba1={"d_state": 16})
    return out


def mqar_runs(seeds, steps: int, device="cpu") -> list[dict]:
    """Train every model of :func:`mqar_models` on MQAR once per seed (batch MQAR_BATCH, lr 3e-3;
    :func:`~ssmkit.train.train_each`, one thread), scored on 256 held-out sequences: rows
    {"model", "d_state", "seed", "accuracy", "loss", "seconds", "params"}."""
    task = make_task("mqar", **MQAR)
    rows = train_each(mqar_models(), task, seeds, steps, device, batch=MQAR_BATCH, lr=3e-3)
    for row in rows:  # "mamba2 N=16" -> model "mamba2", d_state 16
        name = row["model"]
        row["model"], row["d_state"] = name.split()[0], int(name.split("=")[1])
    return rows
