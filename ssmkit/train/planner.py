r"""The memory planner: what one training step holds on each GPU, and the largest micro-batch that
fits.

    plan = plan_memory("mamba-1.4b", seq_len=2048, micro_batch=8, precision="bf16", strategy="fsdp",
                       n_gpus=8, gpu_memory_gb=80)
    print(plan.table())        # weights, gradients, optimizer, activations, workspace, total (GiB)
    plan.max_micro_batch       # the largest micro-batch whose total fits the usable memory
    print(memory_table(scale_up_plans()))      # the plan's sizes side by side on 8 x A100-80GB
    # command line: ssmkit plan --model mamba-1.4b --seq-len 2048 --micro-batch 8 --gpus 8

Per GPU, in bytes, for P parameters (counted on the real model, built on the meta device):

    weights      4 P           fp32 master weights (bf16/fp16 train by autocast, or FSDP's
                               casting policy)
    gradients    4 P           fp32; DDP adds its buckets (another 4 P); FSDP keeps 1/N of them
    optimizer    8 P           AdamW's two fp32 moments (m, v); FSDP keeps 1/N
    activations  what the forward saves for the backward (formulas below), per micro-batch
    workspace    what lives only around the peak, on top of the activations: the loss's two B·L·V
                 gradients, a part's backward temporaries (planner_mixers.BACKWARD_TEMPS: a fraction
                 of what it saved, measured on CPU), the tied lm_head's gradient (held until the
                 embedding's arrives), a recomputed block (checkpointing), autocast's bf16/fp16
                 copies of the matrices, FSDP's gathered blocks; or, once the activations are gone,
                 the embedding's backward or (CPU) AdamW's temporaries
    total        weights + gradients + optimizer + activations + workspace

The gradients are counted at full size during the forward, as they are from the second micro-batch
of a step with gradient accumulation on (a step of one micro-batch starts without them, so peaks
lower).

Activations: what each block's parts save for the backward pass, per token of one layer, are in
:mod:`ssmkit.train.planner_mixers` (norms; Mamba-1, -2 and -3 on their torch and cuda paths, Mamba-1
also with the fused CPU scan; S4D and H3, PyTorch only; attention; MLP); and:

    the LM head   norm_f, embedding ids (8 bytes), and log_softmax's fp32 output B·L·V (4
                  bytes each); its backward adds two more fp32 B·L·V (the gradients of
                  log_softmax's output and input), counted in the workspace. With
                  loss_chunk_size c: no B·L·V term, and 12·c·V bytes of workspace (one
                  chunk's logits recomputed in the backward)
    checkpointing only each block's inputs d [a] + d [f] stay; one block is recomputed in the
    backward

FSDP (n > 1 GPUs, ``fully_shard`` on each block, then the root): the gathered low-precision copy of
the root (embedding, norm_f) and of two blocks (the one running and the one prefetched), the root's
and one block's unsharded gradients (and the fp32 copy reduce-scatter takes) are workspace.
Backends: ``cpu`` is what a CPU run takes by default (the fused C++ scan for Mamba-1, ssmkit's
PyTorch path for the rest), ``torch`` the PyTorch path everywhere (``SSMKIT_BACKEND=torch``; a CPU
where the fused scan does not build; a GPU without the kernels): tests/unit/train/test_planner.py
checks both against autograd's saved tensors, and ``cpu`` against measured peaks; ``cuda`` the
kernels (from their ``save_for_backward``; not yet measured on a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import checks
from ..models import MIXERS, ModelConfig, build_model
from ..models.config import PRESETS
from .config import CHOICES, TrainConfig
from .planner_mixers import PYTORCH_BACKENDS, backward_peak, block_parts, norm_bytes

PRECISIONS, STRATEGIES = (
    CHOICES["precision"],
    CHOICES["strategy"],
)  # TrainConfig's: fp32 ..., single ...
BACKENDS = ("cuda", "cpu", "torch")
OPTIMIZERS = ("adamw",)
GiB = 2**30
SAFETY_MARGIN = 0.10  # of the GPU's memory kept free: the caching allocator's fragmentation
RESERVED_GIB = 1.0  # the CUDA context, cuBLAS and NCCL workspaces (outside torch's allocator)
ROWS = ("weights", "grads", "optimizer", "activations", "workspace", "total")
LABELS = {
    "weights": "weights (fp32)",
    "grads": "gradients (fp32)",
    "optimizer": "optimizer (AdamW m, v)",
    "activations": "activations",
    "workspace": "workspace",
    "total": "**total**",
}


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU bytes of one training step (see the module docstring for what each term holds)."""

    model: str  # preset name, or the config's description
    params: int  # parameters of the model (tied weights once), as build_model has them
    seq_len: int
    micro_batch: int
    precision: str
    strategy: str
    n_gpus: int
    activation_checkpointing: bool
    loss_chunk_size: int  # 0: the loss over all positions at once
    backend: str  # "cuda" (mamba_ssm kernels), "cpu" (a CPU run's default) or "torch" (PyTorch)
    optimizer_kind: str
    gpu_memory_gb: float  # the GPU's memory in GiB (80 for an A100-80GB)
    weights: int
    grads: int
    optimizer: int
    activations: int
    workspace: int
    total: int
    usable: int  # bytes a plan may use: the GPU's memory less the margin and the reserve
    max_micro_batch: int  # the largest micro-batch with total <= usable (0: not even 1 fits)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "fits": self.fits}

    def table(self) -> str:
        """What was planned (one line), then a markdown table of GiB per GPU and the largest
        micro-batch."""
        extras = [", activation checkpointing"] * self.activation_checkpointing + [
            f", loss chunks of {self.loss_chunk_size}"
        ] * bool(self.loss_chunk_size)
        return (
            f"{self.model}: {self.params:,} parameters; seq_len {self.seq_len} x micro_batch "
            f"{self.micro_batch}, {self.precision}, {self.strategy} on {self.n_gpus} GPU(s) of "
            f"{self.gpu_memory_gb:g} GiB, backend {self.backend}"
            + "".join(extras)
            + "\n\n"
            + memory_table({self.model: self})
        )


def memory_table(plans: dict[str, MemoryPlan]) -> str:
    """Plans side by side: one markdown column per plan (GiB per GPU), rows as in
    :attr:`MemoryPlan.table`."""
    if not plans:
        raise ValueError("memory_table needs at least one plan")
    names = list(plans)
    lines = ["| per GPU (GiB) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for row in ROWS:
        cells = [f"{getattr(p, row) / GiB:.2f}" for p in plans.values()]
        if row == "total":
            cells = [
                f"**{c}**" + ("" if p.fits else " (does not fit)")
                for c, p in zip(cells, plans.values())
            ]
        lines.append(f"| {LABELS[row]} | " + " | ".join(cells) + " |")
    lines.append("| usable | " + " | ".join(f"{p.usable / GiB:.2f}" for p in plans.values()) + " |")
    lines.append(
        "| max micro_batch | " + " | ".join(str(p.max_micro_batch) for p in plans.values()) + " |"
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class _Shape:
    """What the formulas need of a model: its config and parameter counts from the real module."""

    cfg: object  # ssmkit.ModelConfig
    params: int
    root: int  # parameters outside the blocks (embedding, norm_f, an untied lm_head)
    blocks: tuple[int, ...]  # parameters of each block
    matrices: int  # elements of Linear / Conv weights (autocast casts these)
    block_matrices: int  # ... of the largest block
    head: int  # elements of the lm_head weight
    largest: int  # elements of the largest parameter


@functools.lru_cache(maxsize=32)
def _shape_of(cfg_json: str) -> _Shape:
    cfg = ModelConfig.from_dict(json.loads(cfg_json))
    with torch.device("meta"):
        model = build_model(cfg)
    matrix = lambda m: [m.weight] if isinstance(m, (nn.Linear, nn.Conv1d)) else []  # noqa: E731
    numel = lambda ps: sum(p.numel() for p in {id(p): p for p in ps}.values())  # noqa: E731
    blocks = tuple(numel(b.parameters()) for b in model.backbone.layers)
    params = model.num_parameters()
    return _Shape(
        cfg=cfg,
        params=params,
        root=params - sum(blocks),
        blocks=blocks,
        matrices=numel(w for m in model.modules() for w in matrix(m)),
        block_matrices=max(
            numel(w for m in b.modules() for w in matrix(m)) for b in model.backbone.layers
        ),
        head=model.lm_head.weight.numel(),
        largest=max(p.numel() for p in model.parameters()),
    )


def _resolve(model):
    """(name, ModelConfig, TrainConfig or None) of a preset, a YAML path, a ModelConfig or a
    TrainConfig."""
    if isinstance(model, str) and model in PRESETS:
        return model, ModelConfig.preset(model), None
    if isinstance(model, (str, Path)) and Path(model).suffix in (".yaml", ".yml"):
        model = TrainConfig.from_yaml(model)
    if isinstance(model, TrainConfig):
        return model.model, model.model_config(), model
    if isinstance(model, ModelConfig):
        return f"{model.mixer} d_model={model.d_model} n_layer={model.n_layer}", model, None
    raise ValueError(
        f"model={model!r} is not valid; valid: a preset ({', '.join(PRESETS)}), a YAML run "
        "config (configs/*.yaml), a ModelConfig or a TrainConfig"
    )


def _step_bytes(
    shape: _Shape,
    B: int,
    L: int,
    precision: str,
    strategy: str,
    n: int,
    ckpt: bool,
    chunk: int,
    backend: str,
) -> dict:
    """weights, grads, optimizer, activations, workspace and total for micro-batch B."""
    cfg = shape.cfg
    a = 4 if precision == "fp32" else 2
    P, tokens, V, d = shape.params, B * L, cfg.padded_vocab_size, cfg.d_model
    shard = n if strategy == "fsdp" else 1
    weights, optimizer = 4 * P / shard, 8 * P / shard
    grads = 4 * P / shard + (4 * P if strategy == "ddp" and n > 1 else 0)  # DDP's gradient buckets
    layers = [
        block_parts(cfg, kind, backend, B, L, a, moe=i in cfg.moe_layers)
        for i, kind in enumerate(cfg.mixers)
    ]
    head = tokens * (norm_bytes(cfg, backend, a) + 8)  # norm_f and the token ids
    if chunk:  # one chunk's logits recomputed: log_softmax's output and two gradients
        loss_saved, loss_temps = 0, 12 * min(chunk, tokens) * V
    else:  # log_softmax's output is saved; its backward adds two gradients
        loss_saved, loss_temps = 4 * tokens * V, 8 * tokens * V
    # the blocks' inputs (hidden [a], residual [f]; the first block's one input is the embedding)
    if ckpt:
        n_layer = len(layers)
        inputs = tokens * d * (4 + (n_layer - 1) * a + max(0, n_layer - 2) * 4)
        activations = inputs + head + loss_saved
        blocks = max(backward_peak(parts, backend) for parts in layers)  # one block recomputed
    else:
        activations = sum(b for parts in layers for _, b in parts) + head + loss_saved
        blocks = backward_peak([p for parts in layers for p in parts], backend) - (
            activations - head - loss_saved
        )
    fsdp_cast = strategy == "fsdp" and n > 1
    tied = cfg.tie_embeddings
    # the lm_head's weight gradient: with tied embeddings autograd holds it until the embedding's
    # own gradient arrives at the end of the backward (FSDP: part of the root's unsharded gradients
    # below)
    head_grad = 4 * shape.head if tied and not fsdp_cast else 0
    backward = max(loss_temps, 4 * shape.head, head_grad + blocks)
    if a == 2 and not fsdp_cast:  # autocast's bf16/fp16 copies of the matrices
        backward += 2 * ((shape.head + shape.block_matrices) if ckpt else shape.matrices)
    if fsdp_cast:  # gathered root + 2 blocks, the root's and a block's unsharded gradients
        backward += 2 * a * shape.root + 2 * a * max(shape.blocks) + (a + 4) * max(shape.blocks)
    # after the activations are gone: the embedding's backward (its dense gradient, the lm_head's
    # held one and their sum; FSDP: the root gathered, its gradient and the fp32 copy reduce-scatter
    # takes), then AdamW's per-parameter temporaries (sqrt(v) and its quotient) on CPU; fused CUDA
    # AdamW has none
    tail = (2 * a + 4) * shape.root if fsdp_cast else 4 * shape.head * (3 if tied else 1)
    step = 2 * 4 * shape.largest if backend in PYTORCH_BACKENDS else 0
    state = weights + grads + optimizer
    total = state + max(activations + backward, tail, step)
    return dict(
        weights=int(weights),
        grads=int(grads),
        optimizer=int(optimizer),
        activations=int(activations),
        workspace=int(total - state - activations),
        total=int(total),
    )


# --- the public entry points ----------------------------------------------------------------------


def plan_memory(
    model,
    *,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    precision: str | None = None,
    strategy: str | None = None,
    activation_checkpointing: bool | None = None,
    n_gpus: int = 1,
    gpu_memory_gb: float = 80.0,
    optimizer: str = "adamw",
    loss_chunk_size: int | None = None,
    backend: str = "cuda",
) -> MemoryPlan:
    """The per-GPU memory of a training step of ``model`` (see the module docstring for the
    formulas).

    model: a preset name (``ssmkit.presets()``), a YAML run config's path, a
    :class:`~ssmkit.ModelConfig` or a :class:`~ssmkit.train.TrainConfig`, whose seq_len,
    micro_batch, precision, strategy, activation_checkpointing and loss_chunk_size are the defaults
    here (arguments given win).
    Without a TrainConfig: precision "bf16", strategy "fsdp", no checkpointing; seq_len and
    micro_batch are required. n_gpus: processes (one GPU each); gpu_memory_gb: one GPU's memory in
    GiB.
    backend: "cuda" (mamba_ssm kernels on a GPU), "cpu" (what a CPU run takes by default: the fused
    C++ scan for Mamba-1, the PyTorch path for the rest) or "torch" (ssmkit's PyTorch path
    everywhere: SSMKIT_BACKEND=torch, or a GPU without the kernels).
    Invalid values raise ValueError naming the field and what is valid."""
    name, cfg, train_cfg = _resolve(model)
    given = dict(
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=precision,
        strategy=strategy,
        activation_checkpointing=activation_checkpointing,
        loss_chunk_size=loss_chunk_size,
    )
    defaults = dict(
        precision="bf16", strategy="fsdp", activation_checkpointing=False, loss_chunk_size=0
    )
    for key, value in given.items():
        if value is None:
            given[key] = getattr(train_cfg, key) if train_cfg is not None else defaults.get(key)
    seq_len = checks.integer(given["seq_len"], "seq_len", minimum=1)
    micro_batch = checks.integer(given["micro_batch"], "micro_batch", minimum=1)
    precision = checks.choice(given["precision"], "precision", PRECISIONS)
    strategy = checks.choice(given["strategy"], "strategy", STRATEGIES)
    ckpt = checks.boolean(given["activation_checkpointing"], "activation_checkpointing")
    chunk = checks.integer(given["loss_chunk_size"], "loss_chunk_size", minimum=0)
    n_gpus = checks.integer(n_gpus, "n_gpus", minimum=1)
    memory = checks.number(gpu_memory_gb, "gpu_memory_gb", low=0, low_open=True)
    optimizer = checks.choice(optimizer, "optimizer", OPTIMIZERS)
    backend = checks.choice(backend, "backend", BACKENDS)
    if strategy == "single" and n_gpus > 1:
        raise ValueError(
            f"n_gpus={n_gpus} needs strategy ddp or fsdp: strategy=single runs one process "
            "(n_gpus 1)"
        )
    if cfg.zamba2 is not None:
        raise ValueError(
            f"the planner models ssmkit's Backbone, any layout of {', '.join(MIXERS)}; "
            "a zamba2 config (its shared attention blocks) is not modelled"
        )
    shape = _shape_of(json.dumps(cfg.to_dict(), sort_keys=True))
    usable = int(memory * GiB * (1 - SAFETY_MARGIN) - RESERVED_GIB * GiB)

    def fits(b):
        step = _step_bytes(shape, b, seq_len, precision, strategy, n_gpus, ckpt, chunk, backend)
        return step["total"] <= usable

    if not fits(1):
        best = 0
    else:  # the largest b that fits, with b + 1 not fitting: doubling, then bisection
        lo, hi = 1, 2
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        best = lo
    sizes = _step_bytes(
        shape, micro_batch, seq_len, precision, strategy, n_gpus, ckpt, chunk, backend
    )
    return MemoryPlan(
        model=name,
        params=shape.params,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=precision,
        strategy=strategy,
        n_gpus=n_gpus,
        activation_checkpointing=ckpt,
        loss_chunk_size=chunk,
        backend=backend,
        optimizer_kind=optimizer,
        gpu_memory_gb=memory,
        usable=usable,
        max_micro_batch=best,
        **sizes,
    )


# stages 1 and 2's sizes
SCALE_UP_PRESETS = ("mamba-130m", "mamba-370m", "mamba-1.4b", "mamba2-1.3b")
# how a model is spread over the GPUs: (strategy, activation checkpointing)
SCALE_UP_WAYS = {"ddp": ("ddp", False), "fsdp": ("fsdp", False), "fsdp+ckpt": ("fsdp", True)}


def scale_up_plans(
    presets=SCALE_UP_PRESETS,
    *,
    ways=tuple(SCALE_UP_WAYS),
    seq_len: int = 2048,
    micro_batch: int = 8,
    n_gpus: int = 8,
    gpu_memory_gb: float = 80.0,
    precision: str = "bf16",
) -> dict[str, MemoryPlan]:
    """The memory plan of each preset on ``n_gpus`` GPUs of ``gpu_memory_gb`` (A100-80GB by default;
    the cuda kernels' formulas), spread over them in each of the ``ways`` of :data:`SCALE_UP_WAYS`
    (DDP, FSDP, FSDP with activation checkpointing). Keys ``"<preset> <way>"``; show them with
    ``print(memory_table(scale_up_plans()))``."""
    unknown = [w for w in ways if w not in SCALE_UP_WAYS]
    if unknown or not ways:
        raise ValueError(
            f"ways={list(ways)!r} is not valid; valid: a non-empty list of "
            f"{', '.join(SCALE_UP_WAYS)}"
        )
    plans = {}
    for preset in presets:
        for way in ways:
            strategy, ckpt = SCALE_UP_WAYS[way]
            plans[f"{preset} {way}"] = plan_memory(
                preset,
                seq_len=seq_len,
                micro_batch=micro_batch,
                precision=precision,
                strategy=strategy,
                activation_checkpointing=ckpt,
                n_gpus=n_gpus,
                gpu_memory_gb=gpu_memory_gb,
            )
    return plans


# --- ssmkit plan ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``ssmkit plan``; values are read as on every command line (checks.parse_value)
    and checked by :func:`plan_memory`, whose errors name the field and what is valid."""
    value = checks.parse_value
    parser.add_argument(
        "--model",
        required=True,
        metavar="PRESET_OR_YAML",
        help="a preset (mamba-1.4b, ...) or a run config (configs/*.yaml: its seq_len, "
        "micro_batch, precision, strategy, ... are the defaults)",
    )
    parser.add_argument(
        "--seq-len", type=value, default=None, metavar="N", help="tokens per window"
    )
    parser.add_argument(
        "--micro-batch",
        type=value,
        default=None,
        metavar="N",
        help="windows per GPU per forward/backward",
    )
    parser.add_argument("--precision", default=None, help="fp32, bf16 (default) or fp16")
    parser.add_argument("--strategy", default=None, help="single, ddp or fsdp (default)")
    parser.add_argument(
        "--gpus", type=value, default=1, metavar="N", help="GPUs (processes), default 1"
    )
    parser.add_argument(
        "--gpu-memory-gb",
        type=value,
        default=80.0,
        metavar="GIB",
        help="memory of one GPU in GiB (default 80: an A100-80GB)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute each block in the backward (default: the config's, else off)",
    )
    parser.add_argument(
        "--loss-chunk-size",
        type=value,
        default=None,
        metavar="N",
        help="compute the LM head and loss over chunks of N positions (0: at once)",
    )
    parser.add_argument(
        "--backend",
        default="cuda",
        help="cuda (mamba_ssm kernels on a GPU; default), cpu (what a CPU run takes by default: "
        "the fused C++ Mamba-1 scan, PyTorch for the rest) or torch (PyTorch everywhere: "
        "SSMKIT_BACKEND=torch, or a GPU without the kernels)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the plan as JSON instead of a table"
    )
    return parser


def run(args) -> int:
    """``ssmkit plan``: print the plan's table (or JSON); a bad value is one line on stderr,
    status 2."""
    missing = [
        f"--{f}" for f in ("seq-len", "micro-batch") if getattr(args, f.replace("-", "_")) is None
    ]
    if missing and not str(args.model).endswith((".yaml", ".yml")):
        print(
            f"ssmkit plan: a preset needs {missing[0]} (a run config has its own)", file=sys.stderr
        )
        return 2
    try:
        plan = plan_memory(
            args.model,
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            precision=args.precision,
            strategy=args.strategy,
            activation_checkpointing=args.activation_checkpointing,
            n_gpus=args.gpus,
            gpu_memory_gb=args.gpu_memory_gb,
            loss_chunk_size=args.loss_chunk_size,
            backend=args.backend,
        )
    except ValueError as exc:
        print(f"ssmkit plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict(), indent=1) if args.json else plan.table())
    return 0


def main(argv=None) -> int:
    """``ssmkit plan ARGS``: parse ``argv`` (default sys.argv[1:]) and :func:`run`."""
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="ssmkit plan",
            description="per-GPU memory of a training step and the largest micro-batch",
        )
    )
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))
