"""The exercises of papers/04_mamba2.ipynb (Mamba-2 / SSD): the mask L by hand, one chunk is the
quadratic form, and a Mamba-2 state against a KV cache."""

from __future__ import annotations

import torch

from . import close, exercise

_F64 = dict(dtype=torch.float64)
_g = torch.Generator().manual_seed(0)
# p04.2's wrong answer's inputs: x (1, 4, 1, 2), dt (1, 4, 1), A (1,), B and C (1, 4, 1, 2)
_SSD = dict(
    x=torch.randn(1, 4, 1, 2, generator=_g, **_F64),
    dt=torch.full((1, 4, 1), 0.5, **_F64),
    A=-torch.ones(1, **_F64),
    B=torch.randn(1, 4, 1, 2, generator=_g, **_F64),
    C=torch.randn(1, 4, 1, 2, generator=_g, **_F64),
)


@exercise(
    "p04.1",
    "the mask L by hand",
    ("by_hand",),
    wrong={
        "by_hand": torch.tensor(
            [[1, 0, 0, 0], [0.5, 1, 0, 0], [0.5, 0.5, 1, 0], [0.5, 0.5, 0.5, 1]], **_F64
        )
    },  # fmt: skip
)
def _(by_hand):
    """L for a = (0.5, 0.5, 0.5, 0.5) against torch.exp(segsum(torch.log(a))) (allclose)."""
    from ssmkit.ops.ssd import segsum

    want = torch.exp(segsum(torch.log(torch.full((4,), 0.5, **_F64))))
    got = torch.as_tensor(by_hand, **_F64)
    if got.shape != want.shape:
        return f"L has shape {tuple(got.shape)}: it is (T, T), here 4 x 4"
    off = ~torch.isclose(got, want)
    if off.any():
        t, s = (int(i) for i in off.nonzero()[0])
        where = "above" if s > t else "on" if s == t else "below"
        return f"entry (t={t}, s={s}), {where} the diagonal, is off: L_ts = a_(s+1) ··· a_t"
    return None


@exercise(
    "p04.2",
    "one chunk is the quadratic form",
    ("y_one",),
    wrong={"y_one": torch.zeros(1, 4, 1, 2, **_F64), **_SSD},
)
def _(y_one, x, dt, A, B, C):
    """y of one chunk over the whole sequence against ssmkit's quadratic form (ssd_quadratic),
    to 1e-12 absolute."""
    from ssmkit.ops.ssd import ssd_quadratic

    want = ssd_quadratic(x, dt, A, B, C)
    got = y_one[0] if isinstance(y_one, tuple) else y_one  # ssd_minimal returns (y, state)
    if not torch.is_tensor(got) or got.shape != want.shape:
        return f"y_one should be y, a tensor shaped like x {tuple(x.shape)}"
    if not torch.allclose(got, want, rtol=0, atol=1e-12):
        return "y_one differs from the quadratic form: is the chunk the whole sequence (Q = L)?"
    return None


@exercise(
    "p04.3",
    "a state against a KV cache",
    ("state_bytes", "kv_tokens"),
    wrong={"state_bytes": 24 * 64 * 128 * 4, "kv_tokens": 128.0},
)
def _(state_bytes, kv_tokens):
    """H·P·N bf16 numbers, and the KV-cache tokens (K and V of 24 heads of 64, bf16) as big."""
    from ssmkit.models import ModelConfig
    from ssmkit.papers.p06_jamba import cache_bytes

    want = 24 * 64 * 128 * 2  # H · P · N numbers of 2 bytes
    if state_bytes != want:
        side = "too large" if state_bytes > want else "too small"
        return f"state_bytes is {side}: H · P · N numbers, 2 bytes each in bf16"
    attn = ModelConfig(d_model=24 * 64, n_layer=1, vocab_size=32, mixer="attn",
                       attn_cfg={"num_heads": 24})  # fmt: skip
    per_token = cache_bytes(attn, 1, elem=2)  # one token's K and V, bf16
    if not close(kv_tokens, want / per_token):
        side = "too many" if kv_tokens > want / per_token else "too few"
        return f"kv_tokens is {side}: a token's cache is K and V, 24 heads of 64, 2 bytes each"
    return None
