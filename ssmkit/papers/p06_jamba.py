r"""Note 06, Jamba: what papers/06_jamba.ipynb calls. "Jamba: A Hybrid Transformer-Mamba Language
Model" (Lieber et al. 2024, arXiv 2403.19887).

Jamba stacks Mamba-1 layers and a few attention layers, and replaces every other layer's MLP by a
sparse mixture of experts (MoE). In the released configuration (32 layers, one attention layer in
eight, experts on every other layer, 16 experts of which each token uses 2):

$$ \text{mixer}_i = \begin{cases}\text{attention} & i \bmod 8 = 4\\ \text{Mamba} & \text{else}
   \end{cases}, \qquad
   \text{MLP}_i = \begin{cases}\text{MoE}(E{=}16, k{=}2) & i \bmod 2 = 1\\
   \text{dense} & \text{else}\end{cases} $$

$$ \text{MoE}(x) = \sum_{e \in \mathrm{top}_k(p(x))} p_e(x)\, \text{MLP}_e(x), \qquad
   p(x) = \mathrm{softmax}(W_r x) $$

Only attention layers keep a cache that grows with the context; a Mamba layer keeps a state of
fixed size. For batch b, context L, element size s (bytes), K/V heads h_kv of size d_h:

$$ M(L) = n_{\text{attn}} \cdot 2\, b\, L\, h_{kv}\, d_h\, s
   \;+\; n_{\text{mamba}} \cdot b\, d_{\text{inner}} (d_{\text{conv}}\, s + 4\, d_{\text{state}}) $$

(the SSM state h is kept in fp32, 4 bytes). :func:`cache_bytes` is this formula; the note checks
it against the bytes ssmkit's :class:`~ssmkit.models.cache.InferenceCache` holds.

Glossary: E = ``num_experts``, k = ``num_experts_per_tok``, a:m = attention to Mamba layers.
"""

from __future__ import annotations

import tempfile
import warnings

import torch

from .. import checks
from ..data import make_task
from ..eval.long_context import prefill_cache_nbytes
from ..models import ModelConfig, build_model
from ..train import train_each
from ..workbook.params import DEVICE, Param, Parameters, check_out_dir
from .claims import MIN_SEEDS, Claim, ClaimBook

TITLE = "Jamba (Lieber et al. 2024)"
ARXIV = "2403.19887"
PAPER = "Jamba (Lieber et al. 2024)"
QUESTION = (
    "What does a Transformer-Mamba hybrid with mixture-of-experts MLPs look like layer by layer, "
    "how much cache does it save against a Transformer, and does its attention buy in-context "
    "recall that pure Mamba lacks?"
)

# A tiny transformers JambaForCausalLM with experts (built offline, random weights): the parity
# check's model. Eight layers so the attention rule is Jamba's own (i % 8 == 4).
HF_TINY = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_layer_period=8,
    attn_layer_offset=4,
    num_experts=4,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    mamba_d_state=8,
)
PARITY_TOL = 1e-5  # fp32: max |logits diff| / max |logits| (transformers' RMSNorm is fp32 always)

# The context lengths of the cache comparison (the paper's long-context range) and the small ones
# at which the formula is checked against the bytes a real cache holds.
CACHE_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072, 262144)
MEASURED_LENGTHS = (256, 512, 1024)

# The recall recipe, fixed before any run: orderings are judged only at this size or larger. At two
# layers the hybrid is one Mamba and one attention layer (Jamba's rule with period 2, offset 1).
MQAR_STEPS = 200
MQAR = dict(vocab_size=32, seq_len=32, num_kv_pairs=4)
MQAR_MODEL = dict(d_model=32, n_layer=2, vocab_size=32, mixer="mamba1", mamba1={"d_state": 16})

CLAIMS = [
    Claim("layers-attn", PAPER, "Section 3.1 (the Jamba configuration: a:m = 1:7)", "identity",
          "the released configuration's attention layers are exactly those with i % 8 == 4 "
          "(4 of 32: one attention layer per 7 Mamba layers)"),
    Claim("layers-moe", PAPER, "Section 3.1 (the Jamba configuration: e = 2, n = 16, K = 2)",
          "identity",
          "its MoE layers are exactly every other layer (i % 2 == 1), 16 experts, 2 per token"),
    Claim("moe-route", PAPER, "Section 2 (the MoE layer)", "identity",
          "ssmkit's SparseMoE equals a per-token loop over its top-k experts, weighted by the "
          "unnormalised router probabilities (float64)"),
    Claim("hf-logits", PAPER, "Section 3 (the released model, via transformers' Jamba)",
          "threshold",
          f"a tiny transformers JambaForCausalLM with experts, loaded by ssmkit.from_pretrained, "
          f"gives its logits to {PARITY_TOL:g} relative (float32)"),
    Claim("hf-greedy", PAPER, "Section 3 (the released model, via transformers' Jamba)",
          "identity", "and the same greedy generation, token for token"),
    Claim("cache-formula", PAPER, "Section 2 (memory: KV cache vs Mamba state)", "identity",
          "the cache formula M(L) equals the bytes ssmkit's InferenceCache holds after a prefill "
          "of L tokens, for a hybrid and for a Transformer"),
    Claim("kv-saving", PAPER, "Section 2 and Table 1 (KV cache at long context)", "identity",
          "with the released configuration, the hybrid's KV cache is exactly n_attn / n_layer = "
          "1/8 of a 32-layer Transformer's with the same attention, at every length from 4K to "
          "256K tokens (the Mamba states add a constant on top)"),
    Claim("mqar-hybrid", PAPER, "Section 6 (ablations: in-context learning of pure Mamba vs "
          "the hybrid)", "ordering",
          "on multi-query associative recall, a Mamba-attention hybrid recalls better than pure "
          "Mamba of the same width and depth"),
]  # fmt: skip


def claim_book() -> ClaimBook:
    """This note's claims, none checked yet."""
    return ClaimBook(CLAIMS)


# fmt: off
PARAMETERS = Parameters(
    Param("seeds",        [0, 1, 2],   checks.integers, "one parity model and one MQAR training "
                                                        "per seed and model (claims judged on 3 or "
                                                        "more)", minimum=0),
    Param("jamba_steps",  MQAR_STEPS,  checks.integer, "training steps per MQAR model (claims "
                                                       f"judged from {MQAR_STEPS} on)", minimum=1),
    DEVICE,
    Param("out_dir",      "../runs/papers/06_jamba", check_out_dir,
          "where figures and claims.json go"),
)
# fmt: on


def judged(p: dict) -> bool:
    """Whether this run is the recipe's size (>= MQAR_STEPS steps, >= MIN_SEEDS seeds): only then
    are its ordering claims judged pass or fail."""
    return p["jamba_steps"] >= MQAR_STEPS and len(p["seeds"]) >= MIN_SEEDS


# --- the layer pattern ----------------------------------------------------------------------------


def released_config() -> ModelConfig:
    """The released Jamba's architecture as an ssmkit ModelConfig: transformers' ``JambaConfig()``
    defaults (Jamba-v0.1's), read by :func:`ssmkit.hub.jamba.config_from_jamba`; no weights."""
    from transformers import JambaConfig

    from ..hub.jamba import config_from_jamba

    return config_from_jamba(JambaConfig().to_dict())


# --- the mixture of experts -----------------------------------------------------------------------


def random_moe(seed: int = 0, d_model: int = 16, num_experts: int = 4, top_k: int = 2):
    """A float64 SparseMoE with random weights (router scaled up so the top-k is decisive) and
    tokens x (10, d_model)."""
    from ..models import SparseMoE

    torch.manual_seed(seed)
    moe = SparseMoE(d_model, 32, num_experts, top_k).double()
    with torch.no_grad():
        moe.router.weight.mul_(4)
    return moe, torch.randn(10, d_model, dtype=torch.float64)


# --- parity with transformers ---------------------------------------------------------------------


def _hf_jamba(seed: int):
    """HF_TINY as a transformers JambaForCausalLM, seeded, every weight nudged off its init (so
    zero-initialised pieces are exercised), float32, eval mode."""
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = JambaForCausalLM(JambaConfig(**HF_TINY, attn_implementation="eager"))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return hf.eval()


def hf_parity(seed: int, new_tokens: int = 6) -> dict:
    """Save a seeded tiny transformers Jamba (:data:`HF_TINY`), load it with
    ``ssmkit.from_pretrained``, and compare: ``{"rel": max |Δlogits| / max |logits| on ids
    (2, 12), "ours": greedy ids (2, 4 + new_tokens), "theirs": transformers' greedy ids,
    "moe_layers": ssmkit's MoE layers, "hf_moe_layers": transformers' layers with > 1 expert}``."""
    from ..hub.load import from_pretrained
    from ..models.generate import generate

    hf = _hf_jamba(seed)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = from_pretrained(d).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, HF_TINY["vocab_size"], (2, 12), generator=g)
    prompt = torch.randint(1, HF_TINY["vocab_size"], (2, 4), generator=g)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, got = hf(ids, use_cache=False).logits, model(ids).logits
        theirs = hf.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)  # fmt: skip
    ours = generate(model, prompt, max_new_tokens=new_tokens, temperature=0)
    return {
        "rel": ((got - want).abs().max() / want.abs().max()).item(),
        "ours": ours,
        "theirs": theirs,
        "moe_layers": model.config.moe_layers,
        "hf_moe_layers": [i for i, n in enumerate(hf.config.layers_num_experts) if n > 1],
    }


# --- cache memory ---------------------------------------------------------------------------------


def cache_bytes(cfg: ModelConfig, length: int, batch: int = 1, elem: int = 2) -> int:
    """M(L) of the module docstring: bytes of the generation cache of an ssmkit Mamba-1 /
    attention model ``cfg`` holding ``length`` tokens, ``elem`` bytes per element (2: bf16), the
    SSM state fp32. ``length`` 0 leaves the part that does not grow (the Mamba states)."""
    a = cfg.attn_cfg
    head_dim = a.get("head_dim") or cfg.d_model // a["num_heads"]
    kv = 2 * batch * length * (a.get("num_heads_kv") or a["num_heads"]) * head_dim * elem
    n_attn = len(cfg.attn_layer_idx)
    if cfg.mixer == "attn":
        return cfg.n_layer * kv
    m = cfg.mixer_cfg()
    d_inner = m.expand * cfg.d_model
    state = batch * d_inner * (m.d_conv * elem + 4 * m.d_state)
    return n_attn * kv + (cfg.n_layer - n_attn) * state


def transformer_like(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with every layer attention (the same heads): the Transformer it is compared with."""
    d = cfg.to_dict()
    for key in ("attn_layer_idx", "attn_every", "attn_offset", "layout"):
        d.pop(key, None)
    return ModelConfig.from_dict({**d, "mixer": "attn"})


def small_cache_models() -> dict[str, ModelConfig]:
    """A tiny 8-layer Jamba-pattern hybrid and its all-attention twin, for measuring caches."""
    hybrid = ModelConfig(d_model=32, n_layer=8, vocab_size=64, mixer="mamba1", attn_every=8,
                         attn_offset=4, attn_cfg=dict(num_heads=4, num_heads_kv=2),
                         mamba1={"d_state": 8})  # fmt: skip
    return {"hybrid": hybrid, "transformer": transformer_like(hybrid)}


def measured_cache(cfg: ModelConfig, length: int, batch: int = 1) -> int:
    """Bytes the bf16 InferenceCache of ``cfg`` holds after a prefill of ``length`` random tokens
    (:func:`ssmkit.eval.long_context.prefill_cache_nbytes`)."""
    model = build_model(cfg, seed=0).to(torch.bfloat16).eval()
    return prefill_cache_nbytes(model, length, batch)


def cache_rows(cfg: ModelConfig, lengths=CACHE_LENGTHS) -> list[dict]:
    """{"model", "length", "GiB"} of :func:`cache_bytes` for ``cfg`` and its Transformer twin."""
    models = {"Jamba (hybrid)": cfg, "Transformer": transformer_like(cfg)}
    return [{"model": name, "length": n, "GiB": cache_bytes(c, n) / 2**30}
            for name, c in models.items() for n in lengths]  # fmt: skip


# --- in-context recall: hybrid against pure Mamba -------------------------------------------------


def mqar_models() -> dict[str, ModelConfig]:
    """Pure Mamba-1 and the hybrid (its second layer attention), the same width and depth."""
    return {
        "mamba": ModelConfig(**MQAR_MODEL),
        "hybrid": ModelConfig(
            **MQAR_MODEL, attn_every=2, attn_offset=1, attn_cfg=dict(num_heads=2)
        ),  # fmt: skip
    }


def mqar_runs(seeds, steps: int, device="cpu") -> list[dict]:
    """Train each model of :func:`mqar_models` on MQAR once per seed (batch 16, lr 3e-3;
    :func:`~ssmkit.train.train_each`, one thread), scored on 256 held-out sequences: rows
    {"model", "seed", "accuracy", "loss", "seconds", "params"}."""
    task = make_task("mqar", **MQAR)
    return train_each(mqar_models(), task, seeds, steps, device, batch=16, lr=3e-3)
