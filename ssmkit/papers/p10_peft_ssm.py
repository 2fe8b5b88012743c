r"""Note 10, PEFT for SSMs: what papers/10_peft_ssm.ipynb calls. "Parameter-Efficient Fine-Tuning
of State Space Models" (Galim et al. 2024, arXiv 2410.09016).

LoRA (Hu et al. 2021) freezes a weight W (out, in) and trains a low-rank update,

$$ W' = W + \tfrac{\alpha}{r} B A, \qquad A \in \mathbb R^{r \times in},\ B \in \mathbb R^{out
   \times r},\ B = 0 \text{ at the start}, $$

r·(in + out) trainable numbers per adapted matrix. The paper asks *which* matrices of a Mamba
layer to adapt: the linear projections (``in_proj``, ``out_proj``: the channel mixing around the
SSM) or the S6 parameters (``x_proj``, which makes Δ's low-rank input, B_t and C_t from x_t, and
``dt_proj``, which lifts Δ to every channel):

$$ (\Delta_t^{low}, B_t, C_t) = x_t W_x^\top, \qquad \Delta_t = \operatorname{softplus}(
   \Delta_t^{low} W_\Delta^\top + b_\Delta), \qquad h_t = e^{\Delta_t A} h_{t-1} + \Delta_t B_t
   x_t . $$

Its finding: LoRA is effective on the linear projections and not on the SSM modules.

This note pretrains one tiny Mamba-1 on a synthetic task, then fine-tunes it on a shifted version
of the task both ways with ``ssmkit.finetune.apply_lora`` (peft), the ranks chosen so both adapters
train the same number of parameters.

Glossary: r = LoRA rank, α = ``lora_alpha``, d_inner = expand·d_model, R = ``dt_rank``, N = d_state.
"""

from __future__ import annotations

import copy
import math

from .. import checks
from ..data import make_task
from ..env import torch_threads
from ..eval import answer_accuracy
from ..finetune import apply_lora, parameter_counts
from ..models import ModelConfig, build_model
from ..train import train_on_task
from ..workbook.params import DEVICE, Param, Parameters, check_out_dir
from .claims import MIN_SEEDS, Claim, ClaimBook

TITLE = "Parameter-efficient fine-tuning of SSMs (Galim et al. 2024)"
ARXIV = "2410.09016"
PAPER = "PEFT for SSMs (Galim et al. 2024)"
QUESTION = (
    "Which matrices of a Mamba layer should LoRA adapt: the linear projections or the SSM's own "
    "parameters?"
)

# The recipe, fixed before any run: the claim below is judged only at this size or larger.
PEFT_PRETRAIN_STEPS = 200
PEFT_STEPS = 100
BASE_MODEL = dict(d_model=32, n_layer=2, vocab_size=16, mixer="mamba1", mamba1={"d_state": 8})
PRETRAIN_TASK = dict(vocab_size=16, seq_len=32, n_tokens=4)  # selective copying
SHIFTED_TASK = dict(vocab_size=16, seq_len=48, n_tokens=6)  # longer, more tokens to copy
PRETRAIN = dict(batch=32, lr=3e-3)
FINETUNE = dict(batch=32, lr=3e-3)
# Ranks per matrix, chosen so both adapters train the same count per layer (see adapter_size):
# linear: in_proj (2·d_inner × d_model) r 5 + out_proj (d_model × d_inner) r 4;
# SSM: x_proj ((R + 2N) × d_inner) r 8 + dt_proj (d_inner × R) r 8.
RANKS = {
    "linear": {"in_proj": 5, "out_proj": 4},
    "ssm": {"x_proj": 8, "dt_proj": 8},
}
ALPHA_PER_RANK = 2  # α = 2r for every matrix (the plan's r 16, α 32), so α/r is the same

CLAIMS = [
    Claim("lora-counts", PAPER, "Section 4 (LoRA on linear projections vs on SSM modules)",
          "identity",
          "peft's trainable parameters equal Σ r·(in + out) over the adapted matrices, and the two "
          "adapters (linear projections, S6 parameters) train the same number"),
    Claim("lora-linear-vs-ssm", PAPER, "Abstract and section 4 (which modules to tune)",
          "ordering",
          "fine-tuned on a shifted task, LoRA on the linear projections (in_proj, out_proj) "
          "reaches a higher accuracy than LoRA on the S6 parameters (x_proj, dt_proj) with the "
          "same trainable count"),
]  # fmt: skip


def claim_book() -> ClaimBook:
    """This note's claims, none checked yet."""
    return ClaimBook(CLAIMS)


# fmt: off
PARAMETERS = Parameters(
    Param("seeds",              [0, 1, 2], checks.integers, "one fine-tuning per seed and adapter "
                                                            "(claims judged on 3 or more)",
          minimum=0),
    Param("peft_pretrain_steps", PEFT_PRETRAIN_STEPS, checks.integer,
          "steps pretraining the base model (once)", minimum=1),
    Param("peft_steps",         PEFT_STEPS, checks.integer, "fine-tuning steps per adapter and "
                                                            f"seed (judged from {PEFT_STEPS} on)",
          minimum=1),
    DEVICE,
    Param("out_dir",            "../runs/papers/10_peft_ssm", check_out_dir,
          "where figures and claims.json go"),
)
# fmt: on


def judged(p: dict) -> bool:
    """Whether this run is the recipe's size (>= PEFT_PRETRAIN_STEPS and PEFT_STEPS steps,
    >= MIN_SEEDS seeds): only then is its ordering claim judged pass or fail."""
    return (
        p["peft_pretrain_steps"] >= PEFT_PRETRAIN_STEPS
        and p["peft_steps"] >= PEFT_STEPS
        and len(p["seeds"]) >= MIN_SEEDS
    )


def pretrain(steps: int, seed: int = 0, device="cpu") -> tuple:
    """The base model (BASE_MODEL) trained on selective copying (PRETRAIN_TASK): (model, fit)."""
    model = build_model(ModelConfig(**BASE_MODEL), seed=seed).to(device)
    with torch_threads(1):  # tiny models: a 2nd thread only waits
        fit = train_on_task(model, make_task("selective-copying", **PRETRAIN_TASK), steps=steps,
                            seed=seed, **PRETRAIN)  # fmt: skip
    return model, fit


def adapter_size(model, ranks: dict) -> int:
    """Σ r·(in + out) over every matrix of ``model`` whose last name is a key of ``ranks``: the
    LoRA parameters A (r, in) and B (out, r) it would train."""
    total = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ranks:
            total += ranks[leaf] * (module.in_features + module.out_features)
    return total


def with_lora(base, ranks: dict):
    """A deep copy of ``base`` with LoRA on the matrices named in ``ranks`` ({leaf name: r}),
    α = ALPHA_PER_RANK·r each, no dropout (ssmkit.finetune.apply_lora; base stays untouched)."""
    r = max(ranks.values())
    return apply_lora(
        copy.deepcopy(base), r=r, alpha=ALPHA_PER_RANK * r, dropout=0.0,
        target_modules=sorted(ranks), rank_pattern=dict(ranks),
        alpha_pattern={k: ALPHA_PER_RANK * v for k, v in ranks.items()},
    )  # fmt: skip


def trainable(model) -> int:
    """Trainable parameters of a (LoRA) model (ssmkit.finetune.parameter_counts)."""
    return parameter_counts(model)["trainable"]


def finetune_runs(base, seeds, steps: int, device="cpu") -> list[dict]:
    """Fine-tune a LoRA copy of ``base`` per adapter of RANKS and seed on the shifted task
    (SHIFTED_TASK, :func:`train_on_task`, FINETUNE): rows {"adapter", "seed", "accuracy", "loss",
    "trainable"}; the base model's own accuracy on the shifted task is the row "none"."""
    with torch_threads(1):  # tiny models: a 2nd thread only waits
        task = make_task("selective-copying", **SHIFTED_TASK)
        rows = []
        for seed in seeds:
            _, test = task.split(0, 256, seed)
            rows.append({"adapter": "none", "seed": seed, "accuracy": answer_accuracy(base, test),
                         "loss": math.nan, "trainable": 0})  # fmt: skip
        for adapter, ranks in RANKS.items():
            for seed in seeds:
                model = with_lora(base, ranks).to(device)
                fit = train_on_task(model, task, steps=steps, seed=seed, **FINETUNE)
                rows.append({"adapter": adapter, "seed": seed, "accuracy": fit["accuracy"],
                             "loss": fit["loss"], "trainable": trainable(model)})  # fmt: skip
        return rows
