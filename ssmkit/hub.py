"""Load and save checkpoints in the two layouts of the ecosystem.

* Hugging Face transformers: ``config.json`` with ``model_type`` "mamba", "falcon_mamba" or "mamba2"
  and weights
  ``model.safetensors`` (or ``pytorch_model.bin``, or shards with ``*.index.json``) named
  ``backbone.embeddings.weight``, ``backbone.layers.N.{norm,mixer.*}``, ``backbone.norm_f.weight``,
  ``lm_head.weight``.
* mamba_ssm's ``MambaLMHeadModel``: ``config.json`` with ``d_model``, ``n_layer``, ``ssm_cfg``, ...
  and ``pytorch_model.bin`` named as ssmkit's own modules (``backbone.embedding.weight``, ...).

``from_pretrained`` detects the layout, maps every weight by name, checks every shape and never
loads partially; ``save_pretrained`` writes into a temporary directory and renames it into place.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .models import MambaLM, ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")
FORMATS = ("hf", "mamba_ssm")


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


def _float(v) -> float:
    """A JSON number, or transformers 5's {"__float__": "Infinity"} encoding of a non-finite one."""
    return float(v["__float__"] if isinstance(v, dict) else v)


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
    fields = {**_HF_FIELDS, **(_HF_MAMBA1 if kind == "mamba" else _HF_MAMBA2)}
    kwargs = {ours: hf[theirs] for theirs, ours in fields.items() if theirs in hf}
    kwargs.update(mixer="mamba1" if kind == "mamba" else "mamba2", pad_vocab_size_multiple=1)
    kwargs.setdefault("tie_embeddings", kind == "mamba")        # transformers' defaults differ per model
    if kwargs.get("dt_limit") is not None:
        kwargs["dt_limit"] = tuple(_float(v) for v in kwargs["dt_limit"])
    if kind == "mamba" and "intermediate_size" in hf and hf["intermediate_size"] != hf["expand"] * hf["hidden_size"]:
        raise CheckpointError(f"intermediate_size {hf['intermediate_size']} != expand * hidden_size; "
                              "ssmkit needs d_inner = expand * d_model")
    if kind == "mamba2" and "num_heads" in hf:
        heads = hf["expand"] * hf["hidden_size"] // hf["head_dim"]
        if hf["num_heads"] != heads:
            raise CheckpointError(f"num_heads {hf['num_heads']} != expand * hidden_size / head_dim = {heads}")
    return ModelConfig(**kwargs)


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
            kwargs[k] = tuple(float(v) for v in kwargs[k])
    kwargs.update(d_model=c["d_model"], n_layer=c["n_layer"], vocab_size=c["vocab_size"], mixer=mixer,
                  pad_vocab_size_multiple=c.get("pad_vocab_size_multiple", 8), rms_norm=c.get("rms_norm", True),
                  residual_in_fp32=c.get("residual_in_fp32", True), tie_embeddings=c.get("tie_embeddings", True),
                  norm_epsilon=c.get("norm_epsilon", 1e-5))
    return ModelConfig(**kwargs)


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
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
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
        try:
            part = load(path)
        except Exception as exc:
            raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc} (corrupt or truncated?)") from None
        state.update(part)
    return state


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


def from_pretrained(path_or_id: str | os.PathLike, dtype: torch.dtype | None = None, device=None) -> MambaLM:
    """Load a transformers (Mamba / Mamba2) or mamba_ssm checkpoint directory, or a hub id."""
    folder = _resolve(path_or_id)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from None
    if "model_type" in raw:
        cfg, rename = config_from_hf(raw), {"backbone.embeddings.weight": "backbone.embedding.weight"}
    elif "d_model" in raw and "n_layer" in raw:
        cfg, rename = config_from_mamba_ssm(raw), {}
    else:
        raise CheckpointError(f"{config_path}: unknown layout; expected a transformers config (model_type) or a "
                              "mamba_ssm config (d_model, n_layer, ssm_cfg)")
    state = {rename.get(k, k): v for k, v in _read_state_dict(folder).items()}
    with torch.device("meta"):
        model = MambaLM(cfg)
    model = model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.backbone.embedding.weight
    _load_into(model, state, str(folder))
    model.name_or_path = str(path_or_id)
    return model.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else model


def save_pretrained(model: MambaLM, directory: str | os.PathLike, format: str = "hf",
                    tokenizer_from: str | os.PathLike | None = None, state_dict: dict | None = None) -> Path:
    """Write ``model`` as a directory transformers ("hf") or mamba_ssm ("mamba_ssm") loads unchanged.

    ``state_dict`` replaces the model's own tensors (a full state dict gathered from FSDP shards).

    Written into a temporary sibling directory, then renamed over ``directory``: a crash leaves
    either the old directory or the new one, never half of one. Tokenizer files found in
    ``tokenizer_from`` (default: where the model was loaded from) are copied along.
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not supported; valid formats: {', '.join(FORMATS)}")
    directory = Path(directory)
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
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if format == "hf":
            from safetensors.torch import save_file

            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            torch.save(state, tmp / "pytorch_model.bin")
        source = tokenizer_from or getattr(model, "name_or_path", None)
        if source is not None and Path(source).is_dir():
            for name in TOKENIZER_FILES:
                if (Path(source) / name).exists():
                    shutil.copy2(Path(source) / name, tmp / name)
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            directory.rename(old)
            tmp.rename(directory)
            shutil.rmtree(old)
        else:
            tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
