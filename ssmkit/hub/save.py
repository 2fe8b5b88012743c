"""Saving: ``save_pretrained`` writes a checkpoint transformers or mamba_ssm loads unchanged.

Each format is a pair in :data:`WRITERS`: the config.json it writes and the renaming of our tensors
to its names ("hf": transformers' Mamba / Mamba2, "mamba_ssm", "jamba": transformers' Jamba,
"zamba2").

Only our files are written (:data:`~ssmkit.hub.layouts.OUR_FILES`), whole or not at all: a
checkpoint of ours is rebuilt beside and swapped in, a directory holding anything else is refused
unless ``overwrite=True``, and then only our files in it are replaced.

:meth:`ssmkit.models.MambaLM.save_pretrained` delegates to :func:`save_pretrained`, which this
module registers with :func:`ssmkit.models.lm.register_save_pretrained` (models sit below the hub
and never import it; ``import ssmkit`` imports the hub). :func:`save_tokenizer` writes a tokenizer
by name into a model directory (a Trainer checkpoint's ``model/``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from pathlib import Path

import torch

from .. import io
from ..models import MambaLM, ModelConfig
from ..models.lm import register_save_pretrained
from . import jamba, zamba2
from .layouts import (
    FORMATS,
    OUR_FILES,
    SHARD_INDEXES,
    TOKENIZER_FILES,
    WEIGHT_FILES,
    _jamba_norms,
    config_to_hf,
    config_to_mamba_ssm,
)

_OUR_TEMP = re.compile(r"\.ssmkit-save-.*")  # a crashed in-place save's leftover


def _to_hf_names(state: dict, cfg: ModelConfig) -> dict:
    """transformers' Mamba / Mamba2 names: ours but for the embedding's; no lm_head when tied."""
    theirs = {"backbone.embedding.weight": "backbone.embeddings.weight"}
    state = {theirs.get(k, k): v for k, v in state.items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _same_names(state: dict, cfg: ModelConfig) -> dict:
    return state


# format -> (ModelConfig -> config.json dict, our state dict -> the format's); each raises
# CheckpointError for a model the format cannot hold, and both run before anything is written
WRITERS = {
    "hf": (config_to_hf, _to_hf_names),
    "mamba_ssm": (config_to_mamba_ssm, _same_names),
    "jamba": (jamba.config_to_jamba, jamba.state_to_jamba),
    "zamba2": (zamba2.config_to_zamba2, zamba2.state_to_zamba2),
}
assert set(WRITERS) == set(FORMATS)


# --------------------------------------------------------------------------------------------
# saving: only our files, whole or not at all
# --------------------------------------------------------------------------------------------


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``): a reader of either
    path sees the old tree or the new one, never neither. False where the system or file system
    lacks it."""
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
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old checkpoint
        return
    # Two renames: for the instant between them the old checkpoint lies whole at .NAME.old-*
    old = io.make_temp_dir(directory.parent, f".{directory.name}.old-")
    directory.rename(old)  # onto an empty directory: allowed
    try:
        tmp.rename(directory)
    except BaseException:
        old.rename(directory)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _replace_in_place(tmp: Path, directory: Path, weights: str):
    """Move the finished files of ``tmp`` (a folder inside ``directory``) over their names one by
    one.

    Every file is complete and synced before the first rename. The new weights go first, then the
    other format's weight file is removed (it would shadow them: loaders prefer model.safetensors),
    config.json last: a crash among these renames leaves at worst the new weights beside the old
    config.json, which loads when the architecture is unchanged. Files that are not ours are never
    touched.
    """
    os.replace(tmp / weights, directory / weights)
    for other in WEIGHT_FILES.values():
        if other != weights:
            (directory / other).unlink(missing_ok=True)
    for path in sorted(tmp.iterdir()):
        if path.name != "config.json":
            os.replace(path, directory / path.name)  # tokenizer files
    os.replace(tmp / "config.json", directory / "config.json")


def natural_format(cfg: ModelConfig) -> str:
    """The format a model is saved in when none is asked for: "zamba2" for a Zamba2 model, "jamba"
    for Mamba-1 layers with Jamba's weighted Δ/B/C norms or a mixture of experts (no other format
    holds experts), "mamba_ssm" for Mamba-3, S4D or H3 layers, attention layers or MLPs
    (transformers' Mamba configs hold none of them), else "hf" (transformers' Mamba / FalconMamba /
    Mamba2)."""
    newer = {"mamba3", "s4d", "h3"} & set(cfg.mixers)
    if cfg.zamba2 is not None:
        return "zamba2"
    if (_jamba_norms(cfg) and not newer) or cfg.moe_layers:
        return "jamba"
    if cfg.attn_layer_idx or cfg.d_intermediate or newer:
        return "mamba_ssm"
    return "hf"


def save_pretrained(
    model: MambaLM,
    directory: str | os.PathLike,
    format: str | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    state_dict: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a directory transformers ("hf": Mamba / Mamba2, "jamba", "zamba2") or
    mamba_ssm ("mamba_ssm") loads unchanged; a model the format cannot hold is a CheckpointError
    naming the field. ``format=None`` picks the model's :func:`natural_format` (so a Trainer
    checkpoint of any model saves).

    ``state_dict`` replaces the model's own tensors (a full state dict gathered from FSDP shards).
    Tokenizer files found in ``tokenizer_from`` (default: where the model was loaded from) are
    copied along. Files follow the user's umask.

    ``directory`` may be new, empty, or hold only files this function writes (:data:`OUR_FILES`):
    then the checkpoint is built in a temporary sibling and swapped in (one atomic exchange on
    Linux), so a crash leaves the old checkpoint or the new one; tokenizer files there that this
    save does not bring stay. A directory holding anything else is refused, naming those files,
    unless ``overwrite=True``: then only our files are replaced in it, one rename each, and the rest
    stay untouched. The other format's weight file is removed either way, so it cannot shadow the
    new one. Temporary directories that earlier saves here left when they were killed
    (``.NAME.tmp-*`` beside it, ``.ssmkit-save-*`` in it) are removed first, those no live process
    holds only.
    """
    if format is None:
        format = natural_format(model.config)
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not supported; valid formats: {', '.join(FORMATS)}")
    given = directory = Path(directory)
    if directory.is_symlink() and directory.is_dir():
        directory = directory.resolve()  # swap the folder the link points at, not the link
    if os.path.lexists(directory) and not directory.is_dir():
        raise ValueError(
            f"{directory} exists and is not a directory; save_pretrained writes a directory of "
            "files there: choose a new or empty directory"
        )
    existing = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    foreign = [n for n in existing if n not in OUR_FILES and not _OUR_TEMP.fullmatch(n)]
    if foreign and not overwrite:
        raise ValueError(
            f"{directory} holds files save_pretrained does not write: {foreign[:8]}"
            f"{' ...' if len(foreign) > 8 else ''}. Choose a new or empty directory, or pass "
            "overwrite=True to replace only the checkpoint's files "
            f"({', '.join(OUR_FILES[:3])}, tokenizer files) and leave the rest"
        )
    shadowing = [n for n in existing if n in SHARD_INDEXES]
    if shadowing:
        raise ValueError(
            f"{directory} holds the shard index {shadowing}, which loaders read before a single "
            "weight file: the new weights would be ignored. Remove it and its shards, "
            "or choose another directory"
        )
    cfg = model.config
    state = model.state_dict() if state_dict is None else state_dict
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    config_to, state_to = WRITERS[format]
    config = config_to(cfg)
    state = state_to(state, cfg)
    source = tokenizer_from or getattr(model, "name_or_path", None)
    source = Path(source) if source is not None and Path(source).is_dir() else None

    directory.parent.mkdir(parents=True, exist_ok=True)
    in_place = bool(foreign)
    # the leftovers of saves here that were killed (kill -9, power loss) before their cleanup ran;
    # only our own names, and only those no live process holds (io.TempDir's lock)
    io.remove_stale_temp_dirs(directory.parent, f".{directory.name}.tmp-")
    if directory.is_dir():
        io.remove_stale_temp_dirs(directory, ".ssmkit-save-")
    held = io.TempDir(
        directory if in_place else directory.parent,
        ".ssmkit-save-" if in_place else f".{directory.name}.tmp-",
    )
    tmp = held.path
    try:
        io.write_json(tmp / "config.json", config)
        weights = tmp / WEIGHT_FILES[format]
        if weights.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(weights), metadata={"format": "pt"})
        else:
            torch.save(state, weights)
        for name in TOKENIZER_FILES:
            if source is not None and (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
            elif not in_place and (directory / name).is_file():  # kept: the swap must not drop them
                shutil.copyfile(directory / name, tmp / name)
        # safetensors creates 0600; every other tool follows the umask
        mode = 0o666 & ~io.umask()
        for path in tmp.iterdir():
            os.chmod(path, mode)
            with open(path, "rb") as f:
                os.fsync(f.fileno())  # on disk before any rename makes it visible
        if in_place:
            _replace_in_place(tmp, directory, weights.name)
        else:
            _swap_in(tmp, directory)
    finally:
        # the leftover (old checkpoint, or nothing) or the failed build
        shutil.rmtree(tmp, ignore_errors=True)
        held.close()
    return given


def save_tokenizer(name: str | None, folder: Path, model) -> bool:
    """Write the files of tokenizer ``name`` (e.g. the training data's ``index.json`` "tokenizer")
    into the model directory ``folder``, so the model loads with its tokenizer (``ssmkit generate``,
    ``ssmkit.data.get_tokenizer(folder)``). False, with a warning, when there is no name, it cannot
    be loaded, or it does not fit ``model.config.vocab_size`` (a checkpoint is never lost for want
    of its tokenizer); errors writing the files (disk full) propagate."""
    import warnings

    from ..data.tokenizers import loaded_tokenizer

    if not name:
        return False
    try:
        tok = loaded_tokenizer(name)
    except (ValueError, RuntimeError, OSError) as exc:
        warnings.warn(
            f"the checkpoint is saved without its tokenizer {name!r}, which cannot be "
            f"loaded ({exc}); pass --tokenizer to `ssmkit generate`",
            stacklevel=3,
        )
        return False
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        warnings.warn(
            f"the checkpoint is saved without the tokenizer {name!r}: its {len(tok)} "
            f"tokens do not fit the model's vocabulary of {vocab}",
            stacklevel=3,
        )
        return False
    tok.save_pretrained(str(folder))
    return True


register_save_pretrained(save_pretrained)  # MambaLM.save_pretrained writes with it
