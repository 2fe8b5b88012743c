"""Model configs (one group of knobs per SSM mixer) and presets, the Mamba-1 / Mamba-2 / Mamba-3
mixers, causal attention and the gated MLP of hybrids, the LM, its cache and generation, and a
Transformer baseline of matched size."""

from .attention import Attention
from .baseline import matched_transformer, parameter_report
from .cache import InferenceCache, KVState, LayerState, Mamba3State
from .config import MIXERS, PRESETS, SSM_MIXERS, ModelConfig, presets
from .generate import generate, sample_next
from .lm import Block, LMOutput, MambaLM, build_model
from .mamba1 import Mamba1
from .mamba2 import Mamba2
from .mamba3 import Mamba3
from .mlp import GatedMLP
from .moe import SparseMoE, load_balancing_loss
from .norms import RMSNorm, RMSNormGated
from .ssm_config import ConfigError, Mamba1Config, Mamba2Config, Mamba3Config

__all__ = [
    "Attention",
    "ConfigError",
    "GatedMLP",
    "SparseMoE",
    "load_balancing_loss",
    "InferenceCache",
    "KVState",
    "LayerState",
    "MIXERS",
    "PRESETS",
    "SSM_MIXERS",
    "Mamba1Config",
    "Mamba2Config",
    "Mamba3Config",
    "ModelConfig",
    "presets",
    "generate",
    "sample_next",
    "Block",
    "LMOutput",
    "MambaLM",
    "build_model",
    "Mamba1",
    "Mamba2",
    "Mamba3",
    "Mamba3State",
    "RMSNorm",
    "RMSNormGated",
    "matched_transformer",
    "parameter_report",
]
