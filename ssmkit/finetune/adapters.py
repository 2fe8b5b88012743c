"""LoRA adapters on disk in peft's format, and the same adapter for transformers' Mamba models.

    save_adapter(lora, "adapter/")                 # adapter_config.json + adapter_model.safetensors
    lora = load_adapter(ssmkit.from_pretrained(base_dir), "adapter/", trainable=True)
    adapter_for_transformers("adapter/", "adapter-hf/", model.config)  # for MambaForCausalLM...
    # then, with transformers and peft:
    # PeftModel.from_pretrained(MambaForCausalLM.from_pretrained(hf_base_dir), "adapter-hf/")

The directory is what ``PeftModel.save_pretrained`` writes: ``adapter_config.json`` (the
``LoraConfig``, ``peft_type: LORA``, ``inference_mode: true``) and ``adapter_model.safetensors``
(the adapter's tensors under peft's names, e.g.
``base_model.model.backbone.layers.0.mixer.in_proj.lora_A.weight``). Each file is written
atomically, the weights first: a directory with a config always has its weights. Loading checks the
names and shapes against the model before any value is set.

Module names, ssmkit vs transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` /
``FalconMambaForCausalLM`` (the "hf" format of :func:`ssmkit.hub.save_pretrained`): the same but for
the embedding, ``backbone.embedding`` here and ``backbone.embeddings`` there
(:func:`adapter_for_transformers` renames it).
What cannot be carried over (:data:`NOT_FOR_TRANSFORMERS`): peft >= 0.16 refuses LoRA on
``out_proj`` and ``conv1d`` for model types mamba, mamba2 and falcon_mamba
(``_check_lora_target_modules_mamba`` in peft's tuners_utils), and transformers' Mamba and
FalconMamba forward read ``dt_proj.weight`` directly (``time_step = self.dt_proj.weight @ ...``), so
peft's wrapper there is bypassed and a ``dt_proj`` adapter silently does nothing. Such an adapter is
a ValueError naming the module, the reason and the two ways out:

* :func:`export_for_transformers` folds the adapter on those modules into the base weights (what
  merging computes, LoRA or DoRA) and writes that base in transformers' format beside the REST of
  the adapter, which peft loads onto it: the same logits, with the adapter still separate;
* :func:`ssmkit.finetune.export_merged` writes the fully merged weights (no adapter at all).

Hybrids, Mamba-3 and Zamba2 have no transformers class with ssmkit's module names: the merged
export is their way out. DoRA adapters (``use_dora``, their ``lora_magnitude_vector`` tensors)
carry over as they are; peft computes DoRA the same way on both sides.
"""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path

import torch
from torch import nn

from ..hub.load import check_finite
from ..io import read_json, write_atomically
from ..models import ModelConfig, lora_aware
from .lora import _base, _peft, apply_lora, check_config_values

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
REFUSED_BY_PEFT = ("out_proj", "conv1d")  # peft's incompatible modules for Mamba model types
_PEFT_REFUSES = (
    "peft (>= 0.16) refuses LoRA on it for transformers' Mamba models (model_type mamba / mamba2 / "
    "falcon_mamba), so PeftModel.from_pretrained would raise there"
)
# the modules whose adapter transformers' Mamba models cannot take, and why
NOT_FOR_TRANSFORMERS = {
    **dict.fromkeys(REFUSED_BY_PEFT, _PEFT_REFUSES),
    "dt_proj": (
        "transformers' MambaForCausalLM and FalconMambaForCausalLM read dt_proj.weight directly "
        "in their forward (time_step = dt_proj.weight @ ...), bypassing peft's wrapper, so the "
        "adapter there would silently have no effect"
    ),
}


def _jsonable(value):
    if isinstance(value, set):
        return sorted(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def config_dict(config) -> dict:
    """A ``peft.LoraConfig`` as the JSON of adapter_config.json (sets as sorted lists, enums as
    values)."""
    return _jsonable(config.to_dict())


def _write(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save

    if directory.exists() and not directory.is_dir():
        raise ValueError(
            f"{directory} exists and is not a directory; an adapter is a directory of two files"
        )
    directory.mkdir(parents=True, exist_ok=True)
    blob = save(
        {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
        metadata={"format": "pt"},
    )
    write_atomically(directory / ADAPTER_WEIGHTS, blob)
    write_atomically(
        directory / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n"
    )
    return directory


def adapter_state(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (no adapter name inside): what the file holds.
    The base's embedding matrices never go in (peft's "auto" would add them when the embedding is a
    target, for a resized vocabulary, which ssmkit never does; its check would also read the base's
    config)."""
    return _peft().get_peft_model_state_dict(
        model, adapter_name=adapter_name, save_embedding_layers=False
    )


def save_adapter(
    model: nn.Module, directory: str | os.PathLike, adapter_name: str = "default"
) -> Path:
    """Write adapter ``adapter_name`` of a peft model (from :func:`~ssmkit.finetune.apply_lora`) to
    ``directory`` in peft's format (see the module docstring). Returns the directory."""
    if not hasattr(model, "peft_config") or adapter_name not in model.peft_config:
        have = list(getattr(model, "peft_config", {}))
        raise ValueError(
            f"no LoRA adapter {adapter_name!r} on this model (adapters: {have or 'none'}); "
            "make one with ssmkit.finetune.apply_lora"
        )
    config = config_dict(model.peft_config[adapter_name])
    config["inference_mode"] = True  # as PeftModel.save_pretrained writes it
    return _write(Path(directory), config, adapter_state(model, adapter_name))


def read_adapter(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json as a dict, the tensors) of an adapter directory; ValueError naming what
    is missing or not a LoRA adapter."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / name).is_file():
            raise ValueError(
                f"{directory} is not a LoRA adapter directory: {name} is missing "
                f"(expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, as peft writes them)"
            )
    config = read_json(directory / ADAPTER_CONFIG, "adapter config")
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        got = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise ValueError(
            f"{directory / ADAPTER_CONFIG} is not a LoRA adapter (peft_type {got!r}, expected "
            "'LORA')"
        )
    try:
        tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    except Exception as exc:  # safetensors' own errors, truncated files
        raise ValueError(
            f"{directory / ADAPTER_WEIGHTS} cannot be read ({type(exc).__name__}: {exc})"
        ) from None
    for name, tensor in tensors.items():  # LoRA's A and B are floats, and finite
        if not tensor.dtype.is_floating_point:
            raise ValueError(
                f"{directory / ADAPTER_WEIGHTS}: {name} has dtype "
                f"{str(tensor.dtype).removeprefix('torch.')}; a LoRA adapter's tensors are "
                "floating point (float32, bfloat16, float16)"
            )
        check_finite(name, tensor, directory / ADAPTER_WEIGHTS)
    return config, tensors


def load_adapter(
    model: nn.Module,
    directory: str | os.PathLike,
    adapter_name: str = "default",
    trainable: bool = False,
):
    """The ssmkit ``model`` with the adapter in ``directory`` (peft's format) on it: a
    ``PeftModel``, built by :func:`~ssmkit.finetune.apply_lora` from the saved config (so the same
    checks and the same untying of tied embeddings apply), then the saved tensors set.
    ``trainable``: the adapter trains on (training mode, requires_grad); else it is frozen and the
    model in eval mode, as peft's ``PeftModel.from_pretrained`` leaves it. The tensors' names and
    shapes must match the adapter the config builds on this model, else ValueError."""
    saved, tensors = read_adapter(directory)
    try:
        config = _peft().PeftConfig.from_peft_type(**saved)
    except (TypeError, ValueError) as exc:  # an unknown or malformed field
        raise ValueError(f"{Path(directory) / ADAPTER_CONFIG}: {exc}") from None
    # peft takes any value here (r 4.5, lora_alpha "8" or -8) and fails later, or silently
    # computes another update: the checks lora_config makes, naming the file
    check_config_values(config, where=str(Path(directory) / ADAPTER_CONFIG))
    config.inference_mode = not trainable
    lora = apply_lora(model, config=config, adapter_name=adapter_name)
    expected = {k: tuple(v.shape) for k, v in adapter_state(lora, adapter_name).items()}
    given = {k: tuple(v.shape) for k, v in tensors.items()}
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    wrong = [
        f"{k}: {given[k]} saved, {expected[k]} here"
        for k in sorted(set(given) & set(expected))
        if given[k] != expected[k]
    ]
    if missing or extra or wrong:
        raise ValueError(
            f"the adapter in {directory} does not fit this model: "
            + "; ".join(
                part
                for part in (
                    f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}" if missing else "",
                    f"unknown {extra[:3]}{' ...' if len(extra) > 3 else ''}" if extra else "",
                    f"shapes {wrong[:3]}" if wrong else "",
                )
                if part
            )
            + ". Load it onto the base model it was trained on"
        )
    _peft().set_peft_model_state_dict(lora, tensors, adapter_name=adapter_name)
    if not trainable:
        lora.eval()
    return lora


def _rename(name: str) -> str:
    """ssmkit's module path -> transformers': ``backbone.embedding`` -> ``backbone.embeddings``
    (anywhere in a dotted name), the rest unchanged."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "backbone" and parts[i + 1] == "embedding":
            parts[i + 1] = "embeddings"
    return ".".join(parts)


def _target_to_hf(target: str) -> str:
    """A target_modules entry under transformers' names: "embedding" -> "embeddings", full names
    renamed."""
    return "embeddings" if target == "embedding" else _rename(target)


def _leaf(target: str) -> str:
    return target.rpartition(".")[2]


def _hint(name: str = "lora_model") -> str:
    return (
        f"ssmkit.finetune.export_for_transformers({name}, base_dir, adapter_dir) folds the "
        "adapter on those modules into the base weights, writes that base in transformers' "
        "format and the rest of the adapter beside it (equal logits); or "
        f"ssmkit.finetune.export_merged({name}, dir, format='hf') writes the fully merged model, "
        "which transformers loads as is"
    )


def _check_transformers_class(config: ModelConfig) -> None:
    from ..hub.save import natural_format

    if natural_format(config) != "hf":
        raise ValueError(
            f"this model (mixers {sorted(set(config.mixers))}, format "
            f"{natural_format(config)!r}) has no transformers Mamba class with ssmkit's module "
            "names, so its adapter cannot be carried over; export the merged model instead: "
            "ssmkit.finetune.export_merged(lora_model, dir) writes the weights with the adapter "
            "inside"
        )


def _listed(config: dict, key: str) -> list[str]:
    value = config.get(key) or []
    return [value] if isinstance(value, str) else list(value)


def _to_transformers(
    saved: dict, tensors: dict, base_model_name_or_path: str | None
) -> tuple[dict, dict]:
    """adapter_config.json and the tensors under transformers' module names."""
    out = dict(saved)
    out["target_modules"] = sorted(_target_to_hf(t) for t in _listed(saved, "target_modules"))
    if _listed(saved, "modules_to_save"):
        out["modules_to_save"] = [_target_to_hf(t) for t in _listed(saved, "modules_to_save")]
    out["base_model_name_or_path"] = base_model_name_or_path
    return out, {_rename(k): v for k, v in tensors.items()}


def adapter_for_transformers(
    directory: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: ModelConfig,
    base_model_name_or_path: str | None = None,
) -> Path:
    """The adapter in ``directory`` (trained on an ssmkit model of ``config``), rewritten for
    transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` / ``FalconMambaForCausalLM`` (load it
    with ``peft.PeftModel.from_pretrained(hf_model, out_dir)``). ``base_model_name_or_path``:
    recorded in the config (the "hf" checkpoint of the base, e.g. from
    ``save_pretrained(base, dir, format="hf")``). DoRA adapters carry over as they are.

    ValueError when transformers cannot take it: a model that has no transformers Mamba class with
    ssmkit's names (hybrids, Mamba-3, Zamba2, Jamba), or an adapter on a module of
    :data:`NOT_FOR_TRANSFORMERS` (out_proj and conv1d: peft refuses them; dt_proj: transformers'
    forward reads its weight raw, so the adapter would silently do nothing). The message names each
    with its reason and points to :func:`export_for_transformers` (the base with those modules
    merged, plus the rest of the adapter) and :func:`~ssmkit.finetune.export_merged`."""
    _check_transformers_class(config)
    saved, tensors = read_adapter(directory)
    names = {_leaf(t) for t in _listed(saved, "target_modules") + _listed(saved, "modules_to_save")}
    refused = sorted(names & set(NOT_FOR_TRANSFORMERS))
    if refused:
        reasons = "; ".join(f"{m}: {NOT_FOR_TRANSFORMERS[m]}" for m in refused)
        raise ValueError(
            f"the adapter adapts {refused}, which transformers' Mamba models cannot take as an "
            f"adapter ({reasons}). Train without them, or {_hint()}"
        )
    out, renamed = _to_transformers(saved, tensors, base_model_name_or_path)
    return _write(Path(out_dir), out, renamed)


def _owner(name: str) -> str | None:
    """The leaf name of the module a peft tensor or parameter belongs to: the part before its
    ``lora_*`` / ``modules_to_save`` / ``original_module`` segment (None for a base tensor)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if i and (part.startswith("lora_") or part in ("modules_to_save", "original_module")):
            return parts[i - 1]
    return None


def _folded_state(model: nn.Module, fold: set[str], adapter_name: str) -> dict[str, torch.Tensor]:
    """The base model's tensors under their plain names, with the adapter ``adapter_name`` on the
    modules whose leaf name is in ``fold`` merged into them (:func:`ssmkit.models.lora_aware.
    merged_parameters`: what peft's merge computes, LoRA or DoRA) and, for ``modules_to_save``
    in ``fold``, the trained copy in place of the original. The model itself is not changed."""
    base = _base(model)
    state = {}
    for name, tensor in base.state_dict().items():
        parts = name.split(".")
        owner = _owner(name)
        if "modules_to_save" in parts:  # the trained copy: ...x.modules_to_save.<adapter>.weight
            i = parts.index("modules_to_save")
            if owner in fold and parts[i + 1] == adapter_name:
                state[".".join(parts[:i] + parts[i + 2 :])] = tensor
            continue
        if "original_module" in parts:  # the frozen original of a module to save
            if owner not in fold:
                state[".".join(p for p in parts if p != "original_module")] = tensor
            continue
        if owner is not None:  # lora_A, lora_B, lora_magnitude_vector, lora_embedding_*
            continue
        state[".".join(p for p in parts if p != "base_layer")] = tensor
    with torch.no_grad():
        for name, module in base.named_modules():
            if lora_aware.is_lora_layer(module) and _leaf(name) in fold:
                present = set(getattr(module, "lora_A", {})) | set(
                    getattr(module, "lora_embedding_A", {})
                )
                if adapter_name not in present:
                    continue
                w, b = lora_aware.merged_parameters(module, [adapter_name])
                state[f"{name}.weight"] = w.detach()
                if b is not None:
                    state[f"{name}.bias"] = b.detach()
    return state


def export_for_transformers(
    model: nn.Module,
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    adapter_name: str = "default",
) -> tuple[Path, Path | None]:
    """A LoRA (or DoRA) model from :func:`~ssmkit.finetune.apply_lora` for transformers' Mamba
    models: the adapter on the modules of :data:`NOT_FOR_TRANSFORMERS` (out_proj, conv1d, dt_proj)
    is folded into the base weights (exactly what merging computes) and that base is written to
    ``base_dir`` in transformers' format; the rest of the adapter goes to ``adapter_dir`` under
    transformers' names, its config naming ``base_dir``. Then

        hf = AutoModelForCausalLM.from_pretrained(base_dir)
        hf_lora = peft.PeftModel.from_pretrained(hf, adapter_dir)   # ssmkit's logits

    Returns (base_dir, adapter_dir), or (base_dir, None) when no target is left (every target was
    folded: ``base_dir`` is then the fully merged model, as
    :func:`~ssmkit.finetune.export_merged` writes it). The model is not changed. ValueError for a
    model transformers has no class for (see :func:`adapter_for_transformers`), an unknown adapter
    name, or an adapter merged already."""
    from ..hub import save_pretrained

    if not hasattr(model, "peft_config") or adapter_name not in model.peft_config:
        have = list(getattr(model, "peft_config", {}))
        raise ValueError(
            f"no LoRA adapter {adapter_name!r} on this model (adapters: {have or 'none'}); "
            "make one with ssmkit.finetune.apply_lora"
        )
    base = _base(model)
    _check_transformers_class(base.config)
    if any(lora_aware.is_lora_layer(m) and m.merged for m in base.modules()):
        raise ValueError(
            "the adapter is merged into the weights already (merge_adapter), so the base and the "
            "adapter cannot be written apart: call unmerge_adapter() first, or export_merged"
        )
    saved = config_dict(model.peft_config[adapter_name])
    saved["inference_mode"] = True
    targets, to_save = _listed(saved, "target_modules"), _listed(saved, "modules_to_save")
    fold = set(NOT_FOR_TRANSFORMERS)
    kept = [t for t in targets if _leaf(t) not in fold]
    if not kept:  # nothing left for an adapter: the whole adapter goes into the base
        fold |= {_leaf(t) for t in targets + to_save}
    state = _folded_state(model, fold, adapter_name)
    base_dir = save_pretrained(base, base_dir, format="hf", state_dict=state)
    if not kept:
        return Path(base_dir), None
    saved["target_modules"] = kept
    saved["modules_to_save"] = [t for t in to_save if _leaf(t) not in fold] or None
    tensors = {  # a module to save is stored under its own name: "...conv1d.weight"
        k: v
        for k, v in adapter_state(model, adapter_name).items()
        if (_owner(k) or k.split(".")[-2]) not in fold
    }
    out, renamed = _to_transformers(saved, tensors, str(base_dir))
    return Path(base_dir), _write(Path(adapter_dir), out, renamed)
