"""Model configs (one group of knobs per SSM mixer) and presets, the Mamba-1 / Mamba-2 / Mamba-3
mixers, the S4D and H3 mixers, causal attention and the gated MLP of hybrids, the LM, its cache and
generation, and a Transformer baseline of matched size."""

from .attention import Attention
from .baseline import matched_transformer, parameter_report
from .cache import InferenceCache, KVState, LayerState, LTIState, Mamba3State
from .config import LTI_MIXERS, MAMBA_MIXERS, MIXERS, PRESETS, SSM_MIXERS, ModelConfig, presets
from .generate import generate, sample_next
from .h3 import H3
from .lm import Block, LMOutput, MambaLM, build_model
from .mamba1 import Mamba1
from .mamba2 import Mamba2
from .mamba3 import Mamba3
from .mlp import GatedMLP
from .moe import SparseMoE, load_balancing_loss
from .norms import RMSNorm, RMSNormGated
from .s4d import S4D, DiagonalSSM
from .ssm_config import (
    ConfigError,
    H3Config,
    Mamba1Config,
    Mamba2Config,
    Mamba3Config,
    S4DConfig,
)

__all__ = [
    "Attention",
    "ConfigError",
    "GatedMLP",
    "SparseMoE",
    "load_balancing_loss",
    "InferenceCache",
    "KVState",
    "LayerState",
    "LTIState",
    "LTI_MIXERS",
    "MAMBA_MIXERS",
    "MIXERS",
    "PRESETS",
    "SSM_MIXERS",
    "Mamba1Config",
    "Mamba2Config",
    "Mamba3Config",
    "H3Config",
    "S4DConfig",
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
    "S4D",
    "H3",
    "DiagonalSSM",
    "RMSNorm",
    "RMSNormGated",
    "matched_transformer",
    "parameter_report",
]
