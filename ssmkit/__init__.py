"""ssmkit: train state-space language models (Mamba-1, Mamba-2, hybrids) from scratch and fine-tune them.

    import ssmkit
    cfg = ssmkit.ModelConfig.preset("tiny")
    model = ssmkit.build_model(cfg)
    out = model(input_ids, labels=input_ids)      # out.logits, out.loss
    ids = ssmkit.generate(model, input_ids, max_new_tokens=64)
    print(ssmkit.env_report())
"""

from . import ops
from .env import env_report
from .models import InferenceCache, LMOutput, MambaLM, ModelConfig, build_model, generate, presets

__version__ = "0.1.0"

__all__ = ["ops", "env_report", "InferenceCache", "LMOutput", "MambaLM", "ModelConfig", "build_model",
           "generate", "presets", "__version__"]
