"""ssmkit: train state-space language models (Mamba-1, Mamba-2, hybrids) from scratch and fine-tune them.

    import ssmkit
    cfg = ssmkit.ModelConfig.preset("tiny")
    model = ssmkit.build_model(cfg)
    out = model(input_ids, labels=input_ids)      # out.logits, out.loss
    ids = ssmkit.generate(model, input_ids, max_new_tokens=64)
    print(ssmkit.env_report())
    model = ssmkit.from_pretrained("state-spaces/mamba-130m-hf")   # or a local HF / mamba_ssm directory
    model.save_pretrained("out", format="hf")                      # or "mamba_ssm"
"""

from . import data, ops
from .env import env_report
from .hub import CheckpointError, from_pretrained
from .models import InferenceCache, LMOutput, MambaLM, ModelConfig, build_model, generate, presets

__version__ = "0.1.0"

__all__ = ["data", "ops", "env_report", "CheckpointError", "from_pretrained", "InferenceCache", "LMOutput", "MambaLM", "ModelConfig", "build_model",
           "generate", "presets", "__version__"]
