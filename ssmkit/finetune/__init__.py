"""Fine-tuning pretrained models: LoRA with peft (that trains on every backend), adapters in peft's
format, merged export.

    lora = ssmkit.finetune.apply_lora(ssmkit.from_pretrained(path))  # the plan's LoraConfig
    ssmkit.finetune.trainable_share(lora)                            # trainable / total parameters
    ssmkit.finetune.save_adapter(lora, "adapter/"); load_adapter(base, "adapter/")
    ssmkit.finetune.adapter_for_transformers("adapter/", "adapter-hf/", base.config)
    ssmkit.finetune.export_merged(lora, "merged/", format="hf")  # merge_and_unload + save
    ssmkit.finetune.export_for_transformers(lora, "base-hf/", "adapter-hf/")  # dt_proj, out_proj
    # folded into the base, the rest of the adapter for peft on transformers' Mamba
    lora = ssmkit.finetune.apply_lora(model, use_dora=True)           # DoRA, peft's format

Training from a run config (``base:``, ``lora:``, ``freeze_embedding:``) is :mod:`ssmkit.train`'s.
"""

from .adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    NOT_FOR_TRANSFORMERS,
    adapter_for_transformers,
    adapter_state,
    export_for_transformers,
    load_adapter,
    read_adapter,
    save_adapter,
)
from .lora import (
    DEFAULT_TARGETS,
    DEFAULTS,
    apply_lora,
    export_merged,
    lora_config,
    merge,
    parameter_counts,
    resolve_targets,
    trainable_share,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "DEFAULTS",
    "DEFAULT_TARGETS",
    "NOT_FOR_TRANSFORMERS",
    "adapter_for_transformers",
    "adapter_state",
    "apply_lora",
    "export_for_transformers",
    "export_merged",
    "load_adapter",
    "lora_config",
    "merge",
    "parameter_counts",
    "read_adapter",
    "resolve_targets",
    "save_adapter",
    "trainable_share",
]
