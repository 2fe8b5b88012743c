"""The models train_step and generation time: ssmkit's Mamba-1 and Mamba-2 (130M, or two-layer tiny
ones with --quick), transformers' twins of their weights and a Llama matched in size."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import ssmkit

from .context import Context


def _load_hf(cls, path):
    """transformers' model class ``cls`` loaded from the directory ``path``, in fp32, offline."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    try:
        return cls.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except TypeError:  # transformers < 4.56: torch_dtype
        return cls.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32)


QUICK_PRESETS = ("tiny", "tiny-mamba2")  # with QUICK_OVERRIDES: two layers, seconds on a CPU
QUICK_OVERRIDES = {"n_layer": 2}
FULL_PRESETS = ("mamba-130m", "mamba2-130m")


def build_models(
    ctx: Context, presets: tuple[str, str], max_len: int, peers: bool
) -> tuple[dict, dict]:
    """ssmkit Mamba-1 and Mamba-2 (seed 0), transformers' twins of their weights (``peers``) and the
    Llama matched to Mamba-1's non-embedding size, all on the device; and a note per model."""
    from ssmkit.models import matched_transformer

    models, notes = {}, {}
    with tempfile.TemporaryDirectory(prefix="ssmkit-gpu-check-") as tmp:
        for key, preset in zip(("ssmkit_mamba1", "ssmkit_mamba2"), presets):
            torch.manual_seed(0)
            overrides = QUICK_OVERRIDES if ctx.quick else {}
            model = ssmkit.build_model(ssmkit.ModelConfig.preset(preset, **overrides))
            if peers:
                from transformers import Mamba2ForCausalLM, MambaForCausalLM

                model.save_pretrained(Path(tmp) / key, format="hf")
            models[key] = model.to(ctx.device)
            if peers:
                cls = MambaForCausalLM if key.endswith("1") else Mamba2ForCausalLM
                twin = _load_hf(cls, Path(tmp) / key)
                models["hf_" + key.removeprefix("ssmkit_")] = twin.to(ctx.device)
        torch.manual_seed(0)
        llama = matched_transformer(models["ssmkit_mamba1"], max_len=max_len).to(ctx.device)
        attention = getattr(llama.config, "_attn_implementation", None)
        notes["llama"] = f"attn_implementation {attention}"
        models["llama"] = llama
    return models, notes
