r"""Note 02, H3: what papers/02_h3.ipynb calls. "Hungry Hungry Hippos: Towards Language Modeling
with State Space Models" (Fu, Dao, Saab, Thomas, Rudra & Ré 2022, arXiv 2212.14052).

The paper's layer (section 3.1, figure 1) puts two SSMs and two multiplicative interactions between
projections Q = x W_Q, K = x W_K, V = x W_V, per head h:

$$ \bar K = \mathrm{SSM}_{shift}(K), \qquad
   O_h = Q_h^\top\, \mathrm{SSM}_{diag}\!\left(\bar K_h V_h^\top\right), \qquad y = O W_O . $$

The shift SSM's A shifts the state down by one and B = e₁, so its state is the last W inputs and
its kernel is C itself (a short convolution): it lets a token see the few before it (the key just
before a value). The diagonal SSM (S4D's) remembers the products k vᵀ over the whole sequence;
the query reads them out: associative recall, which one LTI SSM alone cannot do.

ssmkit implements the layer in :mod:`ssmkit.models.h3` (fp32 inside) and the shift SSM in
:func:`ssmkit.ops.shift_ssm`; this module adds :func:`h3_convolution64`, the layer's convolutional
form recomputed in float64 from its parameters with :mod:`ssmkit.ops`, for the note's identity
against the recurrence it writes as a loop, and the recall and language-model runs.

Glossary: Q, K, V = ``q``, ``k``, ``v``; K̄ = the shift SSM's output (``kbar``); H = heads,
p = ``head_dim``; N = ``d_state`` (N/2 complex modes); W = ``shift_size``; Ā, B̄ = ``Ab``, ``Bb``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import checks, ops
from ..data import make_task
from ..env import torch_threads
from ..models import ModelConfig, build_model, matched_transformer
from ..models.h3 import H3
from ..models.ssm_config import H3Config
from ..train import train_each
from ..workbook.params import DEVICE, Param, Parameters, check_out_dir
from .claims import MIN_SEEDS, Claim, ClaimBook

TITLE = "H3: Hungry Hungry Hippos (Fu, Dao et al. 2022)"
ARXIV = "2212.14052"
PAPER = "H3 (Fu, Dao, Saab, Thomas, Rudra & Ré 2022, arXiv 2212.14052)"
QUESTION = (
    "What does an SSM layer need to recall like attention does, and does a hybrid with a few "
    "attention layers then model language as well as a Transformer?"
)

# The associative-recall recipe, fixed before the judged run: 10 key-value pairs, one query; two
# layers of width 32; H3 (head_dim 1, as H3's code) against S4D, the same depth and width.
AR = dict(vocab_size=21, seq_len=22)
AR_MODEL = dict(d_model=32, n_layer=2, vocab_size=21)
AR_STEPS = 200
# The language-model recipe: preset tiny-h3 (4 layers of width 64, attention in layers 1 and 3)
# against ssmkit.models.matched_transformer of it, byte-level, on the embedded corpus.
LM = dict(model="tiny-h3", data="stdlib-docs", tokenizer="byte", seq_len=128, batch_tokens=2048,
          micro_batch=16, warmup_steps=4, eval_every=0, eval_batches=4, log_every=10,
          ckpt_every=0, overwrite=True, progress=False)  # fmt: skip
LM_STEPS = 40

CLAIMS = [
    Claim("shift-register", PAPER, "Section 3.1 (the shift SSM)", "identity",
          "the shift SSM (A = shift, B = e₁) run as an SSM equals a shift register of the last W "
          "inputs read out by C"),
    Claim("h3-loop", PAPER, "Section 3.1 and Figure 1 (the H3 layer)", "identity",
          "the H3 layer's recurrence, written as a loop in the note, equals its convolutional "
          "form (FFT kernels), in float64"),
    Claim("h3-module", PAPER, "Section 3.1 and Figure 1 (the H3 layer)", "threshold",
          "ssmkit's H3 layer (fp32 inside) matches the note's float64 loop to 1e-5 relative"),
    Claim("ar-h3-s4d", PAPER, "Section 3.1 and Table 1 (associative recall)", "ordering",
          "on associative recall, H3 recalls better than S4D alone (same depth and width)"),
    Claim("lm-hybrid", PAPER, "Section 3.3 / 5.1 (H3 hybrid language models)", "ordering",
          "a small H3 hybrid with 2 attention layers reaches a lower validation loss than a "
          "Transformer of matched size, trained alike on the same tokens"),
]  # fmt: skip


def claim_book() -> ClaimBook:
    """This note's claims, none checked yet."""
    return ClaimBook(CLAIMS)


# fmt: off
PARAMETERS = Parameters(
    Param("seeds",       [0, 1, 2],   checks.integers, "one layer / training per seed and model "
                                                       "(claims judged on 3 or more)", minimum=0),
    Param("h3_ar_steps", AR_STEPS,    checks.integer, "training steps per recall model (claims "
                                                      f"judged from {AR_STEPS} on)", minimum=1),
    Param("h3_lm_steps", LM_STEPS,    checks.integer, "training steps per language model (claims "
                                                      f"judged from {LM_STEPS} on)", minimum=1),
    DEVICE,
    Param("out_dir",     "../runs/papers/02_h3", check_out_dir,
          "where figures and claims.json go"),
)
# fmt: on


def judged(p: dict) -> bool:
    """Whether this run is the recipe's size (>= AR_STEPS and LM_STEPS steps, >= MIN_SEEDS seeds):
    only then are its ordering and threshold claims judged pass or fail."""
    return (
        p["h3_ar_steps"] >= AR_STEPS
        and p["h3_lm_steps"] >= LM_STEPS
        and len(p["seeds"]) >= MIN_SEEDS
    )


# --- the layer, two ways --------------------------------------------------------------------------


def small_layer(seed: int = 0, d_model: int = 8, head_dim: int = 2, d_state: int = 4, shift=3):
    """A freshly initialised H3 layer (H = d_model / head_dim heads), its Δ and C randomised so
    every mode matters, and an input x (2, 24, d_model) float64."""
    torch.manual_seed(seed)
    cfg = H3Config(d_state=d_state, head_dim=head_dim, shift_size=shift, dt_min=0.05, dt_max=0.5)
    layer = H3(d_model, cfg)
    x = torch.randn(2, 24, d_model, dtype=torch.float64)
    return layer, x


def linear64(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module`` applied in float64: x (..., in) -> (..., out)."""
    bias = None if module.bias is None else module.bias.double()
    return F.linear(x, module.weight.double(), bias)


def diagonal64(layer: H3):
    """The diagonal SSM's (Ā, B̄, C), each (H, N/2) complex128: A = -exp(log_A_real) + i A_imag
    and B = 1 discretised with Δ = exp(log_dt) (the layer's method)."""
    ssm = layer.ssm
    A = torch.complex(-torch.exp(ssm.log_A_real.double()), ssm.A_imag.double())
    Ab, Bb = ops.discretize(A, torch.ones_like(A), torch.exp(ssm.log_dt.double()), ssm.disc)
    return Ab, Bb, torch.view_as_complex(ssm.C.double().contiguous())


def shift_taps(layer: H3) -> torch.Tensor:
    """The shift SSM's C per channel, (d_model, W) float64: tap l weighs the input l steps back
    (the conv stores it at index W - 1 - l)."""
    return layer.shift_conv.weight.double()[:, 0].flip(-1)


@torch.no_grad()
def h3_convolution64(layer: H3, x: torch.Tensor) -> torch.Tensor:
    """The H3 layer in its convolutional form, in float64: x (b, L, d) -> (b, L, d).
    K̄ = shift kernel * K + D_shift K; per head, y = K̄_diag * (K̄_h V_hᵀ) + D (K̄_h V_hᵀ);
    out = W_O (Q_hᵀ y)."""
    b, L, d = x.shape
    H, p = layer.nheads, layer.head_dim
    q, k, v = (linear64(m, x) for m in (layer.q_proj, layer.k_proj, layer.v_proj))
    taps = F.pad(shift_taps(layer), (0, L - layer.shift_size))  # (d, L): the shift SSM's kernel
    kbar = ops.ssm_convolve(taps, k.transpose(1, 2)).transpose(1, 2) + layer.shift_D.double() * k
    kv = torch.einsum("blhi,blhj->bijhl", kbar.view(b, L, H, p), v.view(b, L, H, p))
    Ab, Bb, C = diagonal64(layer)
    K = 2 * ops.kernel_vandermonde(Ab, Bb, C, L).real  # (H, L)
    y = ops.ssm_convolve(K, kv) + layer.D.double()[:, None] * kv
    out = torch.einsum("blhi,bijhl->blhj", q.view(b, L, H, p), y)
    return linear64(layer.out_proj, out.flatten(-2))


# --- associative recall: H3 against S4D ----------------------------------------------------------


def ar_models() -> dict[str, ModelConfig]:
    """H3 (head_dim 1, N = 16, W = 4) and S4D (N = 16), both 2 layers of width 32, no attention."""
    return {
        "h3": ModelConfig(**AR_MODEL, mixer="h3", h3={"d_state": 16, "head_dim": 1,
                                                       "shift_size": 4}),
        "s4d": ModelConfig(**AR_MODEL, mixer="s4d", s4d={"d_state": 16}),
    }  # fmt: skip


def ar_runs(seeds, steps: int, device="cpu") -> list[dict]:
    """Train each of :func:`ar_models` on associative recall once per seed (batch 32, lr 3e-3;
    :func:`~ssmkit.train.train_each`, one thread), scored on 256 held-out sequences: rows
    {"model", "seed", "accuracy", "loss", "seconds", "params"}."""
    task = make_task("associative-recall", **AR)
    return train_each(ar_models(), task, seeds, steps, device, batch=32, lr=3e-3)


# --- language modelling: the hybrid against a Transformer ---------------------------------------


def lm_runs(seeds, steps: int, out_dir, device="cpu") -> list[dict]:
    """Train the tiny-h3 hybrid and :func:`~ssmkit.models.matched_transformer` of it with
    ssmkit's Trainer (the LM recipe, ``steps`` steps of 2048 tokens, byte-level on the embedded
    corpus), once per seed; each one's validation loss at the end: rows {"model", "seed",
    "val_loss", "params"}."""
    with torch_threads(1):  # tiny models: a 2nd thread only waits
        from ..eval import summarize_run
        from ..train import TrainConfig, Trainer

        rows = []
        for seed in seeds:
            cfg = TrainConfig(**LM, max_steps=steps, seed=seed, device=device)
            hybrid = build_model(cfg.model_config(vocab_size=257), seed=seed)  # byte: 256 + EOS
            torch.manual_seed(seed)
            models = {"h3 hybrid": hybrid, "transformer": matched_transformer(hybrid, cfg.seq_len)}
            for name, model in models.items():
                run_cfg = dataclasses.replace(cfg, out_dir=f"{out_dir}/lm/{name.split()[0]}-{seed}")
                run = summarize_run(Trainer(model, run_cfg, name=name).fit())
                params = sum(t.numel() for t in model.parameters())
                rows.append({"model": name, "seed": seed, "val_loss": run["val_loss"],
                             "params": params})  # fmt: skip
        return rows
