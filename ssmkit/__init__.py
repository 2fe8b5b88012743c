"""ssmkit: train state-space language models (Mamba-1, -2, -3, hybrids) from scratch and fine-tune
them.

    import ssmkit
    cfg = ssmkit.ModelConfig.preset("tiny")
    model = ssmkit.build_model(cfg)
    out = model(input_ids, labels=input_ids)      # out.logits, out.loss
    ids = ssmkit.generate(model, input_ids, max_new_tokens=64)
    print(ssmkit.env_report())
    model = ssmkit.from_pretrained("state-spaces/mamba-130m-hf")  # or an HF / mamba_ssm dir
    model.save_pretrained("out", format="hf")                     # or "mamba_ssm"
    lora = ssmkit.finetune.apply_lora(model)                      # peft LoRA, the plan's config

The layers, low to high (each imports only lower ones; tests/unit/test_layers.py keeps it so):
``io``, ``checks`` < ``data``, ``ops`` < ``env`` < ``models`` < ``hub`` < ``eval``, ``finetune`` <
``plots`` < ``train`` < ``workbook``, ``demo`` < ``papers`` < ``exercises`` < ``cli``. All but
``papers`` are attributes of this package: the light ones are imported with it, the heavy ones
(``eval``, ``exercises``, ``finetune``, ``plots``, ``train``, ``workbook``, ``demo``, ``cli``: peft,
matplotlib, papermill, torch.distributed) on first use, so
``import ssmkit`` stays quick and ``ssmkit.train.Trainer`` still works.
"""

from . import (
    checks,
    data,
    env,
    hub,
    io,
    models,
    ops,
)  # hub also gives MambaLM its save_pretrained method
from .env import env_report
from .hub import CheckpointError, from_pretrained
from .models import InferenceCache, LMOutput, MambaLM, ModelConfig, build_model, generate, presets

__version__ = "0.1.0"

# Subpackages imported on first attribute access (PEP 562), not by `import ssmkit`.
_LAZY = ("cli", "demo", "eval", "exercises", "finetune", "plots", "train", "workbook")

# `from ssmkit import *` takes the eager names only (the lazy ones would import heavy dependencies).
__all__ = [
    "checks",
    "data",
    "env",
    "hub",
    "io",
    "models",
    "ops",
    "env_report",
    "CheckpointError",
    "from_pretrained",
    "InferenceCache",
    "LMOutput",
    "MambaLM",
    "ModelConfig",
    "build_model",
    "generate",
    "presets",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(
            f"{__name__}.{name}"
        )  # also sets it as this package's attribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
