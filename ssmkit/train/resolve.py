"""What a path names: the one place that reads a user's path (``ssmkit generate`` / ``eval`` /
``convert``, ``TrainConfig.base``, the workbook's ``base``) and says what it is, reading no file's
contents.

    a model directory          config.json + weights (transformers, mamba_ssm)    kind "model"
    a Trainer checkpoint       step_N/ with model/ (a whole model)                kind "checkpoint"
      or its step_N/model      (the checkpoint holding it is found too)           kind "checkpoint"
    a LoRA run's checkpoint    step_N/ with adapter/ (trainer.json names the base) kind "lora"
    checkpoints/, its latest   the checkpoint ``latest`` names (checkpoint.latest)
    a run's out_dir            the latest checkpoint in its checkpoints/
    owner/name, no such path   a Hugging Face hub id (ssmkit.hub.is_hub_id)       kind "hub"

Anything else is one ValueError saying what is accepted; a local path that does not exist is "no
such directory", never a hub error. :mod:`.load` loads what this resolves (verified, then read).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..hub import is_hub_id
from .checkpoint import LATEST, is_complete, latest

KINDS = ("model", "checkpoint", "lora", "hub")
ACCEPTED = (
    "expected a model directory (config.json), a checkpoint step_N/ (with model/), a "
    "checkpoints/ directory or its latest file, a run's out_dir (with checkpoints/), or a "
    "hub id owner/name"
)


@dataclass(frozen=True)
class Resolved:
    """What :func:`resolve` found behind ``given`` (the path as the user wrote it).

    kind: one of :data:`KINDS`. model_dir: the directory ssmkit.from_pretrained reads ("model",
    "checkpoint"). step_dir: the Trainer checkpoint step_N/ holding it, whose manifest covers it
    ("checkpoint", "lora"). adapter_dir: step_N/adapter ("lora"). hub_id: the id ("hub").
    """

    kind: str
    given: str
    model_dir: Path | None = None
    step_dir: Path | None = None
    adapter_dir: Path | None = None
    hub_id: str | None = None

    @property
    def tokenizer_dir(self) -> Path | str:
        """Where the tokenizer files saved with the model are: the model or adapter directory, or
        the hub id (the hub's tokenizer)."""
        return self.hub_id or self.adapter_dir or self.model_dir

    def model_source(self) -> str:
        """What ssmkit.from_pretrained reads for this whole model: the model directory or the hub
        id. A LoRA run has none: its base with the adapter is :func:`.load.load_model`'s."""
        if self.kind == "lora":
            raise ValueError(
                f"checkpoint {self.step_dir} holds a LoRA adapter (adapter/), not a "
                "whole model: load its base and the adapter with "
                "ssmkit.finetune.load_adapter(base_model, step/'adapter'), or the "
                "merged model with ssmkit.train.load.load_model (or `ssmkit convert` "
                "it)"
            )
        return self.hub_id or str(self.model_dir)


def resolve(path: str | os.PathLike) -> Resolved:
    """What ``path`` names (the table above); a ValueError saying what is accepted when it names
    nothing loadable."""
    text = str(path)
    given = Path(text).expanduser()
    if not given.exists():
        if is_hub_id(text):
            return Resolved("hub", text, hub_id=text)
        raise ValueError(f"{given}: no such directory; {ACCEPTED}")
    if given.is_file():
        if given.name != LATEST:
            raise ValueError(f"{given} is a file: {ACCEPTED}")
        step = latest(given.parent)
        if step is None:
            raise ValueError(f"{given} names no complete checkpoint in {given.parent}: {ACCEPTED}")
    elif (given / "config.json").is_file():
        step = given.parent if given.name == "model" and is_complete(given.parent) else None
        return Resolved("checkpoint" if step else "model", text, model_dir=given, step_dir=step)
    elif (given / "trainer.json").is_file():
        step = given
    else:
        root = given / "checkpoints" if (given / "checkpoints").is_dir() else given
        step = latest(root)
        if step is None:
            raise ValueError(f"{given} holds no model and no complete checkpoint: {ACCEPTED}")
    if (step / "adapter").is_dir():
        return Resolved("lora", text, step_dir=step, adapter_dir=step / "adapter")
    if not (step / "model" / "config.json").is_file():
        raise ValueError(
            f"checkpoint {step} has no model/ (its model has no save_pretrained); "
            "continue its run with Trainer(model, config).resume() instead"
        )
    return Resolved("checkpoint", text, model_dir=step / "model", step_dir=step)
