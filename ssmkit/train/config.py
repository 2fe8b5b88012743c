"""``TrainConfig``: every knob of a training run, as plain values, loadable from YAML.

    cfg = TrainConfig.from_yaml("configs/cpu-tiny.yaml", overrides=["max_steps=50", "lr=1e-3"])
    cfg.grad_accum(world_size=1)     # micro-batches per optimizer step, from the batch sizes

Batch arithmetic (the plan gives the global batch in tokens, e.g. 0.5M):

    micro_batch x grad_accum x world_size x seq_len = batch_tokens

``grad_accum`` is derived, never set; a batch that cannot be met exactly is an error that names
the nearest valid values.

Fine-tuning (:mod:`ssmkit.finetune`): ``base`` names a pretrained checkpoint (anything
:func:`ssmkit.from_pretrained` reads, or a training run's out_dir / checkpoint), which replaces
``model``; ``lora`` trains a LoRA adapter on it (None: full fine-tuning); ``freeze_embedding`` keeps
the embedding (and a head tied to it) fixed. ``precision: bf16-pure`` trains bf16 weights with no
fp32 master copy (weights, gradients and AdamW states in bf16: half the memory of ``bf16``, which
keeps fp32 master weights and autocasts the compute). SFT data: ``data: sft-arith`` /
``sft-docstrings`` (the offline sets, validated on their held-out split) or
``data: "sft:PATH.jsonl"`` (trl's formats; validation on the sibling ``PATH.val.jsonl`` when it
exists), see :mod:`ssmkit.train.data`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from .. import checks

CHOICES = {
    "schedule": ("cosine", "wsd", "constant"),
    "precision": ("fp32", "bf16", "fp16", "bf16-pure"),
    "strategy": ("single", "ddp", "fsdp"),
    "tracking": ("none", "wandb"),
}
# the `lora:` mapping (use_dora: DoRA's magnitude vectors too, ssmkit.finetune.lora)
LORA_KEYS = ("r", "alpha", "dropout", "target_modules", "modules_to_save", "use_dora")
# keys that take sub-keys in overrides: lora.r=8, model_overrides.d_model=128 and, nested,
# model_overrides.mamba2.d_state=64
SUB_KEYS = ("model_overrides", "lora")


@dataclass
class TrainConfig:
    # --- model ---
    model: str = "tiny"  # a preset name (ssmkit.presets()); vocab_size follows the tokenizer
    # ModelConfig fields, e.g. {d_model: 128, mamba2: {d_state: 64}}; a mixer group's field may also
    # be flat ({d_state: 64}: in the group of every SSM mixer the model uses)
    model_overrides: dict = field(default_factory=dict)
    # --- fine-tuning: a pretrained checkpoint instead of `model` (a directory or a hub id) ---
    base: str | None = None
    # LoRA on `base`: {r: 16, alpha: 32, dropout: 0.05, target_modules: [x_proj, in_proj, out_proj]}
    # (the plan's defaults for missing keys; None = full fine-tuning of every weight)
    lora: dict | None = None
    freeze_embedding: bool = False  # keep the input embedding (and an lm_head tied to it) fixed
    # --- data ---
    # a prepared shard directory (has index.json), or a source to prepare
    data: str = "stdlib-docs"
    # used when `data` is a source: gpt2, byte, bpe-<N>, a hub id or a directory
    tokenizer: str = "gpt2"
    # token budget when preparing a source (e.g. 1e9 for "a 1B-token subset")
    data_tokens: int | None = None
    data_workers: int = 1  # tokenizer processes when preparing a source
    # shard directory for evaluation; default: the source's validation split
    val_data: str | None = None
    seq_len: int = 256  # tokens per training window
    batch_tokens: int = 2048  # global batch in tokens (the plan: 0.5M = 2**19 for 130M)
    micro_batch: int = 8  # windows per forward/backward on one device
    # --- optimizer and schedule (Mamba paper, appendix E.2: AdamW, clip 1.0, wd 0.1, warmup +
    # cosine) ---
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 1e-5  # the schedule ends here
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # not on norms, biases, A_log, D, dt_bias, embeddings
    warmup_steps: int = 100  # linear warmup from 0
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay) | constant
    decay_frac: float = 0.2  # wsd: the last fraction of steps decays linearly to min_lr
    grad_clip: float = 1.0  # max global grad norm (0: off)
    max_steps: int | None = None  # length of the run: steps ...
    max_tokens: int | None = None  # ... or tokens (ceil(max_tokens / batch_tokens) steps)
    # --- numerics and hardware ---
    # fp32 | bf16 (autocast, fp32 master weights) | fp16 (+ grad scaler) | bf16-pure (bf16 weights,
    # no master)
    precision: str = "fp32"
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N | mps
    strategy: str = "single"  # single | ddp | fsdp (under torchrun)
    compile: bool = False  # torch.compile the model
    activation_checkpointing: bool = (
        False  # recompute each block in the backward (long context: less memory)
    )
    loss_chunk_size: int = 0  # > 0: LM head + loss over chunks of this many positions
    max_bad_steps: int = 5  # stop after this many non-finite losses in a row (each is skipped)
    # --- bookkeeping ---
    seed: int = 0
    out_dir: str = "runs/train"  # metrics.jsonl, config.yaml, checkpoints/
    # a new run in an out_dir holding one: False = error, True = replace it
    overwrite: bool = False
    log_every: int = 10  # steps between metrics lines
    eval_every: int = 100  # steps between evaluations (0: only at the end)
    eval_batches: int = 8  # micro-batches per evaluation, all ranks together
    ckpt_every: int = 0  # steps between checkpoints (0: only at the end)
    keep_last: int = 3  # checkpoints kept on disk
    tracking: str = "none"  # none | wandb (offline unless WANDB_MODE says otherwise)
    wandb_project: str = "ssmkit"
    progress: bool = True  # tqdm progress bar on rank 0

    def __post_init__(self):
        if isinstance(self.betas, (list, tuple)):
            self.betas = tuple(self.betas)
        self.validate()

    # --- validation -----------------------------------------------------------------------------
    def validate(self):
        """Check every field (one clear error naming the first bad one) and normalise numbers
        (5e8 -> 500000000)."""
        for name in ("model", "data", "tokenizer", "out_dir", "wandb_project"):
            checks.text(getattr(self, name), name)
        if self.val_data is not None:
            checks.text(self.val_data, "val_data (a shard directory or null)")
        for name in (
            "compile",
            "overwrite",
            "progress",
            "activation_checkpointing",
            "freeze_embedding",
        ):
            setattr(self, name, checks.boolean(getattr(self, name), name))
        for name, valid in CHOICES.items():
            setattr(self, name, checks.choice(getattr(self, name), name, valid))
        budgets = ("batch_tokens", "max_tokens", "data_tokens")  # token counts: YAML may write 5e8
        for name in (
            "seq_len",
            "batch_tokens",
            "micro_batch",
            "log_every",
            "eval_batches",
            "keep_last",
            "max_bad_steps",
            "data_workers",
        ):
            setattr(
                self,
                name,
                checks.integer(getattr(self, name), name, minimum=1, whole_floats=name in budgets),
            )
        for name in ("warmup_steps", "eval_every", "ckpt_every", "seed", "loss_chunk_size"):
            setattr(self, name, checks.integer(getattr(self, name), name, minimum=0))
        for name in ("max_steps", "max_tokens", "data_tokens"):
            setattr(
                self,
                name,
                checks.integer(
                    getattr(self, name), name, minimum=1, none_ok=True, whole_floats=name in budgets
                ),
            )
        if self.max_steps is None and self.max_tokens is None:
            raise ValueError("set max_steps or max_tokens (the length of the run)")
        self.lr = checks.number(self.lr, "lr", low=0, low_open=True)
        if not (checks.is_number(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"min_lr must be in [0, lr={self.lr}]; got {self.min_lr!r}")
        if not (
            isinstance(self.betas, tuple)
            and len(self.betas) == 2
            and all(checks.is_number(b) and 0 <= b < 1 for b in self.betas)
        ):
            raise ValueError(f"betas must be two numbers in [0, 1); got {self.betas!r}")
        for name in ("weight_decay", "grad_clip", "eps"):
            setattr(self, name, checks.number(getattr(self, name), name, low=0))
        self.decay_frac = checks.number(self.decay_frac, "decay_frac", low=0, high=1, low_open=True)
        if not isinstance(self.model_overrides, dict):
            raise ValueError(
                f"model_overrides must be a mapping of ModelConfig fields; "
                f"got {self.model_overrides!r}"
            )
        checks.device_name(self.device)
        self._validate_finetune()
        self.grad_accum(1)  # the batch must divide for one process

    def _validate_finetune(self):
        """``base`` replaces ``model``; ``lora`` needs ``base`` and single/ddp; its values are
        checked."""
        if self.base is not None:
            checks.text(self.base, "base (a checkpoint directory or hub id, or null)")
            if self.model != "tiny" or self.model_overrides:
                raise ValueError(
                    f"base={self.base!r} gives the model (its architecture and weights); leave "
                    f"model and model_overrides unset (got model={self.model!r}, "
                    f"model_overrides={self.model_overrides!r})"
                )
        if self.lora is None:
            return
        if not isinstance(self.lora, dict):
            raise ValueError(
                f"lora must be a mapping with keys from {list(LORA_KEYS)}, or null for full "
                f"fine-tuning; got {self.lora!r}"
            )
        unknown = sorted(set(self.lora) - set(LORA_KEYS))
        if unknown:
            raise ValueError(f"unknown lora keys {unknown}; valid keys: {', '.join(LORA_KEYS)}")
        if self.base is None:
            raise ValueError(
                "lora needs base: the pretrained checkpoint the adapter trains on (a directory "
                "ssmkit.from_pretrained reads, a run's out_dir, or a hub id)"
            )
        if self.strategy == "fsdp":
            raise ValueError(
                "lora with strategy fsdp is not supported: the adapter and its optimizer state "
                "are small, use strategy ddp (or single)"
            )
        lora = self.lora
        if "r" in lora:
            checks.integer(lora["r"], "lora.r", minimum=1)
        if "alpha" in lora:
            checks.number(lora["alpha"], "lora.alpha", low=0, low_open=True)
        if "dropout" in lora and not (
            checks.is_number(lora["dropout"]) and 0 <= lora["dropout"] < 1
        ):
            raise ValueError(f"lora.dropout must be a number in [0, 1); got {lora['dropout']!r}")
        if "use_dora" in lora:  # "true" from --set lora.use_dora=true becomes True
            self.lora = lora = {
                **lora,
                "use_dora": checks.boolean(lora["use_dora"], "lora.use_dora"),
            }
        for key in ("target_modules", "modules_to_save"):
            value = lora.get(key)
            if value is not None and not (
                isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)
            ):
                raise ValueError(
                    f"lora.{key} must be a list of module names (e.g. [x_proj, in_proj, "
                    f"out_proj]) or null; got {value!r}"
                )

    def grad_accum(self, world_size: int = 1) -> int:
        """Micro-batches per optimizer step: batch_tokens / (micro_batch * world_size * seq_len)."""
        per_pass = self.micro_batch * world_size * self.seq_len
        if self.batch_tokens % per_pass == 0:
            return self.batch_tokens // per_pass
        lower = max(1, self.batch_tokens // per_pass) * per_pass
        micro = [
            m
            for m in range(1, self.micro_batch + 1)
            if self.batch_tokens % (m * world_size * self.seq_len) == 0
        ]
        hint = f"micro_batch={micro[-1]}" if micro else "another seq_len"
        raise ValueError(
            f"batch_tokens={self.batch_tokens} is not a multiple of "
            f"micro_batch x world_size x seq_len = "
            f"{self.micro_batch} x {world_size} x {self.seq_len} = {per_pass}; "
            f"nearest valid batch_tokens: {lower} or {lower + per_pass}, or keep it with {hint}"
        )

    def model_config(self, vocab_size: int | None = None):
        """The :class:`~ssmkit.ModelConfig` this run trains: the ``model`` preset with
        ``model_overrides``, its vocabulary the tokenizer's (``vocab_size``: given, e.g. the
        prepared shards'; else :func:`ssmkit.data.vocab_size` of ``tokenizer``). An override of
        vocab_size wins."""
        from ..data import vocab_size as tokenizer_vocab
        from ..models import ModelConfig

        vocab = tokenizer_vocab(self.tokenizer) if vocab_size is None else vocab_size
        return ModelConfig.preset(self.model, **{"vocab_size": vocab, **self.model_overrides})

    def total_steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return math.ceil(self.max_tokens / self.batch_tokens)

    # --- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict, overrides: list[str] | dict | None = None) -> TrainConfig:
        d = dict(d)
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(checks.unknown_key(unknown[0], valid, "TrainConfig key"))
        for key, value in _parse_overrides(overrides).items():
            top, _, sub = key.partition(".")
            if top not in valid:
                raise ValueError(checks.unknown_key(top, valid, "key") + f" (in --set {key}=...)")
            if sub:
                if top not in SUB_KEYS:
                    raise ValueError(
                        f"{key!r}: only {' and '.join(SUB_KEYS)} take sub-keys "
                        "(model_overrides.d_model=..., "
                        "model_overrides.mamba2.d_state=..., lora.r=...)"
                    )
                path = sub.split(".") if top == "model_overrides" else [sub]
                d[top] = _set_nested(d.get(top) or {}, path, value, key)
            else:
                d[top] = value
        return cls(**d)

    @classmethod
    def from_yaml(cls, path, overrides: list[str] | dict | None = None) -> TrainConfig:
        """A YAML file of TrainConfig keys (read with :func:`ssmkit.checks.load_yaml`: 3e-3 is a
        number)."""
        import yaml

        path = Path(path)
        if not path.exists():
            raise ValueError(f"config file {path} does not exist")
        if not path.is_file():
            raise ValueError(
                f"config file {path} is a directory, not a YAML file (see configs/*.yaml)"
            )
        try:
            d = checks.load_yaml(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
            why = " ".join(str(exc).split())  # YAML's message spans lines (a caret under it)
            raise ValueError(f"config file {path} is not valid YAML: {why}") from None
        if not isinstance(d, dict):
            raise ValueError(
                f"{path} must hold a mapping of TrainConfig keys; got {type(d).__name__}"
            )
        return cls.from_dict(d, overrides)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _set_nested(mapping: dict, path: list[str], value, key: str) -> dict:
    """A copy of ``mapping`` with ``value`` at ``path`` (["mamba2", "d_state"]), the mappings on the
    way copied or made; ``key`` (the override as written) names a step that is no mapping."""
    out = dict(mapping)
    if len(path) > 1:
        inner = out.get(path[0])
        if inner is not None and not isinstance(inner, dict):
            raise ValueError(f"override {key!r}: {path[0]} is {inner!r}, not a mapping of sub-keys")
        out[path[0]] = _set_nested(inner or {}, path[1:], value, key)
    else:
        out[path[0]] = value
    return out


def _parse_overrides(overrides) -> dict:
    """``["lr=1e-3", "model_overrides.d_model=128"]`` or a dict -> {key: value}; values read with
    :func:`ssmkit.checks.parse_value` (the grammar of every command line: none, true, 1e3, [1,
    2])."""
    if overrides is None:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not key=value")
        out[key.strip()] = checks.parse_value(value)
    return out
