"""A checkpoint as mamba_ssm's ``MambaLMHeadModel.save_pretrained`` writes one, built from
mamba_ssm's documented names, shapes and defaults (``mamba_ssm/modules/mamba_simple.py``,
``mamba2.py``, ``mamba3.py``, ``models/mixer_seq_simple.py``), never from ssmkit: the oracle the
hub's loaders are held to. One writer for the three mixers, shared by the hub's tests.

    state = write_mamba_ssm_checkpoint(folder, {"layer": "Mamba2", "d_state": 8, "headdim": 16})
"""

from __future__ import annotations

import json

import torch


def _mamba1(d_inner: int, cfg: dict) -> dict[str, tuple]:
    """Mamba (S6): in_proj to x and z, depthwise conv, x_proj to (Δ rank, B, C), dt_proj."""
    n, rank = cfg.get("d_state", 16), cfg.get("dt_rank", -(-(d_inner // 2) // 16))  # "auto"
    return {
        "in_proj.weight": (2 * d_inner, d_inner // 2),
        "conv1d.weight": (d_inner, 1, 4),
        "conv1d.bias": (d_inner,),
        "x_proj.weight": (rank + 2 * n, d_inner),
        "dt_proj.weight": (d_inner, rank),
        "dt_proj.bias": (d_inner,),
        "A_log": (d_inner, n),
        "D": (d_inner,),
        "out_proj.weight": (d_inner // 2, d_inner),
    }


def _mamba2(d_inner: int, cfg: dict) -> dict[str, tuple]:
    """Mamba2 (SSD): in_proj to (z, x, B, C, Δ), conv over x, B and C, a gated RMSNorm."""
    n, headdim, groups = cfg.get("d_state", 128), cfg.get("headdim", 64), cfg.get("ngroups", 1)
    heads, conv_dim = d_inner // headdim, d_inner + 2 * groups * n
    return {
        "in_proj.weight": (d_inner + conv_dim + heads, d_inner // 2),
        "conv1d.weight": (conv_dim, 1, 4),
        "conv1d.bias": (conv_dim,),
        "dt_bias": (heads,),
        "A_log": (heads,),
        "D": (heads,),
        "norm.weight": (d_inner,),
        "out_proj.weight": (d_inner // 2, d_inner),
    }


def _mamba3(d_inner: int, cfg: dict) -> dict[str, tuple]:
    """Mamba3: no conv; in_proj to (z, x, B, C, Δ, A, λ, rotation angles), B/C biases and norms,
    MIMO projections of rank R, an optional per-head norm before out_proj."""
    n, headdim, groups = cfg.get("d_state", 128), cfg.get("headdim", 64), cfg.get("ngroups", 1)
    rank = cfg.get("mimo_rank", 4) if cfg.get("is_mimo") else 1
    heads, angles = d_inner // headdim, int(n * cfg.get("rope_fraction", 0.5)) // 2
    shapes = {
        "in_proj.weight": (2 * d_inner + 2 * n * groups * rank + 3 * heads + angles, d_inner // 2),
        "dt_bias": (heads,),
        "B_bias": (heads, rank, n),
        "C_bias": (heads, rank, n),
        "B_norm.weight": (n,),
        "C_norm.weight": (n,),
        "D": (heads,),
        "out_proj.weight": (d_inner // 2, d_inner),
    }
    if cfg.get("is_mimo"):
        shapes.update({f"mimo_{k}": (heads, rank, headdim) for k in "xzo"})
    if cfg.get("is_outproj_norm"):
        shapes["norm.weight"] = (d_inner,)
    return shapes


MIXERS = {"Mamba1": _mamba1, "Mamba2": _mamba2, "Mamba3": _mamba3}


def write_mamba_ssm_checkpoint(
    folder,
    ssm_cfg: dict,
    *,
    d_model: int = 32,
    n_layer: int = 2,
    vocab_size: int = 50,
    pad_vocab_size_multiple: int = 8,
    d_intermediate: int = 0,
    seed: int = 5,
) -> dict[str, torch.Tensor]:
    """Write ``folder/config.json`` (exactly mamba_ssm's ``MambaConfig`` fields) and
    ``folder/pytorch_model.bin`` for a model of ``n_layer`` blocks of the mixer ``ssm_cfg["layer"]``
    (expand 2; with a GatedMLP of ``d_intermediate`` when > 0, its hidden width rounded up to 128 as
    mamba_ssm does), weights 0.2 N(0, 1) from ``seed``, the head tied to the embedding. Returns the
    state dict written."""
    layer = ssm_cfg["layer"]
    config = {
        "d_model": d_model, "d_intermediate": d_intermediate, "n_layer": n_layer,
        "vocab_size": vocab_size, "ssm_cfg": dict(ssm_cfg), "attn_layer_idx": [], "attn_cfg": {},
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": pad_vocab_size_multiple, "tie_embeddings": True,
    }  # fmt: skip
    rows = -(-vocab_size // pad_vocab_size_multiple) * pad_vocab_size_multiple
    shapes = {"backbone.embedding.weight": (rows, d_model), "backbone.norm_f.weight": (d_model,)}
    mixer = MIXERS[layer](2 * d_model, ssm_cfg)
    hidden = (d_intermediate + 127) // 128 * 128
    for i in range(n_layer):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (d_model,)
        shapes.update({p + "mixer." + name: shape for name, shape in mixer.items()})
        if d_intermediate:
            shapes[p + "norm2.weight"] = (d_model,)
            shapes[p + "mlp.fc1.weight"] = (2 * hidden, d_model)
            shapes[p + "mlp.fc2.weight"] = (d_model, hidden)
    g = torch.Generator().manual_seed(seed)
    state = {k: 0.2 * torch.randn(s, generator=g) for k, s in shapes.items()}
    state["lm_head.weight"] = state["backbone.embedding.weight"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(state, folder / "pytorch_model.bin")
    return state
