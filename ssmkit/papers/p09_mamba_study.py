r"""Note 09, the Mamba study: what papers/09_mamba_study.ipynb calls. "An Empirical Study of
Mamba-based Language Models" (Waleffe et al. (NVIDIA) 2024, arXiv 2406.07887).

The paper trains Mamba, Mamba-2, Transformer and a Mamba-2 hybrid of the same size on the same data
and compares them. Its hybrid stacks three kinds of layer, each with a residual around it:

$$ x \leftarrow x + \mathrm{Mixer}_\ell(\mathrm{Norm}(x)), \qquad
   \mathrm{Mixer}_\ell \in \{\text{Mamba-2},\ \text{self-attention},\ \text{MLP}\}, $$

about 43% Mamba-2 layers, 7% attention and 50% MLP. Pure SSMs match the Transformer on most
language-modelling tasks but lag on those that must copy or look up a fact from the context
(the phonebook task, MMLU's multiple choice in few-shot form); a few attention layers close the gap.

In ssmkit a block is a mixer followed by an MLP (``d_intermediate``), so a stack of B blocks of
which A are attention has B - A Mamba-2 layers, A attention layers and B MLPs among its 2B layers:
A / 2B attention, 1/2 MLP.

Glossary: B = ``n_layer`` (blocks), A = the attention blocks (``attn_layer_idx``).
"""

from __future__ import annotations

from collections import Counter

from .. import checks
from ..data import make_task
from ..models import ModelConfig
from ..models.attention import Attention
from ..train import train_each
from ..workbook.params import DEVICE, Param, Parameters, check_out_dir
from .claims import MIN_SEEDS, Claim, ClaimBook

TITLE = "An Empirical Study of Mamba-based Language Models (Waleffe et al. 2024)"
ARXIV = "2406.07887"
PAPER = "Mamba study (Waleffe et al. 2024)"
QUESTION = (
    "Where do pure Mamba models lag Transformers, and does a hybrid with a few attention layers "
    "(about 7%) close the gap?"
)

# The hybrid's layer shares as the paper states them, rounded to whole percent.
HYBRID_SHARES = {"mamba2": 43, "attn": 7, "mlp": 50}
HYBRID_BLOCKS = 28  # 28 mixers + 28 MLPs = 56 layers
HYBRID_ATTN = 4  # attention blocks, spread through the stack

# The phonebook recipe, fixed before any run: the claim below is judged only at this size or larger.
PHONEBOOK_STEPS = 300
PHONEBOOK = dict(vocab_size=32, seq_len=32, num_entries=6, name_len=1, number_len=2)
PHONEBOOK_MODEL = dict(
    d_model=64,
    n_layer=2,
    vocab_size=32,
    d_intermediate=128,
    attn_cfg={"num_heads": 4},
    mamba2={"d_state": 16, "headdim": 16, "chunk_size": 32},
)
TRAIN = dict(batch=32, lr=3e-3)

CLAIMS = [
    Claim("hybrid-shares", PAPER, "Abstract (the Mamba-2-Hybrid's layers)", "identity",
          "an ssmkit config of 28 blocks, 4 of them attention, each with an MLP, has the paper's "
          "layer shares, rounded to whole percent",
          paper_value="43% Mamba-2, 7% attention, 50% MLP"),
    Claim("phonebook-hybrid", PAPER, "Abstract and the phonebook evaluation (SSMs lag on lookup)",
          "ordering",
          "on phonebook lookup the hybrid (Mamba-2 + one attention block) beats pure Mamba-2 of "
          "the same width and depth"),
    Claim("hybrid-8b", PAPER, "Abstract (the 8B hybrid against the 8B Transformer)", "cited",
          "at 8B parameters the Mamba-2-Hybrid exceeds the Transformer on all 12 standard tasks "
          "evaluated and is predicted to generate tokens faster",
          paper_value="+2.65 points on average; up to 8x faster generation"),
]  # fmt: skip


def claim_book() -> ClaimBook:
    """This note's claims, none checked yet."""
    return ClaimBook(CLAIMS)


# fmt: off
PARAMETERS = Parameters(
    Param("seeds",         [0, 1, 2],       checks.integers, "one phonebook training per seed and "
                                                             "model (claims judged on 3 or more)",
          minimum=0),
    Param("study_steps",   PHONEBOOK_STEPS, checks.integer, "training steps per phonebook model "
                                                            f"(judged from {PHONEBOOK_STEPS} on)",
          minimum=1),
    DEVICE,
    Param("out_dir",       "../runs/papers/09_mamba_study", check_out_dir,
          "where figures and claims.json go"),
)
# fmt: on


def judged(p: dict) -> bool:
    """Whether this run is the recipe's size (>= PHONEBOOK_STEPS steps, >= MIN_SEEDS seeds): only
    then is its ordering claim judged pass or fail."""
    return p["study_steps"] >= PHONEBOOK_STEPS and len(p["seeds"]) >= MIN_SEEDS


# --- the hybrid's layer shares --------------------------------------------------------------------


def hybrid_config(d_model: int = 16) -> ModelConfig:
    """The paper's hybrid pattern in ssmkit: HYBRID_BLOCKS blocks, HYBRID_ATTN of them attention
    at evenly spaced places, the rest Mamba-2, an MLP after every mixer (narrow: only the layer
    list matters here)."""
    step = HYBRID_BLOCKS // HYBRID_ATTN
    attn = [step // 2 + i * step for i in range(HYBRID_ATTN)]
    layout = ["attn" if i in attn else "mamba2" for i in range(HYBRID_BLOCKS)]
    return ModelConfig(
        d_model=d_model, n_layer=HYBRID_BLOCKS, vocab_size=32, layout=layout,
        d_intermediate=2 * d_model, attn_cfg={"num_heads": 1},
        mamba2={"d_state": 8, "headdim": 8, "chunk_size": 32},
    )  # fmt: skip


def layer_counts(model) -> Counter:
    """How many layers of each kind the built model has: its blocks' mixers ("mamba2", "attn", ...)
    and one "mlp" per block with an MLP."""
    out = Counter()
    for block in model.backbone.layers:
        mixer = block.mixer
        out["attn" if isinstance(mixer, Attention) else type(mixer).__name__.lower()] += 1
        out["mlp"] += block.mlp is not None
    return out


def shares(counts: Counter) -> dict[str, float]:
    """{kind: share of all layers} of :func:`layer_counts`."""
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


# --- phonebook: pure Mamba-2 against the hybrid ---------------------------------------------------


def phonebook_models() -> dict[str, ModelConfig]:
    """The compared models, the same width, depth and MLPs: a hybrid (Mamba-2 then attention) and
    pure Mamba-2."""
    return {
        "hybrid": ModelConfig(**PHONEBOOK_MODEL, layout=["mamba2", "attn"]),
        "mamba2": ModelConfig(**PHONEBOOK_MODEL, layout=["mamba2", "mamba2"]),
    }


def phonebook_runs(seeds, steps: int, device="cpu") -> list[dict]:
    """Train every model of :func:`phonebook_models` on phonebook lookup (PHONEBOOK) once per seed
    (TRAIN; :func:`~ssmkit.train.train_each`, one thread), scored on 256 held-out books: rows
    {"model", "seed", "accuracy", "loss", "seconds", "params"}."""
    task = make_task("phonebook", **PHONEBOOK)
    return train_each(phonebook_models(), task, seeds, steps, device, **TRAIN)
