"""The exercises of notebooks/03_hybrid.ipynb: which layers of a Jamba-style hybrid are attention,
and what a generation cache holds at a given length (keys and values against SSM states).

Each judge recomputes the truth with ssmkit itself (:class:`ssmkit.ModelConfig`'s layer pattern; a
model's generation cache after a prefill, measured with ``InferenceCache.nbytes``) and returns a
hint that says what is off, never the number.
"""

from __future__ import annotations

from . import close, exercise


@exercise(
    "03.1",
    "the attention layers of a hybrid",
    ("attn_layers", "attn_share"),
    wrong={"attn_layers": [0, 8, 16], "attn_share": 3 / 24},
)
def _(attn_layers, attn_share, n_layer=24, attn_every=8):
    from ..models import ModelConfig

    cfg = ModelConfig(
        d_model=64,
        n_layer=n_layer,
        vocab_size=8,
        attn_every=attn_every,
        attn_offset=attn_every // 2,
    )
    want = cfg.attn_layer_idx
    got = list(attn_layers) if isinstance(attn_layers, (list, tuple, range)) else attn_layers
    if isinstance(got, list) and len(got) == len(want) and got != want:
        return "attn_layers: the right count; the rule's offset is attn_every // 2, not 0"
    if got != want:
        return "attn_layers: layer i (0-based) is attention when i % attn_every == attn_every // 2"
    if not close(attn_share, len(want) / n_layer):
        return "attn_share: the attention layers as a fraction of all layers"
    return None


# the small hybrid of the exercise: M M A M, 64 wide, Mamba-1's defaults (N = 16, d_conv = 4)
HYBRID = dict(d_model=64, n_layer=4, vocab_size=256, attn_every=4, attn_offset=2)


def _cache_split(seq_len: int) -> tuple[int, int]:
    """(bytes of the SSM layers' states, bytes of the attention layers' keys and values) that the
    exercise's hybrid holds after a prefill of ``seq_len`` tokens, batch 1, fp32: measured on the
    model's own cache."""
    import torch

    from ..models import KVState, ModelConfig, build_model

    model = build_model(ModelConfig(**HYBRID), seed=0).eval()
    cache = model.allocate_cache(1)
    ids = torch.randint(
        0, HYBRID["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        model(ids, cache=cache, logits_to_keep=1)
    kv = sum(s.nbytes() for s in cache.layers if isinstance(s, KVState))
    return cache.nbytes() - kv, kv


@exercise(
    "03.2",
    "what a generation cache holds",
    ("ssm_bytes", "kv_bytes"),
    wrong={"ssm_bytes": 3 * 128 * 16 * 4, "kv_bytes": 1024 * 64 * 4},
)
def _(ssm_bytes, kv_bytes, seq_len=1024):
    ssm, kv = _cache_split(seq_len)
    if ssm_bytes * (16 + 4) == ssm * 16:
        return "ssm_bytes: the state h, yes; each Mamba layer also keeps its conv's last inputs"
    if ssm_bytes != ssm:
        return "ssm_bytes: per Mamba layer, d_inner x (d_state + d_conv) fp32 numbers"
    if 2 * kv_bytes == kv:
        return "kv_bytes: the keys, yes; the values are cached too"
    if kv_bytes != kv:
        return "kv_bytes: the attention layer keeps a key and a value of d_model numbers per token"
    return None
