"""A Transformer baseline of matched size: transformers' ``LlamaForCausalLM`` ("Transformer++").

The Mamba paper compares against "Transformer++" (rotary embeddings, SwiGLU MLP, RMSNorm, no
biases: the LLaMA recipe) of the same parameter count, trained on the same tokens. Sizes here:

    Llama block    4·d² (q, k, v, o; head_dim 64 or d/4) + 3·d·f (SwiGLU, f ≈
                   8d/3 rounded to 64) + 2d
    Mamba-1 block  ≈ 3·E·d² + ... (in_proj 2Ed², out_proj Ed², x/dt projections)  ≈ 6d² for E = 2

so at equal width a Llama block has about twice a Mamba block's parameters: the paper's models
use twice as many Mamba layers as Transformer layers. :func:`matched_transformer` keeps d_model
and the vocabulary and picks the number of Llama layers whose non-embedding parameters come
closest to the Mamba model's.
"""

from __future__ import annotations

from torch import nn


def _llama_config(d_model: int, n_layer: int, vocab_size: int, max_len: int, tie: bool):
    from transformers import LlamaConfig

    heads = max(1, d_model // 64) if d_model >= 256 else 4
    ffn = max(64, round(8 * d_model / 3 / 64) * 64)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=d_model,
        intermediate_size=ffn,
        num_hidden_layers=n_layer,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
    )


def _non_embedding(model: nn.Module) -> int:
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = {id(p): p for p in model.parameters() if id(p) not in emb}
    return sum(p.numel() for p in params.values())


def matched_transformer(model: nn.Module, max_len: int = 4096):
    """A freshly initialised ``LlamaForCausalLM`` with ``model``'s width and vocabulary and the
    layer count that best matches its non-embedding parameters (tied embeddings, as the Mamba
    LM)."""
    from transformers import LlamaForCausalLM

    cfg = model.config
    vocab = getattr(cfg, "padded_vocab_size", None) or cfg.vocab_size
    target = _non_embedding(model)
    tie = getattr(cfg, "tie_embeddings", True)
    one = _non_embedding(LlamaForCausalLM(_llama_config(cfg.d_model, 1, vocab, max_len, tie)))
    two = _non_embedding(LlamaForCausalLM(_llama_config(cfg.d_model, 2, vocab, max_len, tie)))
    per_layer, final = two - one, 2 * one - two  # block size; the final norm
    layers = max(1, round((target - final) / per_layer))
    return LlamaForCausalLM(_llama_config(cfg.d_model, layers, vocab, max_len, tie))


def parameter_report(models: dict[str, nn.Module]) -> list[dict]:
    """Rows of name, total and non-embedding parameters and layers, for a comparison table."""
    rows = []
    for name, m in models.items():
        total = sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
        layers = getattr(m.config, "n_layer", None) or getattr(m.config, "num_hidden_layers", None)
        rows.append(
            {"model": name, "params": total, "non_embedding": _non_embedding(m), "layers": layers}
        )
    return rows
