"""Processes and devices: one process, or several under ``torchrun`` with DDP or FSDP2.

``torchrun --nproc-per-node N -m ssmkit.train --config ...`` sets RANK (over every machine),
WORLD_SIZE, LOCAL_RANK (within this machine) and GROUP_RANK (the machine's); :func:`setup` joins the
process group (nccl on CUDA, gloo on CPU). LOCAL_RANK picks this process's GPU; RANK decides who
writes: rank 0 alone writes the run's files (metrics, config, the checkpoint's model, manifest and
``latest``), while every rank writes its part of a checkpoint (its DCP shard, its RNG state) into
the same ``out_dir``, which several machines must therefore share. Data preparation goes machine by
machine (``ssmkit.train.data._in_turn``). :func:`wrap` then applies

- ``ddp``:  ``DistributedDataParallel``: every rank holds the whole model, gradients all-reduced;
- ``fsdp``: FSDP2's ``fully_shard`` on every block, then on the root, so each rank holds 1/N of
  the parameters, gradients and optimizer state; bf16/fp16 through a ``MixedPrecisionPolicy``
  (parameters gathered in low precision, gradients reduced in fp32, fp32 master weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..env import pick_device

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "bf16-pure": torch.bfloat16,
}


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self):
        if self.enabled:
            dist.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (a collective: every rank must call
        it)."""
        if not self.enabled:
            return bool(flag)
        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value)
        return value.item() > 0

    def broadcast(self, obj):
        """Rank 0's ``obj`` (a small picklable value) on every rank (a collective)."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (a small picklable value), in rank order, on every rank (a
        collective)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.world_size
        return value


def setup(strategy: str, device: str = "auto") -> Dist:
    """Join the torchrun process group if there is one; check the strategy fits."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    name = pick_device(device)  # "auto" -> cuda, else mps, else cpu
    dev = torch.device(f"cuda:{local}" if name == "cuda" else name)  # each rank its own GPU
    if world > 1 and strategy == "single":
        raise ValueError(
            f"WORLD_SIZE={world} (torchrun) needs strategy ddp or fsdp; got strategy=single"
        )
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank=rank, world_size=world, local_rank=local, device=dev)


def teardown(sync: bool = False):
    """Leave the process group. ``sync=True`` (a run that ended normally) first waits for every
    rank, so no rank tears down its connections while another still uses them (gloo then aborts that
    rank)."""
    if dist.is_available() and dist.is_initialized():
        if sync:
            dist.barrier()
        dist.destroy_process_group()


def wrap(model: nn.Module, strategy: str, precision: str, d: Dist) -> nn.Module:
    """The module to call for forward/backward (``model`` itself is modified in place by FSDP).

    With one process both strategies are the plain model: nothing to split or reduce."""
    if d.world_size == 1:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[d.device.index] if d.device.type == "cuda" else None
        )
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
        blocks = getattr(getattr(model, "backbone", None), "layers", None) or getattr(
            getattr(model, "model", None), "layers", None
        )
        if blocks is None:
            raise ValueError(
                f"fsdp needs the model's blocks (model.backbone.layers or model.model.layers); "
                f"{type(model).__name__} has neither"
            )
        # fully_shard replaces every parameter by a sharded one (a DTensor), without the tags the
        # mixers put on theirs (``_no_weight_decay`` on A_log, D, dt_bias: .optim reads it, so A_log
        # would decay under FSDP): carried over by name, which sharding keeps
        tags = {n: _tags(p) for n, p in model.named_parameters(remove_duplicate=False)}
        for block in blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        for n, p in model.named_parameters(remove_duplicate=False):
            for key, value in tags.get(n, {}).items():
                setattr(p, key, value)
        return model
    return model


def _tags(p: torch.Tensor) -> dict:
    """The ``_no_*`` attributes set on a parameter (``_no_weight_decay``, ``_no_reinit``)."""
    return {k: v for k, v in vars(p).items() if k.startswith("_no_")}


def held_mb(model: nn.Module, optimizer) -> float:
    """MiB of parameters and optimizer state this process holds (FSDP: its shards; between steps,
    when the gradients are freed): the counted part of a rank's memory, beside its measured peak."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's shard

    tensors = [local(p) for p in model.parameters()]
    tensors += [
        local(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)
    ]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def gather_floats(value: float, device) -> list[float]:
    """``value`` of every rank, in rank order (a collective: every rank must call it)."""
    mine = torch.tensor([float(value)], device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [round(t.item(), 3) for t in out]
