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
import re
from collections.abc import Callable
from pathlib import Path

import torch

from .. import checks, io
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


# safetensors' dtype names -> torch's; a name not here is no dtype a parameter can take
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def check_finite(name: str, tensor: torch.Tensor, where) -> None:
    """:class:`CheckpointError` naming ``where`` (a file) and the tensor ``name`` when ``tensor``
    holds a NaN or inf: a model with one gives NaN logits (a diverged or corrupted checkpoint)."""
    # a sum is NaN or inf when a value is (one pass, no copy: ~5x faster than isfinite on a 130M
    # model); only then is every value checked, as a sum can also overflow
    if not torch.isfinite(torch.sum(tensor, dtype=torch.float32)) and (
        bad := int((~torch.isfinite(tensor)).sum())
    ):
        raise CheckpointError(
            f"{where}: weight {name} holds {bad:,} NaN or infinite "
            f"value{'s' if bad > 1 else ''} of {tensor.numel():,}; a model with them "
            "gives NaN logits (a diverged or corrupted checkpoint)"
        )


class _Weights:
    """A checkpoint folder's weight files, read in two steps: :attr:`header` (each tensor's file,
    dtype and shape; for safetensors its JSON header only, no tensor data) is checked against the
    config before anything is built or allocated, then :meth:`tensors` reads the data."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        loaders = {
            "model.safetensors": self._safetensors_header,
            "pytorch_model.bin": self._torch_file,
        }
        for single, read in loaders.items():  # one file, or shards listed in its index
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
        self._safe_open = safe_open
        self.header: dict[str, tuple[Path, torch.dtype | str, tuple[int, ...]]] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # pytorch_model.bin: read whole (mmap)
        self.files = [folder / name for name in files]
        for path in self.files:
            if not path.exists():
                raise CheckpointError(
                    f"{path} is missing: a checkpoint without all its weight files cannot load"
                )
            try:
                read(path)
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(
                    f"cannot read {path}: {type(exc).__name__}: {exc} (corrupt or truncated?)"
                ) from None

    def _safetensors_header(self, path: Path):
        with self._safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                dtype = piece.get_dtype()
                self.header[name] = (
                    path,
                    _SAFETENSORS_DTYPES.get(dtype, dtype),
                    tuple(piece.get_shape()),
                )

    def _torch_file(self, path: Path):
        try:  # a zip file (torch >= 1.6) maps without reading; an older one is read whole
            part = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            part = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(part, dict) or not all(
            isinstance(t, torch.Tensor) for t in part.values()
        ):
            raise CheckpointError(f"{path} holds no state dict of tensor name -> tensor")
        for name, tensor in part.items():
            self.header[name] = (path, tensor.dtype, tuple(tensor.shape))
        self._loaded.update(part)

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor as a meta tensor of its shape and dtype: no memory, for the checks."""
        return {
            name: torch.empty(shape, dtype=dtype, device="meta")
            for name, (_, dtype, shape) in self.header.items()
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor's data, each checked finite (a NaN or inf weight makes every logit NaN)."""
        from safetensors.torch import load_file

        state = dict(self._loaded)
        for path in self.files:
            if path.suffix == ".safetensors":
                try:
                    state.update(load_file(str(path)))
                except Exception as exc:
                    raise CheckpointError(
                        f"cannot read {path}: {type(exc).__name__}: {exc} (corrupt or truncated?)"
                    ) from None
        for name, tensor in state.items():
            check_finite(name, tensor, self.header[name][0])
        return state

    def check_dtypes(self):
        """Every tensor is floating point: ssmkit's parameters all are, and an integer (or bool)
        tensor cast to float silently is a different model (a quantized or corrupt file)."""
        for name, (path, dtype, _) in self.header.items():
            if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                shown = str(dtype).removeprefix("torch.")
                raise CheckpointError(
                    f"{path}: weight {name} has dtype {shown}; ssmkit's parameters are floating "
                    "point (float32, bfloat16, float16): a quantized or corrupt checkpoint "
                    "does not load"
                )

    def check_layers(self, raw: dict, config: Path):
        """The layer count config.json declares is the one the weights hold (their names'
        ``backbone.layers.N.`` / ``model.layers.N.``), checked before the config builds anything:
        a config declaring 10**9 layers would take hours to build (and then to refuse)."""
        key = _layers_field(raw)
        declared = _declared_layers(raw)
        if declared < 1:
            return  # missing or malformed: reading the config names the field
        found = {int(m[1]) for name in self.header if (m := _LAYER_INDEX.match(name))}
        held = max(found) + 1 if found else 0
        if held != declared:
            where = self.files[0] if len(self.files) == 1 else f"{len(self.files)} weight files"
            names = "" if found else "; no tensor is named backbone.layers.N.* or model.layers.N.*"
            raise CheckpointError(
                f"{config}: field {key!r} declares {declared:,} layers, but the weights "
                f"({where}) hold {held:,}{names}: this config does not belong to these weights"
            )

    def check_experts(self, raw: dict, config: Path):
        """Jamba's ``num_experts`` against the experts the weights hold (per expert,
        ``experts.J.``, or fused, ``experts.gate_up_proj`` of shape (E, ...)): a config declaring
        10**6 experts would take hours to build on the meta device. Weights with no experts at all
        may be right (no layer is a mixture-of-experts layer) unless the count is absurd."""
        declared = raw.get("num_experts")
        if not (checks.is_integer(declared) and declared > 1):
            return
        held = set()
        for name, (_, _, shape) in self.header.items():
            if m := _EXPERT_INDEX.search(name):
                held.add(int(m[1]) + 1)
            elif name.endswith(".experts.gate_up_proj") and shape:
                held.add(shape[0])
        most = max(held, default=0)
        if (held and most != declared) or (not held and declared > 1024):
            raise CheckpointError(
                f"{config}: field 'num_experts' declares {declared:,} experts, but the weights "
                f"hold {most:,}: this config does not belong to these weights"
            )


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def _layers_field(raw: dict) -> str | None:
    """The config.json field that states the layer count: transformers', mamba_ssm's, or Zamba2's
    list of layer types."""
    for key in ("num_hidden_layers", "n_layer", "layers_block_type"):
        if key in raw:
            return key
    return None


def _declared_layers(raw: dict) -> int:
    """The layer count a config.json object declares; 0 when it states none or no count."""
    value = raw.get(_layers_field(raw))
    if isinstance(value, list):
        value = len(value)
    return value if checks.is_integer(value) and value >= 1 else 0


_LAYER_INDEX = re.compile(r"(?:backbone|model)\.layers\.(\d+)\.")


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


def _checked(model: MambaLM, state: dict[str, torch.Tensor], source: str) -> dict:
    """``state`` as ``model`` loads it (a tied lm_head dropped) after checking every name and shape
    against ``model``'s; both may be on the meta device (the check before anything is allocated)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
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
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{source}: weight {name} has shape {tuple(tensor.shape)}, "
                f"the config implies {expected[name]}"
            )
    return state


def _load_into(model: MambaLM, state: dict[str, torch.Tensor], source: str):
    """Copy ``state`` into ``model`` after checking every name and shape; nothing is copied on
    error."""
    model.load_state_dict(_checked(model, state, source), strict=not model.config.tie_embeddings)


def is_hub_id(text: str | os.PathLike) -> bool:
    """Whether ``text`` that names no local file reads as a Hugging Face hub id ``owner/name``: one
    slash, no leading ".", "/" or "~", only the characters the hub allows, and no local directory
    ``owner`` (with a ``runs/`` here, ``runs/nope`` is a mistyped local path, not a hub id)."""
    text = str(text)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        return False
    owner, name = text.split("/")
    return (
        all(_HUB_NAME.fullmatch(part) and ".." not in part for part in (owner, name))
        and len(name) <= 96
        and not Path(owner).exists()
    )


# the hub's repo id rules: letters, digits, "-", "_", "."; no "-" or "." at either end. A part with
# a space, a backslash or "*" is a mistyped path, never an id
_HUB_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?")


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


def _raw_config(folder: Path) -> tuple[Path, dict]:
    """(the path of a checkpoint folder's config.json, its JSON object); a CheckpointError naming
    the file when it is missing, unreadable or no object."""
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        raw = io.read_json(path, "config")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{path}: it holds a JSON {type(raw).__name__}, not an object of config fields"
        )
    return path, raw


def _layout(path: Path, raw: dict) -> tuple[Callable[[dict], ModelConfig], Callable]:
    """The reader of a config.json object's layout (config -> ModelConfig) and its renaming of the
    weights to ours; an unknown layout is a CheckpointError naming config.json."""
    if "model_type" in raw:
        if raw["model_type"] not in READERS:
            raise CheckpointError(
                f"{path}: model_type {raw['model_type']!r} is not supported; ssmkit loads "
                f"{', '.join(map(repr, READERS))}"
            )
        return READERS[raw["model_type"]]
    if "d_model" in raw and "n_layer" in raw:
        return config_from_mamba_ssm, _same_names
    raise CheckpointError(
        f"{path}: unknown layout; expected a transformers config (model_type) "
        "or a mamba_ssm config (d_model, n_layer, ssm_cfg)"
    )


def _read_config(path: Path, read_config: Callable[[dict], ModelConfig], raw: dict) -> ModelConfig:
    """The ModelConfig of a config.json object; any problem is a CheckpointError naming config.json
    and the field."""
    try:
        return read_config(raw)
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
    # Everything is checked against the weights' header before anything is built or allocated:
    # the layer count (a config declaring 10**9 layers would hang building them), the dtypes, then
    # every name and shape against the model built on the meta device (a config wider than its
    # weights would otherwise allocate terabytes before the shapes are compared).
    path, raw = _raw_config(folder)
    read_config, rename = _layout(path, raw)
    try:
        weights = _Weights(folder)
    except CheckpointError as exc:  # none, or unreadable: said after the config's own errors, ...
        if _declared_layers(raw) > 1024:  # ... unless building the config could take hours
            raise
        _read_config(path, read_config, raw)
        raise exc from None
    weights.check_layers(raw, path)
    weights.check_experts(raw, path)
    cfg = _read_config(path, read_config, raw)
    weights.check_dtypes()

    def renamed(state: dict) -> dict:
        try:
            return rename(state, cfg)
        except CheckpointError as exc:
            raise CheckpointError(f"{folder}: {exc}") from None

    with torch.device("meta"):
        model = MambaLM(cfg)
    _checked(model, renamed(weights.meta()), str(folder))
    state = renamed(weights.tensors())
    model = model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.backbone.embedding.weight
    _load_into(model, state, str(folder))
    model.name_or_path = str(path_or_id)
    return (
        model.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else model
    )
