r"""Note 07, Zamba: what papers/07_zamba.ipynb calls. "Zamba: A Compact 7B SSM Hybrid Model"
(Glorioso et al. 2024, arXiv 2405.16712); ssmkit implements its successor Zamba2
(:mod:`ssmkit.models.zamba2`, ``ModelConfig(..., zamba2={...})``).

Zamba is a stack of Mamba layers with ONE transformer block (attention + MLP) whose weights are
shared by every place it is used. Its input is the current hidden state concatenated with the
original token embeddings; a per-layer linear map adds its output to that Mamba layer's input:

$$ t_\ell = W_\ell\, \mathrm{Block}\big([\,h_\ell ;\, e\,]\big), \qquad
   h_{\ell+1} = h_\ell + \mathrm{Mamba}_\ell\big(\mathrm{norm}(h_\ell + t_\ell)\big) $$

Zamba2 gives each use ℓ its own low-rank (LoRA-like) projectors on the shared weights,
W x + U_ℓ D_ℓ x (rank r), so every use can specialise at little cost, and may alternate between a
few shared blocks (``num_mem_blocks``). For d = d_model, H heads of size 2d/H, G K/V heads,
MLP width I (the block's parameters, :func:`block_numel`):

$$ P_{\text{block}} = \underbrace{2d}_{\text{norm}} + \underbrace{2d \cdot 2d + 2 \cdot 2d \cdot
   G\tfrac{2d}{H} + 2d \cdot d}_{q,\,k,\,v,\,o} + \underbrace{d}_{\text{norm}_2}
   + \underbrace{d \cdot 2I + I \cdot d}_{\text{MLP}} $$

and sharing one block among n_hybrid uses instead of giving each its own saves
(n_hybrid - num_mem_blocks) · P_block parameters.

Glossary: "hybrid layer" = a Mamba layer that receives the shared block's output; "unshared" =
num_mem_blocks = n_hybrid (every use its own block).
"""

from __future__ import annotations

import tempfile
import warnings

import torch

from .. import checks
from ..data import make_task
from ..models import ModelConfig, build_model
from ..train import train_each
from ..workbook.params import DEVICE, Param, Parameters, check_out_dir
from .claims import MIN_SEEDS, Claim, ClaimBook

TITLE = "Zamba / Zamba2 (Glorioso et al. 2024)"
ARXIV = "2405.16712"
PAPER = "Zamba (Glorioso et al. 2024)"
QUESTION = (
    "How many parameters does one shared attention block save against a hybrid with a block per "
    "use, and what does sharing cost in recall?"
)

# A tiny transformers Zamba2ForCausalLM (random weights, built offline): the parity check's model,
# the setup of tests/unit/hub/test_hub_hybrid.py.
HF_TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    mamba_d_state=8,
    n_mamba_heads=4,
    num_attention_heads=4,
    chunk_size=16,
    intermediate_size=48,
    adapter_rank=4,
    layers_block_type=["mamba", "hybrid", "mamba"],
)
PARITY_TOL = 1e-5  # fp32: max |logits diff| / max |logits| (transformers' RMSNorm is fp32 always)

# The recall recipe, fixed before any judged run: orderings are judged only at this size or larger.
# Two Mamba-2 layers, the shared block before both (two uses, so "unshared" is two blocks).
MQAR_STEPS = 200
MQAR = dict(vocab_size=32, seq_len=32, num_kv_pairs=4)
MQAR_MODEL = dict(
    d_model=32,
    n_layer=2,
    vocab_size=32,
    mixer="mamba2",
    d_intermediate=0,
    residual_in_fp32=False,
    mamba2=dict(d_state=16, headdim=16, chunk_size=32),
)
ZAMBA2 = dict(
    hybrid_layer_ids=[0, 1],
    num_attention_heads=2,
    intermediate_size=64,
    adapter_rank=4,
    use_shared_attention_adapter=True,
)

CLAIMS = [
    Claim("block-numel", PAPER, "Architecture (the shared attention block)", "identity",
          "the shared block's parameter count is P_block of the formula (attention over "
          "concat(hidden, embeddings), then the MLP), for several configurations"),
    Claim("per-use-numel", PAPER, "Architecture (the shared block's per-use projections)",
          "identity",
          "each use owns only its output linear map and (Zamba2) its low-rank adapters: d² + "
          "adapter parameters, by formula"),
    Claim("params-saved", PAPER, "Architecture (parameter sharing)", "identity",
          "sharing saves exactly (n_hybrid - num_mem_blocks) · P_block parameters against a "
          "hybrid of equal depth with a block per use"),
    Claim("hf-logits", PAPER, "Zamba2 in transformers (Zamba2ForCausalLM)", "threshold",
          f"a tiny transformers Zamba2ForCausalLM, loaded by ssmkit.from_pretrained, gives its "
          f"logits to {PARITY_TOL:g} relative (float32)"),
    Claim("mqar-shared", PAPER, "Architecture (why a shared attention block)", "ordering",
          "on multi-query associative recall, Mamba-2 with the shared attention block recalls "
          "better than pure Mamba-2 of the same depth"),
    Claim("mqar-unshared", PAPER, "Architecture (parameter sharing)", "ordering",
          "a block per use (more parameters) recalls better than one shared block: the price of "
          "the parameters saved"),
]  # fmt: skip


def claim_book() -> ClaimBook:
    """This note's claims, none checked yet."""
    return ClaimBook(CLAIMS)


# fmt: off
PARAMETERS = Parameters(
    Param("seeds",        [0, 1, 2],   checks.integers, "one parity model and one MQAR training "
                                                        "per seed and model (claims judged on 3 or "
                                                        "more)", minimum=0),
    Param("zamba_steps",  MQAR_STEPS,  checks.integer, "training steps per MQAR model (claims "
                                                       f"judged from {MQAR_STEPS} on)", minimum=1),
    DEVICE,
    Param("out_dir",      "../runs/papers/07_zamba", check_out_dir,
          "where figures and claims.json go"),
)
# fmt: on


def judged(p: dict) -> bool:
    """Whether this run is the recipe's size (>= MQAR_STEPS steps, >= MIN_SEEDS seeds): only then
    are its ordering claims judged pass or fail."""
    return p["zamba_steps"] >= MQAR_STEPS and len(p["seeds"]) >= MIN_SEEDS


# --- parameter counts ---------------------------------------------------------------------------


def zamba_config(num_mem_blocks: int = 1, **zamba2) -> ModelConfig:
    """The recipe's Zamba2 model (:data:`MQAR_MODEL`, :data:`ZAMBA2`) with ``num_mem_blocks``
    shared blocks and any ZAMBA2 field overridden."""
    return ModelConfig(**MQAR_MODEL, zamba2={**ZAMBA2, **zamba2, "num_mem_blocks": num_mem_blocks})


def count_configs() -> dict[str, ModelConfig]:
    """Configurations whose counts are checked: the recipe's, with GQA and a wider MLP, without
    adapters, with MLP biases."""
    return {
        "recipe": zamba_config(),
        "gqa, I=96": zamba_config(
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96
        ),  # fmt: skip
        "no adapters": zamba_config(
            use_shared_attention_adapter=False, use_shared_mlp_adapter=False
        ),  # fmt: skip
        "mlp bias": zamba_config(add_bias_linear=True),
    }


def block_numel(cfg: ModelConfig) -> int:
    """P_block of the module docstring, from the config alone."""
    d, z = cfg.d_model, cfg.zamba2
    heads, kv, inter = z["num_attention_heads"], z["num_key_value_heads"], z["intermediate_size"]
    head = 2 * d // heads
    attn = 2 * d * heads * head + 2 * (2 * d * kv * head) + heads * head * d
    mlp = d * 2 * inter + inter * d + (2 * inter + d if z["add_bias_linear"] else 0)
    return 2 * d + attn + d + mlp


def per_use_numel(cfg: ModelConfig) -> int:
    """Parameters one use of the shared block owns: its output linear map (d, d) and its adapters
    (rank r: down (in, r) and up (r, out) each)."""
    d, z = cfg.d_model, cfg.zamba2
    r, heads, kv = z["adapter_rank"], z["num_attention_heads"], z["num_key_value_heads"]
    head = 2 * d // heads
    n = d * d
    if z["use_shared_attention_adapter"]:
        n += (2 * d * r + r * heads * head) + 2 * (2 * d * r + r * kv * head)
    if z["use_shared_mlp_adapter"]:
        n += d * r + r * 2 * z["intermediate_size"]
    return n


def numel(module: torch.nn.Module) -> int:
    """sum(p.numel()) over ``module``'s parameters."""
    return sum(p.numel() for p in module.parameters())


def counted(cfg: ModelConfig) -> dict:
    """What a built model holds: {"block": numel of shared block 0, "per_use": [numel of each
    hybrid layer's linear + adapters], "total": numel of the model}."""
    model = build_model(cfg, seed=0)
    layers = [m for m in model.backbone.layers if m.hybrid]
    return {
        "block": numel(model.backbone.shared[0]),
        "per_use": [numel(m.linear) + numel(m.adapters) for m in layers],
        "total": numel(model),
    }


# --- parity with transformers ---------------------------------------------------------------------


def hf_parity(seed: int) -> float:
    """Save a seeded tiny transformers Zamba2 (:data:`HF_TINY`, every weight nudged off its init),
    load it with ``ssmkit.from_pretrained`` and return max |Δlogits| / max |logits| on ids (1, 10),
    float32."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    from ..hub.load import from_pretrained

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = Zamba2ForCausalLM(Zamba2Config(**HF_TINY)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = from_pretrained(d).eval()
    ids = torch.randint(0, HF_TINY["vocab_size"], (1, 10))
    with torch.no_grad():
        want, got = hf(ids).logits, model(ids).logits
    return ((got - want).abs().max() / want.abs().max()).item()


# --- recall: shared, unshared, none ---------------------------------------------------------------


def mqar_models() -> dict[str, ModelConfig]:
    """Pure Mamba-2, the shared hybrid (one block) and the unshared one (a block per use), the same
    depth and width."""
    n_uses = len(ZAMBA2["hybrid_layer_ids"])
    return {
        "mamba2": ModelConfig(**MQAR_MODEL),
        "shared": zamba_config(1),
        "unshared": zamba_config(n_uses),
    }


def mqar_runs(seeds, steps: int, device="cpu") -> list[dict]:
    """Train each model of :func:`mqar_models` on MQAR once per seed (batch 16, lr 3e-3;
    :func:`~ssmkit.train.train_each`, one thread), scored on 256 held-out sequences: rows
    {"model", "seed", "accuracy", "loss", "seconds", "params"}."""
    task = make_task("mqar", **MQAR)
    return train_each(mqar_models(), task, seeds, steps, device, batch=16, lr=3e-3)
