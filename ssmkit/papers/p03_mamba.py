r"""Note 03, Mamba: what papers/03_mamba.ipynb calls. "Mamba: Linear-Time Sequence Modeling with
Selective State Spaces" (Gu & Dao 2023, arXiv 2312.00752).

The paper's one idea, selection: the SSM's step Δ and its input and output maps B, C become
functions of the input, so the recurrence (the paper's Algorithm 2, "S6")

$$ h_t = \bar A_t h_{t-1} + \bar B_t x_t, \quad y_t = C_t^\top h_t, \qquad
   \bar A_t = \exp(\Delta_t A), \quad \bar B_t = \Delta_t B_t $$

can choose, token by token, what to write into its state and what to forget; a linear
time-invariant (LTI) SSM such as S4 applies the same \bar A, \bar B to every token and cannot. The
price is that the recurrence is no longer a convolution; the paper computes it with a parallel
scan (ssmkit: :func:`ssmkit.ops.selective_scan`, backends ``reference`` = the literal loop and
``torch`` = a fused loop with a hand-written backward).

Glossary: Δ = ``delta`` (per channel and token), A = ``A`` (dim, N), N = ``d_state``, x = ``u``;
"S6" = the selective scan, "LTI" = the ``s4d`` mixer.
"""

from __future__ import annotations

import torch

from .. import checks
from ..data import make_task
from ..env import torch_threads
from ..eval import answer_accuracy
from ..models import ModelConfig, build_model
from ..ops import selective_scan
from ..train import train_each, train_on_task
from ..workbook.params import DEVICE, Param, Parameters, check_out_dir
from .claims import MIN_SEEDS, Claim, ClaimBook

TITLE = "Mamba: selective state spaces (Gu & Dao 2023)"
ARXIV = "2312.00752"
PAPER = "Mamba (Gu & Dao 2023)"
QUESTION = (
    "Does making the SSM's step Δ and its maps B, C depend on the input (selection) let a "
    "recurrent model do what a time-invariant one cannot: copy selectively, and recall by content "
    "at lengths it never saw?"
)

# The recipes, fixed before any run; the claims below are judged only at these sizes or larger.
# CPU-sized: the paper's tasks are 4096 (copying) and 256 (induction) tokens long; here both are
# shorter because the scan is a Python loop over time on a CPU (see the note's CPU box).
SC_STEPS = 400
SC = dict(vocab_size=16, seq_len=32, n_tokens=4)
SC_BATCH, SC_LR = 32, 3e-3
IH_STEPS = 150
IH_TRAIN_LEN = 32
IH_BATCH, IH_LR = 64, 1e-2
IH_LENGTHS = (32, 128, 512, 1024)
IH_TEST = 64  # held-out sequences per length
MODEL = dict(d_model=64, n_layer=2, vocab_size=16)

CLAIMS = [
    Claim("scan-loop", PAPER, "Section 3.2, Algorithm 2 (S6)", "identity",
          "the selective recurrence written as a loop in this note equals ssmkit's reference scan"),
    Claim("scan-torch", PAPER, "Section 3.3 (the hardware-aware scan)", "identity",
          "the fused scan (backend 'torch') equals the literal recurrence (backend 'reference')"),
    Claim("scan-gradients", PAPER, "Section 3.3 (recomputation in the backward pass)", "identity",
          "the fused scan's hand-written backward gives the gradients of x, Δ, A, B, C, D and z "
          "that autograd gives through the literal recurrence"),
    Claim("delta-reset", PAPER, "Section 3.5 (interpretation of Δ)", "identity",
          "a large Δ resets the state: h_t = Δ_t B_t x_t, the past forgotten"),
    Claim("delta-ignore", PAPER, "Section 3.5 (interpretation of Δ)", "identity",
          "a small Δ ignores the input: h_t = h_{t-1}, the state kept"),
    Claim("copying-selective", PAPER, "Section 4.1 and Table 1 (selective copying)",
          "ordering",
          "on selective copying, the selective mixer (S6, mamba1) copies better than the LTI mixer "
          "(s4d) of the same width and depth"),
    Claim("induction-extrapolates", PAPER, "Section 4.1 (induction heads, the extrapolation table)",
          "threshold",
          "Mamba trained on induction heads at one length still recalls at 4x that length "
          "(accuracy >= 0.9)"),
]  # fmt: skip


def claim_book() -> ClaimBook:
    """This note's claims, none checked yet."""
    return ClaimBook(CLAIMS)


# fmt: off
PARAMETERS = Parameters(
    Param("seeds",       [0, 1, 2],   checks.integers, "one training per seed and model "
                                                       "(claims judged on 3 or more)", minimum=0),
    Param("mamba_sc_steps", SC_STEPS, checks.integer, "training steps per selective-copying "
                                                      f"model (judged from {SC_STEPS} on)",
          minimum=1),
    Param("mamba_ih_steps", IH_STEPS, checks.integer, "training steps per induction-heads model "
                                                      f"(judged from {IH_STEPS} on)", minimum=1),
    Param("mamba_ih_lengths", list(IH_LENGTHS), checks.integers,
          "induction-heads test lengths (the first is the training length)", minimum=4),
    DEVICE,
    Param("out_dir",     "../runs/papers/03_mamba", check_out_dir,
          "where figures and claims.json go"),
)
# fmt: on


def judged(p: dict) -> bool:
    """Whether this run is the recipes' size (their steps, >= MIN_SEEDS seeds, the induction test
    reaching 4x the training length): only then are its ordering and threshold claims judged."""
    return (
        p["mamba_sc_steps"] >= SC_STEPS
        and p["mamba_ih_steps"] >= IH_STEPS
        and 4 * IH_TRAIN_LEN in p["mamba_ih_lengths"]
        and len(p["seeds"]) >= MIN_SEEDS
    )


# --- the scan ------------------------------------------------------------------------------------


def random_scan(batch=2, dim=4, dstate=8, length=32, seed=0, dtype=torch.float64) -> dict:
    """Random selective-scan inputs in ``dtype``: u, delta (> 0), z (batch, dim, L); A (dim, N) < 0;
    B, C (batch, N, L); D (dim,)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return {
        "u": rand(batch, dim, length),
        "delta": torch.nn.functional.softplus(rand(batch, dim, length) - 1),
        "A": -torch.rand(dim, dstate, generator=g, dtype=dtype) - 0.5,
        "B": rand(batch, dstate, length),
        "C": rand(batch, dstate, length),
        "D": rand(dim),
        "z": rand(batch, dim, length),
    }


def scan_gradients(backend: str, inputs: dict) -> torch.Tensor:
    """d(sum of y * a fixed random weight)/d(u, delta, A, B, C, D, z) of ``selective_scan`` on
    ``backend``, all flattened into one float64 vector."""
    leaves = {k: t.detach().clone().requires_grad_(True) for k, t in inputs.items()}
    y = selective_scan(**leaves, backend=backend)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    grads = torch.autograd.grad((y * w).sum(), list(leaves.values()))
    return torch.cat([g.flatten() for g in grads])


# --- Δ as a gate ---------------------------------------------------------------------------------


def gate_states(delta: float, length: int = 16, dstate: int = 4, seed: int = 0) -> dict:
    """One channel (A = -1 on every state) scanned ``length`` steps with a constant Δ from a random
    state h_0 (float64, ssmkit's reference scan): {"h0": (N,), "h_prev": h_{L-1}, "h_last": h_L,
    "written": Δ B_L x_L (N,)}: the state before and after the last step, and what that step wrote.
    """
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(1, 1, length, generator=g, dtype=torch.float64)
    B = torch.randn(1, dstate, length, generator=g, dtype=torch.float64)
    h0 = torch.randn(1, 1, dstate, generator=g, dtype=torch.float64)
    A = -torch.ones(1, dstate, dtype=torch.float64)
    d = torch.full_like(u, delta)
    C = torch.ones_like(B)

    def run(n):
        if n == 0:
            return h0[0, 0]
        return selective_scan(u[..., :n], d[..., :n], A, B[..., :n], C[..., :n],
                              initial_state=h0, return_final_state=True,
                              backend="reference")[1][0, 0]  # fmt: skip

    return {"h0": h0[0, 0], "h_prev": run(length - 1), "h_last": run(length),
            "written": delta * B[0, :, -1] * u[0, 0, -1]}  # fmt: skip


def gate_rows(deltas, A: float = -1.0) -> list[dict]:
    """How much of the previous state one step keeps, exp(Δ A), and the weight it gives the new
    input, Δ (the B̄ = Δ B of the discretisation), for each Δ: rows {"delta", "weight", "term"}."""
    rows = []
    for d in deltas:
        kept = torch.exp(torch.tensor(d * A, dtype=torch.float64)).item()
        rows.append({"delta": d, "weight": kept, "term": "kept: exp(ΔA)"})
        rows.append({"delta": d, "weight": d, "term": "written: Δ"})
    return rows


# --- selective copying: S6 against LTI --------------------------------------------------------


def copying_runs(seeds, steps: int, device="cpu") -> list[dict]:
    """Train the LTI mixer (s4d) and S6 (mamba1), same width and depth (MODEL), on selective
    copying (SC) once per seed (:func:`~ssmkit.train.train_each`, one thread), scored on 256
    held-out sequences: rows {"model", "seed", "accuracy", "loss", "seconds", "params"}."""
    models = {mixer: ModelConfig(**MODEL, mixer=mixer) for mixer in ("s4d", "mamba1")}
    task = make_task("selective-copying", **SC)
    return train_each(models, task, seeds, steps, device, batch=SC_BATCH, lr=SC_LR)


# --- induction heads: extrapolation --------------------------------------------------------------


def induction_runs(seeds, steps: int, lengths, device="cpu") -> list[dict]:
    """Train Mamba (mamba1, MODEL) on induction heads at IH_TRAIN_LEN once per seed, then score it
    on IH_TEST held-out sequences at each of ``lengths``: rows {"seed", "length", "accuracy"}."""
    with torch_threads(1):  # tiny models: a 2nd thread only waits
        rows = []
        for seed in seeds:
            model = build_model(ModelConfig(**MODEL, mixer="mamba1"), seed=seed).to(device)
            task = make_task("induction-heads", vocab_size=16, seq_len=IH_TRAIN_LEN)
            train_on_task(model, task, steps=steps, batch=IH_BATCH, lr=IH_LR, seed=seed, n_test=1)
            for length in lengths:
                test = make_task("induction-heads", vocab_size=16, seq_len=length)
                batch = test.split(0, IH_TEST, 10_000 + seed)[1]
                with torch.no_grad():
                    acc = answer_accuracy(model, batch, batch_size=IH_TEST)
                rows.append({"seed": seed, "length": length, "accuracy": acc})
        return rows


def at_length(rows: list[dict]) -> tuple[int, dict]:
    """The length the extrapolation claim reads, 4 x IH_TRAIN_LEN (the longest tested length when a
    smaller run does not reach it), and {seed: accuracy} there."""
    tested = sorted({r["length"] for r in rows})
    length = 4 * IH_TRAIN_LEN if 4 * IH_TRAIN_LEN in tested else tested[-1]
    return length, {r["seed"]: r["accuracy"] for r in rows if r["length"] == length}
