"""Load and save checkpoints in the layouts of the ecosystem.

* Hugging Face transformers: ``config.json`` with ``model_type`` "mamba", "falcon_mamba" or "mamba2"
  and weights
  ``model.safetensors`` (or ``pytorch_model.bin``, or shards with ``*.index.json``) named
  ``backbone.embeddings.weight``, ``backbone.layers.N.{norm,mixer.*}``, ``backbone.norm_f.weight``,
  ``lm_head.weight``; and the hybrids ``model_type`` "jamba" (dense FFNs or a mixture of experts;
  ``format="jamba"``, :mod:`~ssmkit.hub.jamba`) and "zamba2" (``format="zamba2"``,
  :mod:`~ssmkit.hub.zamba2`).
* mamba_ssm's ``MambaLMHeadModel``: ``config.json`` with ``d_model``, ``n_layer``, ``ssm_cfg``,
  ``attn_layer_idx``, ``attn_cfg``, ``d_intermediate`` and ``pytorch_model.bin`` named as ssmkit's
  own modules (``backbone.embedding.weight``, ``backbone.layers.N.{norm,mixer,norm2,mlp}.*``, ...).

``from_pretrained`` detects the layout, maps every weight by name, checks every shape and never
loads partially; every problem with a checkpoint (a config field, a shard index, a weight file) is
a :class:`CheckpointError` naming the file. ``save_pretrained`` writes only its own files (see
:data:`OUR_FILES`): a checkpoint of ours is rebuilt beside and swapped in, a directory holding
anything else is refused unless ``overwrite=True``, and then only our files in it are replaced.

The package, one module per job: :mod:`~ssmkit.hub.layouts` (the file names,
:class:`CheckpointError`, the config tables both ways), :mod:`~ssmkit.hub.load`
(``from_pretrained``, and what every loader reads the same way: ``parse_dtype``, ``is_hub_id``) and
:mod:`~ssmkit.hub.save` (``save_pretrained``, which ``MambaLM.save_pretrained`` delegates to through
a hook the hub fills:
the hub builds on models, so models never import the hub; ``save_tokenizer``).
"""

from .layouts import (
    FORMATS,
    OUR_FILES,
    SHARD_INDEXES,
    TOKENIZER_FILES,
    WEIGHT_FILES,
    CheckpointError,
    config_from_hf,
    config_from_mamba_ssm,
    config_to_hf,
    config_to_mamba_ssm,
)
from .load import DTYPES, from_pretrained, is_hub_id, parse_dtype
from .save import save_pretrained, save_tokenizer

__all__ = [
    "DTYPES",
    "FORMATS",
    "OUR_FILES",
    "SHARD_INDEXES",
    "TOKENIZER_FILES",
    "WEIGHT_FILES",
    "CheckpointError",
    "config_from_hf",
    "config_from_mamba_ssm",
    "config_to_hf",
    "config_to_mamba_ssm",
    "from_pretrained",
    "is_hub_id",
    "parse_dtype",
    "save_pretrained",
    "save_tokenizer",
]
