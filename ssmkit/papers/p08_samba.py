r"""Note 08, Samba: what papers/08_samba.ipynb calls. "Samba: Simple Hybrid State Space Models for
Efficient Unlimited Context Language Modeling" (Ren et al. 2024, arXiv 2406.07522).

The paper's idea: interleave a selective SSM (Mamba), which compresses the whole past into a
fixed-size state, with sliding-window attention (SWA), which recalls the last W tokens exactly, and
an MLP after each. One Samba unit is the layer list

$$ [\,\text{Mamba},\ \text{MLP},\ \text{SWA},\ \text{MLP}\,] $$

repeated. SWA at position t attends over positions t-W+1 .. t only,

$$ y_t = \sum_{s = t-W+1}^{t} \operatorname{softmax}_s\!\Big(\tfrac{q_t \cdot k_s}{\sqrt{d}}\Big)
   v_s , $$

so its cache is a ring of W keys and values per layer, and the Mamba layers' state is a fixed
tensor: the whole model's generation memory is constant in the sequence length. Anything further
back than W must travel through the SSM's state, which is what passkey retrieval beyond the window
tests.

In ssmkit a block is a mixer followed by an MLP (``d_intermediate``), so Samba's unit is two blocks,
``layout=["mamba2", "swa"]`` with ``d_intermediate > 0`` and ``attn_cfg={"window_size": W}``.
Samba uses Mamba-1; this note's trained models use Mamba-2 (the chunked SSD scan is several times
faster on a CPU than Mamba-1's sequential scan), which plays the same role.

Glossary: W = ``window_size``, T = the training length, K = the passkey's digits (``key_len``).
"""

from __future__ import annotations

from .. import checks
from ..data import make_task
from ..env import torch_threads
from ..eval import answer_accuracy
from ..eval.long_context import prefill_cache_nbytes
from ..models import ModelConfig, build_model
from ..models.attention import Attention
from ..train import train_on_task
from ..workbook.params import DEVICE, Param, Parameters, check_out_dir
from .claims import MIN_SEEDS, Claim, ClaimBook

TITLE = "Samba (Ren et al. 2024)"
ARXIV = "2406.07522"
PAPER = "Samba (Ren et al. 2024)"
QUESTION = (
    "Does a hybrid of Mamba and sliding-window attention recall a passkey beyond its window and "
    "beyond its training length, with a cache whose memory does not grow with the length?"
)

# The passkey recipe, fixed before any run: the claims below are judged only at this size or larger.
SAMBA_STEPS = 200
WINDOW = 8  # W: the passkey is usually further back than this
TRAIN_LEN = 32  # T
TEST_LENS = (32, 64, 128, 256)  # 1x .. 8x the training length
PASSKEY = dict(key_len=2, vocab_size=16)
SAMBA_MODEL = dict(
    d_model=32,
    n_layer=2,
    vocab_size=16,
    d_intermediate=64,
    attn_cfg={"num_heads": 2, "window_size": WINDOW},
    mamba2={"d_state": 16, "headdim": 16, "chunk_size": 32},
)
TRAIN = dict(batch=32, lr=1e-2)
N_TEST = 128  # held-out sequences per test length
EXTRAPOLATION_KEPT = 0.8  # Samba at 8x T keeps at least this share of its accuracy at T

CLAIMS = [
    Claim("samba-layout", PAPER, "Section 2 (methodology: the Samba layer stack)", "identity",
          "ssmkit's config layout=['mamba2', 'swa'] * 2 with an MLP per block builds the layer "
          "list [Mamba, MLP, SWA, MLP] * 2"),
    Claim("swa-cache-constant", PAPER, "Section 2 (SWA) and the abstract (linear time, unlimited "
          "streaming)", "identity",
          "the Samba model's inference cache holds the same bytes after prefills of every length, "
          "and that number is the formula 2·W·heads·head_dim (SWA) + conv + state (Mamba) per row"),
    Claim("passkey-beyond-window", PAPER, "Section 3.3 (efficient length extrapolation: passkey "
          "retrieval)", "ordering",
          "at 8x the training length, Samba (Mamba-2 + SWA) retrieves the passkey better than SWA "
          "alone (same width, depth and window)"),
    Claim("passkey-extrapolation", PAPER, "Section 3.3 (efficient length extrapolation: passkey "
          "retrieval)", "threshold",
          f"Samba's passkey accuracy at 8x the training length is at least {EXTRAPOLATION_KEPT} "
          "of its accuracy at the training length"),
    Claim("passkey-256k", PAPER, "Abstract and section 3.3 (passkey retrieval)", "cited",
          "fine-tuned on 4K-length sequences, Samba retrieves the passkey perfectly up to a "
          "256K context", paper_value="perfect recall to 256K after 4K training"),
]  # fmt: skip


def claim_book() -> ClaimBook:
    """This note's claims, none checked yet."""
    return ClaimBook(CLAIMS)


# fmt: off
PARAMETERS = Parameters(
    Param("seeds",        [0, 1, 2],   checks.integers, "one passkey training per seed and model "
                                                        "(claims judged on 3 or more)", minimum=0),
    Param("samba_steps",  SAMBA_STEPS, checks.integer, "training steps per passkey model (claims "
                                                       f"judged from {SAMBA_STEPS} on)", minimum=1),
    Param("samba_lens",   list(TEST_LENS), checks.integers,
          "passkey test lengths (the first is the training length)", minimum=8),
    DEVICE,
    Param("out_dir",      "../runs/papers/08_samba", check_out_dir,
          "where figures and claims.json go"),
)
# fmt: on


def judged(p: dict) -> bool:
    """Whether this run is the recipe's size (>= SAMBA_STEPS steps, >= MIN_SEEDS seeds): only then
    are its ordering and threshold claims judged pass or fail."""
    return p["samba_steps"] >= SAMBA_STEPS and len(p["seeds"]) >= MIN_SEEDS


# --- the layer list -------------------------------------------------------------------------------


def samba_config(units: int = 1, **overrides) -> ModelConfig:
    """Samba's [Mamba, MLP, SWA, MLP] unit ``units`` times, at this note's width (SAMBA_MODEL)."""
    kw = {**SAMBA_MODEL, "n_layer": 2 * units, "layout": ["mamba2", "swa"] * units, **overrides}
    return ModelConfig(**kw)


def sublayers(model) -> list[str]:
    """The model's layers in order, each block read as its mixer then its MLP: "mamba1" / "mamba2"
    / "attn" / "swa" / ..., and "mlp" after each block that has one."""
    out = []
    for block in model.backbone.layers:
        mixer = block.mixer
        if isinstance(mixer, Attention):
            out.append("swa" if mixer.window else "attn")
        else:
            out.append(type(mixer).__name__.lower())
        if block.mlp is not None:
            out.append("mlp")
    return out


# --- generation memory ----------------------------------------------------------------------------


def cache_bytes(cfg: ModelConfig, lengths, batch: int = 1, seed: int = 0) -> list[int]:
    """Bytes of the inference cache (``InferenceCache.nbytes``) after a prefill of each length, one
    fresh cache per length (:func:`ssmkit.eval.long_context.prefill_cache_nbytes`)."""
    model = build_model(cfg, seed=seed).eval()
    return [prefill_cache_nbytes(model, length, batch, seed) for length in lengths]


def cache_formula(cfg: ModelConfig, batch: int = 1, bytes_per: int = 4) -> int:
    """The cache's bytes from the config alone: per SWA layer 2·W·heads_kv·head_dim (keys and
    values), per Mamba-2 layer conv_dim·d_conv (the conv's last inputs, conv_dim = d_inner + 2·G·N)
    plus nheads·headdim·N (the state h); full attention has no such number (it grows with L)."""
    m2, a = cfg.mamba2, cfg.attn_cfg
    d_inner = m2.expand * cfg.d_model
    mamba = d_inner + 2 * m2.ngroups * m2.d_state
    per = {
        "mamba2": mamba * m2.d_conv + d_inner * m2.d_state,  # nheads * headdim = d_inner
        "swa": 2 * a["window_size"] * a["num_heads_kv"] * a["head_dim"],
    }
    return batch * bytes_per * sum(per[m] for m in cfg.mixers)


# --- passkey retrieval beyond the window and the training length ----------------------------------


def passkey_models() -> dict[str, ModelConfig]:
    """The compared models, the same width, depth, MLPs and window: Samba's unit and SWA alone."""
    return {"samba": samba_config(1), "swa only": samba_config(1, layout=["swa", "swa"])}


def passkey_runs(seeds, steps: int, lengths, device="cpu") -> list[dict]:
    """Train every model of :func:`passkey_models` on passkey retrieval at ``lengths[0]`` (T) once
    per seed (:func:`train_on_task`, TRAIN), then score it on N_TEST held-out sequences at each
    length: rows {"model", "seed", "length", "accuracy"}."""
    with torch_threads(1):  # tiny models: a 2nd thread only waits
        rows = []
        for name, cfg in passkey_models().items():
            for seed in seeds:
                model = build_model(cfg, seed=seed).to(device)
                task = make_task("passkey", seq_len=lengths[0], **PASSKEY)
                train_on_task(model, task, steps=steps, seed=seed, n_test=1, **TRAIN)
                for length in lengths:
                    _, test = make_task("passkey", seq_len=length, **PASSKEY).split(0, N_TEST, seed)
                    acc = answer_accuracy(model, test)
                    rows.append({"model": name, "seed": seed, "length": length, "accuracy": acc})
        return rows
