"""Load and save checkpoints in the two layouts of the ecosystem.

* Hugging Face transformers: ``config.json`` with ``model_type`` "mamba", "falcon_mamba" or "mamba2"
  and weights
  ``model.safetensors`` (or ``pytorch_model.bin``, or shards with ``*.index.json``) named
  ``backbone.embeddings.weight``, ``backbone.layers.N.{norm,mixer.*}``, ``backbone.norm_f.weight``,
  ``lm_head.weight``.
* mamba_ssm's ``MambaLMHeadModel``: ``config.json`` with ``d_model``, ``n_layer``, ``ssm_cfg``, ...
  and ``pytorch_model.bin`` named as ssmkit's own modules (``backbone.embedding.weight``, ...).

``from_pretrained`` detects the layout, maps every weight by name, checks every shape and never
loads partially; every problem with a checkpoint (a config field, a shard index, a weight file) is
a :class:`CheckpointError` naming the file. ``save_pretrained`` writes only its own files (see
:data:`OUR_FILES`): a checkpoint of ours is rebuilt beside and swapped in, a directory holding
anything else is refused unless ``overwrite=True``, and then only our files in it are replaced.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import re
import shutil
from pathlib import Path

import torch

from . import io
from .env import pick_device
from .models import MambaLM, ModelConfig
from .models.config import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")
FORMATS = ("hf", "mamba_ssm")
WEIGHT_FILES = {"hf": "model.safetensors", "mamba_ssm": "pytorch_model.bin"}
OUR_FILES = ("config.json", *WEIGHT_FILES.values(), *TOKENIZER_FILES)    # all save_pretrained ever writes
SHARD_INDEXES = tuple(f"{name}.index.json" for name in WEIGHT_FILES.values())
_OUR_TEMP = re.compile(r"\.ssmkit-save-.*")                              # a crashed in-place save's leftover
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as an ssmkit model, with the reason."""


# --------------------------------------------------------------------------------------------
# configs: transformers / mamba_ssm <-> ModelConfig
# --------------------------------------------------------------------------------------------

# transformers field -> ModelConfig field, for both Mamba and Mamba2 configs
_HF_FIELDS = {
    "hidden_size": "d_model", "num_hidden_layers": "n_layer", "vocab_size": "vocab_size",
    "state_size": "d_state", "expand": "expand", "conv_kernel": "d_conv", "use_bias": "bias",
    "use_conv_bias": "conv_bias", "layer_norm_epsilon": "norm_epsilon", "residual_in_fp32": "residual_in_fp32",
    "tie_word_embeddings": "tie_embeddings", "time_step_min": "dt_min", "time_step_max": "dt_max",
    "time_step_floor": "dt_init_floor",
}
_HF_MAMBA1 = {"time_step_rank": "dt_rank", "time_step_scale": "dt_scale", "time_step_init_scheme": "dt_init",
              "mixer_rms_eps": "mixer_rms_eps"}
_HF_MAMBA2 = {"head_dim": "headdim", "n_groups": "ngroups", "chunk_size": "chunk_size", "time_step_limit": "dt_limit",
              "norm_before_gate": "norm_before_gate"}


def _floats(values, field: str) -> tuple[float, ...]:
    """A JSON list of numbers as floats; transformers 5 writes infinity as {"__float__": "Infinity"},
    mamba_ssm configs as "inf"."""
    try:
        return tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in values)
    except (TypeError, ValueError, KeyError):
        raise CheckpointError(f"field {field!r} must be a list of numbers; got {values!r}") from None


def _build_config(kwargs: dict, names: dict[str, str]) -> ModelConfig:
    """ModelConfig(**kwargs); a bad value becomes a CheckpointError naming the field as the file
    spells it (``names``: ssmkit field -> config.json field)."""
    try:
        return ModelConfig(**kwargs)
    except ConfigError as exc:
        raise CheckpointError(f"field {names.get(exc.field, exc.field)!r}: {exc}") from None
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _json_float(v: float):
    return v if math.isfinite(v) else {"__float__": "Infinity" if v > 0 else "-Infinity"}


def config_from_hf(hf: dict) -> ModelConfig:
    """A transformers ``config.json`` (mamba / falcon_mamba / mamba2) as a ModelConfig; the vocabulary
    is kept exactly (transformers' vocab_size is already the padded embedding size)."""
    kind = hf.get("model_type")
    if kind not in ("mamba", "falcon_mamba", "mamba2"):
        raise CheckpointError(f"model_type {kind!r} is not supported; ssmkit loads 'mamba', 'falcon_mamba' and "
                              "'mamba2'")
    if kind == "falcon_mamba":
        hf = {"mixer_rms_eps": 1e-6, **hf}                  # transformers' FalconMambaConfig default
        kind = "mamba"
    else:
        hf = {k: v for k, v in hf.items() if k != "mixer_rms_eps"}
    if hf.get("rms_norm", True) is False:
        raise CheckpointError("rms_norm=False (the gate inside the scan, no gated RMSNorm) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported; ssmkit's mixers use 'silu'")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in hf]
    if missing:   # ModelConfig's defaults are a 130M model: never guess the size of someone's checkpoint
        raise CheckpointError(f"fields {missing} are missing; a transformers config states the model's size")
    fields = {**_HF_FIELDS, **(_HF_MAMBA1 if kind == "mamba" else _HF_MAMBA2)}
    nulls = [theirs for theirs in fields if theirs in hf and hf[theirs] is None and theirs != "mixer_rms_eps"]
    if nulls:     # null would silently fall back to a default that may not match the weights
        raise CheckpointError(f"fields {nulls} are null; give them values or leave them out for the defaults")
    kwargs = {ours: hf[theirs] for theirs, ours in fields.items() if theirs in hf}
    kwargs.update(mixer="mamba1" if kind == "mamba" else "mamba2", pad_vocab_size_multiple=1)
    kwargs.setdefault("tie_embeddings", kind == "mamba")        # transformers' defaults differ per model
    if kwargs.get("dt_limit") is not None:
        kwargs["dt_limit"] = _floats(kwargs["dt_limit"], "time_step_limit")
    cfg = _build_config(kwargs, {ours: theirs for theirs, ours in fields.items()})
    if kind == "mamba" and "intermediate_size" in hf and hf["intermediate_size"] != cfg.d_inner:
        raise CheckpointError(f"field 'intermediate_size' is {hf['intermediate_size']!r}, but expand * hidden_size = "
                              f"{cfg.d_inner}; ssmkit needs d_inner = expand * d_model")
    if kind == "mamba2" and "num_heads" in hf and hf["num_heads"] != cfg.nheads:
        raise CheckpointError(f"field 'num_heads' is {hf['num_heads']!r}, but expand * hidden_size / head_dim = "
                              f"{cfg.nheads}")
    return cfg


def config_to_hf(cfg: ModelConfig) -> dict:
    """A ModelConfig as a transformers config dict (MambaConfig / Mamba2Config)."""
    if cfg.layout is not None and len(set(cfg.layout)) > 1:
        raise CheckpointError("transformers has no model with mixed Mamba-1 / Mamba-2 layers; save format='mamba_ssm'")
    mamba1 = cfg.mixers[0] == "mamba1"
    fields = {**_HF_FIELDS, **(_HF_MAMBA1 if mamba1 else _HF_MAMBA2)}
    hf = {theirs: getattr(cfg, ours) for theirs, ours in fields.items()}
    hf["vocab_size"] = cfg.padded_vocab_size
    if mamba1:
        falcon = cfg.mixer_rms_eps is not None
        hf.update(model_type="falcon_mamba" if falcon else "mamba", time_step_rank=cfg.dt_rank_value,
                  architectures=["FalconMambaForCausalLM" if falcon else "MambaForCausalLM"],
                  intermediate_size=cfg.d_inner, hidden_act="silu")
        if not falcon:
            del hf["mixer_rms_eps"]
    else:
        if cfg.D_has_hdim or cfg.norm_before_gate:   # transformers 5's Mamba2 always norms after the gate
            raise CheckpointError("transformers' Mamba2 has neither D per channel nor norm_before_gate=True; "
                                  "save format='mamba_ssm'")
        hf.update(model_type="mamba2", architectures=["Mamba2ForCausalLM"], num_heads=cfg.nheads,
                  hidden_act="silu", time_step_limit=[_json_float(v) for v in cfg.dt_limit], rms_norm=True)
    return hf


_SSM_FIELDS = ("d_state", "d_conv", "expand", "dt_min", "dt_max", "dt_init_floor", "conv_bias", "bias")
_SSM_MAMBA1 = ("dt_rank", "dt_init", "dt_scale")
_SSM_MAMBA2 = ("headdim", "ngroups", "chunk_size", "A_init_range", "dt_limit", "D_has_hdim", "norm_before_gate")


def config_from_mamba_ssm(c: dict) -> ModelConfig:
    """mamba_ssm's MambaConfig dict as a ModelConfig."""
    if c.get("d_intermediate", 0) or c.get("attn_layer_idx"):
        raise CheckpointError("mamba_ssm configs with MLP blocks (d_intermediate > 0) or attention layers "
                              "(attn_layer_idx) are not supported yet")
    missing = [k for k in ("d_model", "n_layer", "vocab_size") if k not in c]
    if missing:
        raise CheckpointError(f"fields {missing} are missing; a mamba_ssm config states the model's size")
    if not isinstance(c.get("ssm_cfg") or {}, dict):
        raise CheckpointError(f"field 'ssm_cfg' must be an object of mixer fields; got {c['ssm_cfg']!r}")
    ssm = dict(c.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise CheckpointError(f"ssm_cfg.layer {layer!r} is not supported; valid: Mamba1, Mamba2")
    mixer = "mamba1" if layer == "Mamba1" else "mamba2"
    known = set(_SSM_FIELDS) | set(_SSM_MAMBA1 if mixer == "mamba1" else _SSM_MAMBA2)
    ignored = {"use_fast_path", "layer_idx", "rmsnorm", "sequence_parallel", "use_mem_eff_path"}
    unknown = sorted(set(ssm) - known - ignored)
    if unknown:
        raise CheckpointError(f"ssm_cfg fields {unknown} cannot be represented by ssmkit; known: {sorted(known)}")
    if ssm.get("rmsnorm", True) is False:
        raise CheckpointError("ssm_cfg.rmsnorm=False (gate inside the scan) is not supported")
    kwargs = {k: ssm[k] for k in known if k in ssm}
    for k in ("A_init_range", "dt_limit"):
        if k in kwargs:
            kwargs[k] = _floats(kwargs[k], f"ssm_cfg.{k}")
    kwargs.update(d_model=c["d_model"], n_layer=c["n_layer"], vocab_size=c["vocab_size"], mixer=mixer,
                  pad_vocab_size_multiple=c.get("pad_vocab_size_multiple", 8), rms_norm=c.get("rms_norm", True),
                  residual_in_fp32=c.get("residual_in_fp32", True), tie_embeddings=c.get("tie_embeddings", True),
                  norm_epsilon=c.get("norm_epsilon", 1e-5))
    return _build_config(kwargs, {k: f"ssm_cfg.{k}" for k in known})


def config_to_mamba_ssm(cfg: ModelConfig) -> dict:
    if cfg.layout is not None and len(set(cfg.layout)) > 1:
        raise CheckpointError("mamba_ssm's MambaLMHeadModel has one SSM layer type; mixed layouts cannot be saved")
    if cfg.mixer_rms_eps is not None:
        raise CheckpointError("mamba_ssm has no FalconMamba norms (mixer_rms_eps); save format='hf'")
    if cfg.norm_epsilon != 1e-5 or not cfg.rms_norm:    # MambaLMHeadModel builds RMSNorm(eps=1e-5)
        raise CheckpointError("mamba_ssm's MambaLMHeadModel always uses RMSNorm with eps 1e-5; save format='hf'")
    mixer = cfg.mixers[0]
    ssm = {k: getattr(cfg, k) for k in _SSM_FIELDS + (_SSM_MAMBA1 if mixer == "mamba1" else _SSM_MAMBA2)}
    ssm["layer"] = "Mamba1" if mixer == "mamba1" else "Mamba2"
    if "dt_limit" in ssm:   # JSON has no infinity: the default (0, inf) is left to mamba_ssm's own default
        if ssm["dt_limit"] == (0.0, math.inf):
            del ssm["dt_limit"]
        else:
            ssm["dt_limit"] = [v if math.isfinite(v) else "inf" for v in ssm["dt_limit"]]
    if "A_init_range" in ssm:
        ssm["A_init_range"] = list(ssm["A_init_range"])
    return dict(d_model=cfg.d_model, d_intermediate=0, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size, ssm_cfg=ssm,
                attn_layer_idx=[], attn_cfg={}, rms_norm=cfg.rms_norm, residual_in_fp32=cfg.residual_in_fp32,
                fused_add_norm=True, pad_vocab_size_multiple=cfg.pad_vocab_size_multiple,
                tie_embeddings=cfg.tie_embeddings)   # exactly MambaConfig's fields: it is built with **config


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: model.safetensors, pytorch_model.bin, or their shards."""
    from safetensors.torch import load_file

    loaders = {"model.safetensors": lambda p: load_file(str(p)),
               "pytorch_model.bin": lambda p: torch.load(p, map_location="cpu", weights_only=True)}
    for single, load in loaders.items():                       # one file, or shards listed in its index
        index = folder / f"{single}.index.json"
        if index.exists():
            files = _shard_names(index)
            break
        if (folder / single).exists():
            files = [single]
            break
    else:
        raise CheckpointError(f"no weights in {folder}: expected model.safetensors, pytorch_model.bin or a "
                              "*.index.json of shards")
    state = {}
    for name in files:
        path = folder / name
        if not path.exists():
            raise CheckpointError(f"{path} is missing: a checkpoint without all its weight files cannot load")
        try:
            part = load(path)
        except Exception as exc:
            raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc} (corrupt or truncated?)") from None
        state.update(part)
    return state


def _shard_names(index: Path) -> list[str]:
    """The shard files an ``*.index.json`` lists: plain names inside the checkpoint folder only (an entry
    like ``../../secret`` would read a file outside it)."""
    try:
        weight_map = io.read_json(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"shard index {index} has no 'weight_map' object of tensor name -> shard file")
        return sorted({io.plain_name(name, f"shard index {index}") for name in weight_map.values()})
    except (ValueError, AttributeError) as exc:      # AttributeError: the JSON is not an object
        raise CheckpointError(str(exc) if isinstance(exc, ValueError) else
                              f"shard index {index} is not a JSON object with a 'weight_map'") from None


def _load_into(model: MambaLM, state: dict[str, torch.Tensor], source: str):
    """Copy ``state`` into ``model`` after checking every name and shape; nothing is copied on error."""
    expected = model.state_dict()
    if model.config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        expected.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{source}: missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                              f"unexpected weights {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{source}: weight {name} has shape {tuple(tensor.shape)}, the config implies "
                                  f"{tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=not model.config.tie_embeddings)


def _resolve(path_or_id: str | os.PathLike) -> Path:
    path = Path(path_or_id)
    if path.is_dir():
        return path
    if path.exists() or str(path_or_id).startswith((".", "/")) or str(path_or_id).count("/") != 1:
        raise CheckpointError(f"{path_or_id!r} is neither a checkpoint directory nor a hub id like 'state-spaces/mamba-130m'")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_id), allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt",
                                                                        "*.model"]))
    except Exception as exc:
        raise CheckpointError(
            f"cannot fetch {path_or_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). Offline "
            "(HF_HUB_OFFLINE=1 or no network) only cached snapshots load; pass a local directory instead."
        ) from None


def _read_config(folder: Path) -> tuple[ModelConfig, dict]:
    """The ModelConfig of a checkpoint folder and the weight renames of its layout; any problem is a
    CheckpointError naming config.json (and the field)."""
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        raw = io.read_json(path, "config")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    try:
        if not isinstance(raw, dict):
            raise CheckpointError(f"it holds a JSON {type(raw).__name__}, not an object of config fields")
        if "model_type" in raw:
            return config_from_hf(raw), {"backbone.embeddings.weight": "backbone.embedding.weight"}
        if "d_model" in raw and "n_layer" in raw:
            return config_from_mamba_ssm(raw), {}
        raise CheckpointError("unknown layout; expected a transformers config (model_type) or a mamba_ssm config "
                              "(d_model, n_layer, ssm_cfg)")
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _dtype(dtype) -> torch.dtype | None:
    """None, a floating torch.dtype, or one of the names in :data:`DTYPES` ("bf16", "torch.float16", ...)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r} is not supported; valid: {', '.join(DTYPES)} or a floating torch.dtype")


def from_pretrained(path_or_id: str | os.PathLike, dtype: torch.dtype | str | None = None, device=None) -> MambaLM:
    """Load a transformers (Mamba / Mamba2) or mamba_ssm checkpoint directory, or a hub id.

    dtype: a torch.dtype or a name (float32/fp32, bfloat16/bf16, float16/fp16/half); device: "cpu",
    "cuda", "cuda:N", "mps", "auto" or a torch.device. Both are checked before anything is read.
    """
    dtype = _dtype(dtype)
    if device is not None:
        device = pick_device(str(device) if isinstance(device, torch.device) else device)
    folder = _resolve(path_or_id)
    cfg, rename = _read_config(folder)
    state = {rename.get(k, k): v for k, v in _read_state_dict(folder).items()}
    with torch.device("meta"):
        model = MambaLM(cfg)
    model = model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.backbone.embedding.weight
    _load_into(model, state, str(folder))
    model.name_or_path = str(path_or_id)
    return model.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else model


# --------------------------------------------------------------------------------------------
# saving: only our files, whole or not at all
# --------------------------------------------------------------------------------------------


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``): a reader of either path
    sees the old tree or the new one, never neither. False where the system or file system lacks it."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(tmp: Path, directory: Path):
    """Put the finished ``tmp`` at ``directory``, replacing a checkpoint of ours there."""
    if not directory.exists():
        tmp.rename(directory)
        return
    if _exchange(tmp, directory):
        shutil.rmtree(tmp, ignore_errors=True)                  # tmp now holds the old checkpoint
        return
    # Two renames: for the instant between them the old checkpoint lies whole at .NAME.old-*
    old = io.make_temp_dir(directory.parent, f".{directory.name}.old-")
    directory.rename(old)                                       # onto an empty directory: allowed
    try:
        tmp.rename(directory)
    except BaseException:
        old.rename(directory)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _replace_in_place(tmp: Path, directory: Path, weights: str):
    """Move the finished files of ``tmp`` (a folder inside ``directory``) over their names one by one.

    Every file is complete and synced before the first rename. The new weights go first, then the other
    format's weight file is removed (it would shadow them: loaders prefer model.safetensors), config.json
    last: a crash among these renames leaves at worst the new weights beside the old config.json, which
    loads when the architecture is unchanged. Files that are not ours are never touched.
    """
    os.replace(tmp / weights, directory / weights)
    for other in WEIGHT_FILES.values():
        if other != weights:
            (directory / other).unlink(missing_ok=True)
    for path in sorted(tmp.iterdir()):
        if path.name != "config.json":
            os.replace(path, directory / path.name)             # tokenizer files
    os.replace(tmp / "config.json", directory / "config.json")


def save_pretrained(model: MambaLM, directory: str | os.PathLike, format: str = "hf",
                    tokenizer_from: str | os.PathLike | None = None, state_dict: dict | None = None,
                    overwrite: bool = False) -> Path:
    """Write ``model`` as a directory transformers ("hf") or mamba_ssm ("mamba_ssm") loads unchanged.

    ``state_dict`` replaces the model's own tensors (a full state dict gathered from FSDP shards).
    Tokenizer files found in ``tokenizer_from`` (default: where the model was loaded from) are copied
    along. Files follow the user's umask.

    ``directory`` may be new, empty, or hold only files this function writes (:data:`OUR_FILES`): then
    the checkpoint is built in a temporary sibling and swapped in (one atomic exchange on Linux), so
    a crash leaves the old checkpoint or the new one; tokenizer files there that this save does not
    bring stay. A directory holding anything else is refused, naming those files, unless
    ``overwrite=True``: then only our files are replaced in it, one rename each, and the rest stay
    untouched. The other format's weight file is removed either way, so it cannot shadow the new one.
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not supported; valid formats: {', '.join(FORMATS)}")
    given = directory = Path(directory)
    if directory.is_symlink() and directory.is_dir():
        directory = directory.resolve()                         # swap the folder the link points at, not the link
    if os.path.lexists(directory) and not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a directory; save_pretrained writes a directory of "
                         "files there: choose a new or empty directory")
    existing = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    foreign = [n for n in existing if n not in OUR_FILES and not _OUR_TEMP.fullmatch(n)]
    if foreign and not overwrite:
        raise ValueError(f"{directory} holds files save_pretrained does not write: {foreign[:8]}"
                         f"{' ...' if len(foreign) > 8 else ''}. Choose a new or empty directory, or pass "
                         f"overwrite=True to replace only the checkpoint's files ({', '.join(OUR_FILES[:3])}, "
                         "tokenizer files) and leave the rest")
    shadowing = [n for n in existing if n in SHARD_INDEXES]
    if shadowing:
        raise ValueError(f"{directory} holds the shard index {shadowing}, which loaders read before a single "
                         "weight file: the new weights would be ignored. Remove it and its shards, or choose another "
                         "directory")
    cfg = model.config
    state = model.state_dict() if state_dict is None else state_dict
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if format == "hf":
        config = config_to_hf(cfg)
        state["backbone.embeddings.weight"] = state.pop("backbone.embedding.weight")
        if cfg.tie_embeddings:
            state.pop("lm_head.weight")
    else:
        config = config_to_mamba_ssm(cfg)
    source = tokenizer_from or getattr(model, "name_or_path", None)
    source = Path(source) if source is not None and Path(source).is_dir() else None

    directory.parent.mkdir(parents=True, exist_ok=True)
    in_place = bool(foreign)
    tmp = io.make_temp_dir(directory if in_place else directory.parent,
                           ".ssmkit-save-" if in_place else f".{directory.name}.tmp-")
    try:
        io.write_json(tmp / "config.json", config)
        weights = tmp / WEIGHT_FILES[format]
        if format == "hf":
            from safetensors.torch import save_file

            save_file(state, str(weights), metadata={"format": "pt"})
        else:
            torch.save(state, weights)
        for name in TOKENIZER_FILES:
            if source is not None and (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
            elif not in_place and (directory / name).is_file():    # kept: the swap must not drop them
                shutil.copyfile(directory / name, tmp / name)
        mode = 0o666 & ~io.umask()                  # safetensors creates 0600; every other tool follows the umask
        for path in tmp.iterdir():
            os.chmod(path, mode)
            with open(path, "rb") as f:
                os.fsync(f.fileno())                # on disk before any rename makes it visible
        if in_place:
            _replace_in_place(tmp, directory, weights.name)
        else:
            _swap_in(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)      # the leftover (old checkpoint, or nothing) or the failed build
    return given
