"""Loading: ``from_pretrained`` reads a transformers or mamba_ssm checkpoint directory (or a hub
id).

The layout is detected from ``config.json``: a transformers config by its ``model_type``
(:data:`READERS`: "mamba", "falcon_mamba", "mamba2" in :mod:`ssmkit.hub.layouts`, "jamba" in
:mod:`ssmkit.hub.jamba`, "zamba2" in :mod:`ssmkit.hub.zamba2`), a mamba_ssm config by ``d_model``
and ``n_layer``. Every weight is mapped by name and every shape checked before anything is copied: a
checkpoint loads whole or not at all, and every problem with it (a config field, a shard index, a
weight file) is a :class:`~ssmkit.hub.layouts.CheckpointError` naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from .. import io
from ..env import pick_device
from ..models import MambaLM, ModelConfig
from . import jamba, zamba2
from .layouts import CheckpointError, config_from_hf, config_from_mamba_ssm

# the dtype names every loader accepts (parse_dtype)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _from_hf_names(state: dict, cfg: ModelConfig) -> dict:
    """transformers' Mamba / Mamba2 names are ours but for the embedding's."""
    ours = {"backbone.embeddings.weight": "backbone.embedding.weight"}
    return {ours.get(k, k): v for k, v in state.items()}


def _same_names(state: dict, cfg: ModelConfig) -> dict:
    return state


# transformers model_type -> (config.json -> ModelConfig, its state dict -> ours); a name the
# renaming does not know is kept, so that loading reports it as unexpected
READERS = {
    "mamba": (config_from_hf, _from_hf_names),
    "falcon_mamba": (config_from_hf, _from_hf_names),
    "mamba2": (config_from_hf, _from_hf_names),
    "jamba": (jamba.config_from_jamba, jamba.state_from_jamba),
    "zamba2": (zamba2.config_from_zamba2, zamba2.state_from_zamba2),
}

# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: model.safetensors, pytorch_model.bin, or their shards."""
    from safetensors.torch import load_file

    loaders = {
        "model.safetensors": lambda p: load_file(str(p)),
        "pytorch_model.bin": lambda p: torch.load(p, map_location="cpu", weights_only=True),
    }
    for single, load in loaders.items():  # one file, or shards listed in its index
        index = folder / f"{single}.index.json"
        if index.exists():
            files = _shard_names(index)
            break
        if (folder / single).exists():
            files = [single]
            break
    else:
        raise CheckpointError(
            f"no weights in {folder}: expected model.safetensors, pytorch_model.bin or a "
            "*.index.json of shards"
        )
    state = {}
    for name in files:
        path = folder / name
        if not path.exists():
            raise CheckpointError(
                f"{path} is missing: a checkpoint without all its weight files cannot load"
            )
        try:
            part = load(path)
        except Exception as exc:
            raise CheckpointError(
                f"cannot read {path}: {type(exc).__name__}: {exc} (corrupt or truncated?)"
            ) from None
        state.update(part)
    return state


def _shard_names(index: Path) -> list[str]:
    """The shard files an ``*.index.json`` lists: plain names inside the checkpoint folder only (an
    entry like ``../../secret`` would read a file outside it)."""
    try:
        weight_map = io.read_json(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(
                f"shard index {index} has no 'weight_map' object of tensor name -> shard file"
            )
        return sorted({io.plain_name(name, f"shard index {index}") for name in weight_map.values()})
    except (ValueError, AttributeError) as exc:  # AttributeError: the JSON is not an object
        raise CheckpointError(
            str(exc)
            if isinstance(exc, ValueError)
            else f"shard index {index} is not a JSON object with a 'weight_map'"
        ) from None


def _load_into(model: MambaLM, state: dict[str, torch.Tensor], source: str):
    """Copy ``state`` into ``model`` after checking every name and shape; nothing is copied on
    error."""
    expected = model.state_dict()
    if model.config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        expected.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected weights {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: weight {name} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=not model.config.tie_embeddings)


def is_hub_id(text: str | os.PathLike) -> bool:
    """Whether ``text`` that names no local file reads as a Hugging Face hub id ``owner/name``: one
    slash, no leading ".", "/" or "~", and no local directory ``owner`` (with a ``runs/`` here,
    ``runs/nope`` is a mistyped local path, not a hub id)."""
    text = str(text)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        return False
    owner, name = text.split("/")
    return bool(owner and name) and not Path(owner).exists()


def _resolve(path_or_id: str | os.PathLike) -> Path:
    path = Path(path_or_id)
    if path.is_dir():
        return path
    if path.exists() or not is_hub_id(path_or_id):
        raise CheckpointError(
            f"{path_or_id!r} is neither a checkpoint directory nor a hub id "
            "like 'state-spaces/mamba-130m'"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                str(path_or_id),
                allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt", "*.model"],
            )
        )
    except Exception as exc:
        raise CheckpointError(
            f"{path_or_id!r} is no local directory, and cannot be fetched from the Hugging Face "
            f"hub ({type(exc).__name__}: {exc}). Offline (HF_HUB_OFFLINE=1 or no network) only "
            "cached snapshots load; pass a local directory instead."
        ) from None


def _read_config(folder: Path) -> tuple[ModelConfig, Callable[[dict, ModelConfig], dict]]:
    """The ModelConfig of a checkpoint folder and its layout's renaming of the weights to ours; any
    problem is a CheckpointError naming config.json (and the field)."""
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        raw = io.read_json(path, "config")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    try:
        if not isinstance(raw, dict):
            raise CheckpointError(
                f"it holds a JSON {type(raw).__name__}, not an object of config fields"
            )
        if "model_type" in raw:
            if raw["model_type"] not in READERS:
                raise CheckpointError(
                    f"model_type {raw['model_type']!r} is not supported; ssmkit loads "
                    f"{', '.join(map(repr, READERS))}"
                )
            read_config, rename = READERS[raw["model_type"]]
            return read_config(raw), rename
        if "d_model" in raw and "n_layer" in raw:
            return config_from_mamba_ssm(raw), _same_names
        raise CheckpointError(
            "unknown layout; expected a transformers config (model_type) "
            "or a mamba_ssm config (d_model, n_layer, ssm_cfg)"
        )
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The torch.dtype a user's ``dtype`` names: None (keep the weights' own), a floating
    torch.dtype, or one of the names in :data:`DTYPES` ("bf16", "float16", "torch.float32", ...; any
    case). Anything else is a ValueError listing the valid names. Every loader of ssmkit reads
    ``dtype=`` with this."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(
        f"dtype={dtype!r} is not supported; valid: {', '.join(DTYPES)} or a floating torch.dtype"
    )


def from_pretrained(
    path_or_id: str | os.PathLike, dtype: torch.dtype | str | None = None, device=None
) -> MambaLM:
    """Load a transformers (Mamba, FalconMamba, Mamba2, dense Jamba, Zamba2) or mamba_ssm checkpoint
    directory, or a hub id.

    dtype: a torch.dtype or a name (float32/fp32, bfloat16/bf16, float16/fp16/half); device: "cpu",
    "cuda", "cuda:N", "mps", "auto" or a torch.device. Both are checked before anything is read.
    """
    dtype = parse_dtype(dtype)
    if device is not None:
        device = pick_device(str(device) if isinstance(device, torch.device) else device)
    folder = _resolve(path_or_id)
    cfg, rename = _read_config(folder)
    state = _read_state_dict(folder)
    try:
        state = rename(state, cfg)
    except CheckpointError as exc:
        raise CheckpointError(f"{folder}: {exc}") from None
    with torch.device("meta"):
        model = MambaLM(cfg)
    model = model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.backbone.embedding.weight
    _load_into(model, state, str(folder))
    model.name_or_path = str(path_or_id)
    return (
        model.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else model
    )
