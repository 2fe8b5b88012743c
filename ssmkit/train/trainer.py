"""``Trainer(model, config, data).fit()``: the plan's training loop, on one CPU or many GPUs.

One optimizer step (global batch B tokens = micro_batch x grad_accum x world_size x seq_len):

    for each of grad_accum micro-batches (x, y):        # y = x shifted by one (the loader's labels)
        loss = CE(model(x).logits, y) / grad_accum       # bf16/fp16 autocast, fp32 master weights
        loss.backward()                                  # DDP/FSDP reduce on the last micro-batch only
    if the loss is not finite: skip the step (counted; stop after max_bad_steps in a row)
    clip the global grad norm to grad_clip; AdamW step at lr_at(step)
    fp16: the grad scaler skips a step whose gradients overflow and halves its scale (counted)

Every ``log_every`` steps a line goes to ``out_dir/metrics.jsonl`` (and the progress bar, callbacks,
wandb; with fp16 ``grad_scale`` and ``scaler_skipped``, under torchrun every rank's ``rank_peak_mem_mb``
and ``rank_state_mb``); every ``eval_every`` steps the validation loss; every ``ckpt_every`` steps a
checkpoint. Losses, perplexity, FLOPs/MFU and peak memory come from :mod:`ssmkit.eval`.
Callbacks are objects with any of ``on_log(trainer, record)``, ``on_eval(trainer, record)``,
``on_end(trainer)``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from ..data import TokenLoader, prepare, source_fingerprint
from ..env import reuse_freed_memory
from ..eval import flops_per_token, lm_loss, mfu, peak_flops, peak_memory_mb, perplexity
from ..io import cache_dir, read_json, tqdm_bar, write_atomically
from ..models import build_model
from . import checkpoint
from .config import TrainConfig
from .distributed import DTYPES, Dist, gather_floats, held_mb, setup, wrap
from .optim import build_optimizer, lr_at
from .rundir import RunDir

PREPARE_WAIT = 6 * 3600        # seconds to wait for another process preparing the same cached shards


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss stayed non-finite for max_bad_steps steps in a row)."""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_")[-80:]


def _long_context(model, cfg: TrainConfig):
    """Switch on activation checkpointing and the chunked loss, which only ssmkit models have."""
    backbone = getattr(model, "backbone", None)
    if not hasattr(backbone, "gradient_checkpointing") or not hasattr(model, "loss_chunk_size"):
        raise ValueError(f"activation_checkpointing / loss_chunk_size need an ssmkit model; "
                         f"{type(model).__name__} has neither (set them to false / 0)")
    backbone.gradient_checkpointing = cfg.activation_checkpointing
    model.loss_chunk_size = cfg.loss_chunk_size


def _rank0_first(d: Dist, fn):
    """``fn()`` on rank 0, then on the other ranks (which find its work done: prepared shards, verified
    checksums); an error on rank 0 stops every rank instead of leaving them waiting."""
    error = result = None
    if d.is_main:
        try:
            result = fn()
        except Exception as exc:
            error = exc
    if d.any(error is not None):
        raise error or ValueError("rank 0 stopped while preparing the data (see its message)")
    return result if d.is_main else fn()


def prepare_data(cfg: TrainConfig, dist: Dist | None = None) -> tuple[Path, Path | None]:
    """Shard directories (train, validation) for ``cfg.data``: used as is when it holds an index.json,
    else the source is prepared once into ``$SSMKIT_CACHE/shards/``. The cache entry is keyed by the
    source's content (:func:`ssmkit.data.source_fingerprint`: an edited local corpus is prepared
    afresh), and a process preparing the same entry is waited for. Under torchrun rank 0 prepares."""
    if (Path(cfg.data) / "index.json").exists():
        return Path(cfg.data), Path(cfg.val_data) if cfg.val_data else None
    budget = f"-{cfg.data_tokens}" if cfg.data_tokens else ""
    content = source_fingerprint(cfg.data) or "remote"
    base = cache_dir() / "shards" / f"{_slug(cfg.data)}-{_slug(cfg.tokenizer)}{budget}-{content}"

    def work():
        if dist is not None and not dist.is_main:
            return
        prepare(cfg.data, cfg.tokenizer, base / "train", split="train", max_tokens=cfg.data_tokens,
                workers=cfg.data_workers, progress=cfg.progress, lock_wait=PREPARE_WAIT)
        if not cfg.val_data:
            val_budget = None if cfg.data_tokens is None else max(1, cfg.data_tokens // 100)
            prepare(cfg.data, cfg.tokenizer, base / "validation", split="validation", max_tokens=val_budget,
                    workers=cfg.data_workers, progress=cfg.progress, lock_wait=PREPARE_WAIT)

    _rank0_first(dist or Dist(), work)
    return base / "train", Path(cfg.val_data) if cfg.val_data else base / "validation"


@contextlib.contextmanager
def _no_hf_bars():
    """transformers' progress bars off for the duration, then as they were: ``save_pretrained`` of a
    transformers model (the Llama baseline) draws a "Writing model shards" bar inside the training cell."""
    if "transformers" not in sys.modules:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    was_on, hub_was_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
        if hub_was_off:
            disable_progress_bars()


class Trainer:
    """Train ``model`` (None: built from ``config.model``) on ``data``: None (``config.data``, prepared if it
    is a source), a shard directory, or a :class:`~ssmkit.data.TokenLoader` matching the config. ``val_data``:
    a shard directory (None: ``config.val_data`` or the source's validation split). ``resume=True``
    continues from the latest checkpoint in ``config.out_dir``. ``name``: the model's name on the progress
    bar and in messages (default: the preset's name when the model is built from the config, else the
    model's class name)."""

    def __init__(self, model: nn.Module | None = None, config: TrainConfig | None = None, data=None,
                 val_data=None, callbacks=(), resume: bool = False, name: str | None = None):
        cfg = self.config = config or TrainConfig()
        self.dist = d = setup(cfg.strategy, cfg.device)
        self.grad_accum = cfg.grad_accum(d.world_size)
        if d.device.type == "cpu":
            reuse_freed_memory()                                     # 1.7x on CPU: see ssmkit.env
        torch.manual_seed(cfg.seed + d.rank)
        if data is None:
            data, default_val = prepare_data(cfg, d)
            val_data = val_data or default_val
        elif val_data is None:
            val_data = cfg.val_data
        if isinstance(data, TokenLoader):
            mine = dict(seq_len=cfg.seq_len, batch_size=cfg.micro_batch, rank=d.rank, world_size=d.world_size)
            theirs = {k: getattr(data, k) for k in mine}
            if theirs != mine:
                raise ValueError(f"the TokenLoader given has {theirs}; this run needs {mine} (seq_len, "
                                 "micro_batch, rank and world size of the config): pass its shard directory "
                                 "instead")
            self.loader = data
        else:
            self.loader = _rank0_first(d, lambda: TokenLoader(data, cfg.seq_len, cfg.micro_batch, d.rank,
                                                              d.world_size, seed=cfg.seed))   # verified once
        self.val_loader = None
        if val_data is not None and cfg.eval_batches:
            self.val_loader = _rank0_first(d, lambda: TokenLoader(val_data, cfg.seq_len, cfg.micro_batch,
                                                                  d.rank, d.world_size, seed=0))
        vocab = self.loader.index["vocab_size"]
        self.name = name or (cfg.model if model is None else type(model).__name__)
        if model is None:
            torch.manual_seed(cfg.seed)                              # the same initial weights on every rank
            model = build_model(cfg.model_config(vocab))
        rows = getattr(model.config, "padded_vocab_size", None) or getattr(model.config, "vocab_size", vocab)
        if rows < vocab:
            raise ValueError(f"the model has {rows} vocabulary rows but the data's tokenizer "
                             f"{self.loader.index['tokenizer']!r} has {vocab} tokens")
        self.model = model.to(d.device)                              # fp32 master weights
        if cfg.activation_checkpointing or cfg.loss_chunk_size:
            _long_context(self.model, cfg)
        self.module = wrap(self.model, cfg.strategy, cfg.precision, d)
        if cfg.compile:
            self.module = torch.compile(self.module)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scaler = torch.amp.GradScaler(d.device.type, enabled=cfg.precision == "fp16")
        self.callbacks = list(callbacks)
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.step = self.tokens = self.skipped = self.bad_in_row = 0
        self.scaler_skipped = 0                                      # fp16: steps the grad scaler skipped
        self.history: list[dict] = []
        self.flops_per_token = flops_per_token(self.model, cfg.seq_len)
        self.peak_flops = peak_flops(d.device, cfg.precision)
        self._wandb = None
        self.run_dir = RunDir(self.out_dir, d)                       # locked, claimed, recovered: see rundir
        self._committed = False                                      # this run has a checkpoint on disk
        with self.run_dir.hold():
            self.run_dir.claim(resume, cfg.overwrite)
            try:
                if resume:
                    self._committed = self.resume()
                if d.is_main:                                          # only once the run has (re)started
                    write_atomically(self.out_dir / "config.yaml", cfg.to_yaml())
            except Exception:
                self.run_dir.restore_previous("this run failed to start")
                raise
            d.barrier()

    # --- pieces of a step -----------------------------------------------------------------------
    def _autocast_dtype(self) -> torch.dtype | None:
        """The dtype forward passes autocast to; None: no autocast (fp32, or FSDP, which casts through its
        MixedPrecisionPolicy)."""
        if self.config.precision == "fp32" or self.config.strategy == "fsdp" and self.dist.world_size > 1:
            return None
        return DTYPES[self.config.precision]

    def _autocast(self):
        dtype = self._autocast_dtype()
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=dtype)

    def _sync(self, last: bool):
        """Reduce gradients across ranks only on the last micro-batch of a step."""
        if hasattr(self.module, "no_sync") and not last:
            return self.module.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):       # FSDP2
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _batches(self, loader: TokenLoader):
        for x, y in loader:
            yield x.to(self.dist.device, non_blocking=True), y.to(self.dist.device, non_blocking=True)

    # --- the loop -------------------------------------------------------------------------------
    def fit(self, until: int | None = None) -> list[dict]:
        """Train to ``config.max_steps`` (or ``until``: stop early, e.g. to look at a notebook's plot, with
        a checkpoint; the schedule is still the full run's). Returns the records of this call. With no step
        left to take (a finished run resumed) it says so in one line and returns [] at once: no evaluation,
        no checkpoint, no callbacks."""
        cfg, d = self.config, self.dist
        total = cfg.total_steps()
        stop = total if until is None else min(until, total)
        first_record = len(self.history)
        if self.step >= stop:                  # a finished run resumed: no evaluation or checkpoint again
            if d.is_main:
                print(f"{self.name}: nothing to train, already at step {self.step} of "
                      + (f"{total} (the run is finished; raise max_steps or max_tokens to go on)"
                         if stop == total else f"{stop} (until={until})"), flush=True)
            return []
        self._start_tracking()
        bar = tqdm_bar(total=stop, initial=self.step, unit="step", disable=not (d.is_main and cfg.progress),
                       desc=f"train {self.name}", dynamic_ncols=True)
        with self.run_dir.hold():                                    # no other run writes out_dir meanwhile
            self.run_dir.check_owner()
            try:
                self._loop(bar, stop, total)
            except Exception:                                    # a failed replacement gives back the old run
                if not self._committed:
                    self.run_dir.restore_previous(
                        "the run that replaced it failed before its first checkpoint")
                raise
            finally:
                bar.close()
        for cb in self.callbacks:
            getattr(cb, "on_end", lambda t: None)(self)
        if self._wandb is not None and self.step == total:
            self._wandb.finish()
        return self.history[first_record:]

    def _loop(self, bar, stop: int, total: int):
        """Steps up to ``stop``, then a final evaluation and checkpoint (the loop of the module docstring)."""
        cfg, d = self.config, self.dist
        batches = self._batches(self.loader)
        if self.step == 0 and cfg.eval_every and self.val_loader is not None:
            self.evaluate()
        window, t0, tokens0 = [], time.perf_counter(), self.tokens
        while self.step < stop:
            lr = lr_at(self.step, cfg, total)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=d.device)
            for micro in range(self.grad_accum):
                x, y = next(batches)
                with self._sync(micro == self.grad_accum - 1), self._autocast():
                    loss = lm_loss(self.module, x, y, self.config.loss_chunk_size)
                self.scaler.scale(loss / self.grad_accum).backward()
                loss_sum += loss.detach()
            loss = d.all_reduce_mean(loss_sum / self.grad_accum).item()
            self.step += 1
            self.tokens += cfg.batch_tokens
            bar.update(1)
            if not math.isfinite(loss):
                self._skip(loss)
                continue
            self.bad_in_row = 0
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or float("inf"))
            scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if scale is not None and self.scaler.get_scale() < scale:
                self.scaler_skipped += 1              # inf/NaN gradients: no optimizer step, the scale halved
            self.optimizer.zero_grad(set_to_none=True)
            window.append((loss, float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)))
            if self.step % cfg.log_every == 0 or self.step == stop:
                elapsed = time.perf_counter() - t0
                record = self._log_record(window, lr, (self.tokens - tokens0) / max(elapsed, 1e-9))
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}",     # shown at the next redraw
                                tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
                window = []
            if not window:
                t0, tokens0 = time.perf_counter(), self.tokens
            pause = time.perf_counter()                               # rates exclude eval and checkpoints
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step != stop:
                self.evaluate()
            if cfg.ckpt_every and self.step % cfg.ckpt_every == 0 and self.step != stop:
                self.save_checkpoint()
            t0 += time.perf_counter() - pause
        if self.val_loader is not None:
            self.evaluate()
        self.save_checkpoint()

    def _skip(self, loss: float):
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        self.bad_in_row += 1
        self._emit({"kind": "skip", "step": self.step, "tokens": self.tokens, "loss": loss,
                    "skipped": self.skipped})
        if self.dist.is_main:
            warnings.warn(f"step {self.step}: loss is {loss}; step skipped ({self.bad_in_row} in a row)",
                          stacklevel=2)
        if self.bad_in_row >= self.config.max_bad_steps:
            raise TrainingError(f"the loss was not finite for {self.bad_in_row} steps in a row (up to step "
                                f"{self.step}); lower lr (now {self.config.lr}), use bf16 instead of fp16, "
                                f"or raise max_bad_steps ({self.config.max_bad_steps})")

    def _log_record(self, window, lr: float, tokens_per_s: float) -> dict:
        record = {"kind": "train", "step": self.step, "tokens": self.tokens,
                  "loss": sum(w[0] for w in window) / len(window), "lr": lr,
                  "grad_norm": sum(w[1] for w in window) / len(window), "tokens_per_s": tokens_per_s,
                  "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.dist.world_size),
                  "peak_mem_mb": peak_memory_mb(self.dist.device), "skipped": self.skipped}
        if self.scaler.is_enabled():                                 # fp16: the loss scale and its skips
            record.update(grad_scale=self.scaler.get_scale(), scaler_skipped=self.scaler_skipped)
        if self.dist.world_size > 1:                                 # every rank's, rank order (a collective)
            record.update(rank_peak_mem_mb=gather_floats(record["peak_mem_mb"], self.dist.device),
                          rank_state_mb=gather_floats(held_mb(self.model, self.optimizer), self.dist.device))
        self._emit(record)
        for cb in self.callbacks:
            getattr(cb, "on_log", lambda t, r: None)(self, record)
        return record

    def evaluate(self) -> dict | None:
        """Mean validation loss over the first ``eval_batches`` micro-batches of the validation shards (all
        ranks together, so any world size evaluates the same windows): :func:`ssmkit.eval.perplexity`."""
        if self.val_loader is None:
            return None
        result = perplexity(self.module, self.val_loader, self.config.eval_batches, device=self.dist.device,
                            dtype=self._autocast_dtype(), reduce=self.dist.all_reduce_mean)
        record = {"kind": "eval", "step": self.step, "tokens": self.tokens, "val_loss": result["loss"],
                  "val_ppl": result["ppl"]}
        self._emit(record)
        for cb in self.callbacks:
            getattr(cb, "on_eval", lambda t, r: None)(self, record)
        return record

    # --- records, tracking, checkpoints ---------------------------------------------------------
    def _emit(self, record: dict):
        self.history.append(record)
        if self.dist.is_main:
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            if self._wandb is not None:
                values = {k: v for k, v in record.items() if k not in ("kind", "step") and v is not None}
                self._wandb.log(values, step=record["step"])

    def _start_tracking(self):
        if self.config.tracking != "wandb" or not self.dist.is_main or self._wandb is not None:
            return
        try:
            import wandb
        except ImportError:
            warnings.warn("tracking=wandb but wandb is not installed (pip install wandb); training goes on "
                          "without it", stacklevel=2)
            return
        os.environ.setdefault("WANDB_MODE", "offline")
        self._wandb = wandb.init(project=self.config.wandb_project, config=self.config.to_dict(),
                                 dir=str(self.out_dir), resume="allow")

    def save_checkpoint(self) -> Path:
        state = {"step": self.step, "tokens": self.tokens, "skipped": self.skipped,
                 "scaler_skipped": self.scaler_skipped,
                 "bad_in_row": self.bad_in_row, "loader": self.loader.state_dict(),
                 "scaler": self.scaler.state_dict(),
                 "world_size": self.dist.world_size, "config": self.config.to_dict(),
                 "tokenizer": self.loader.index.get("tokenizer")}    # its files go into model/
        with self.run_dir.hold(), _no_hf_bars():                   # no "Writing model shards" bar
            path = checkpoint.save(self.ckpt_dir, self.step, self.model, self.optimizer, state, self.dist,
                                   self.config.keep_last)
            self._committed = True
            self.run_dir.committed()                                 # an overwritten run can go now
        return path

    def resume(self) -> bool:
        """Continue from the latest checkpoint in ``out_dir``; False (and a fresh start) when there is
        none."""
        path = checkpoint.latest(self.ckpt_dir)
        if path is None:
            if self.dist.is_main:
                print(f"nothing to resume in {self.out_dir}: it holds no checkpoint; starting a new run "
                      "from step 0", flush=True)
            return False
        checkpoint.verify_everywhere(path, self.dist)                  # before anything of it is read
        saved_config = read_json(path / "trainer.json", "checkpoint state").get("config")
        checkpoint.check_model(path, self.model, saved_config, self.config.to_dict())
        state = checkpoint.load(path, self.model, self.optimizer, self.dist, verified=True)
        self.step, self.tokens, self.skipped = state["step"], state["tokens"], state["skipped"]
        self.bad_in_row = state["bad_in_row"]
        self.scaler.load_state_dict(state["scaler"])
        self.scaler_skipped = state.get("scaler_skipped", 0)       # absent from older checkpoints
        saved = state["loader"]
        mine = self.loader.state_dict()
        for key in ("seed", "seq_len", "total_tokens"):
            if saved[key] != mine[key]:
                raise ValueError(f"cannot resume {path}: its data loader had {key}={saved[key]!r}, this run "
                                 f"has {mine[key]!r} (same data, seq_len and seed are needed)")
        windows = saved["step"] * saved["batch_size"] * saved["world_size"]   # consumed this epoch, all ranks
        per_step = self.loader.batch_size * self.loader.world_size
        if windows % per_step:
            raise ValueError(f"cannot resume {path}: {windows} windows consumed is not a multiple of "
                             f"micro_batch x world_size = {per_step}")
        self.loader.epoch, self.loader.step = saved["epoch"], windows // per_step
        if self.dist.is_main:
            self._truncate_metrics(self.step)
            print(f"resumed from {path} (step {self.step}, {self.tokens:,} tokens)")
        return True

    def _truncate_metrics(self, step: int):
        """Drop metrics lines written after the checkpoint by the run that was interrupted (and a line a
        kill tore in half)."""
        path = self.out_dir / "metrics.jsonl"
        if path.exists():
            keep, torn = [], 0
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                    if record["step"] <= step:
                        keep.append(record)
                except (ValueError, KeyError, TypeError):
                    torn += 1
            if torn:
                warnings.warn(f"{path}: dropped {torn} unreadable line(s) (a run killed while writing)",
                              stacklevel=2)
            write_atomically(path, "".join(json.dumps(r) + "\n" for r in keep))
            self.history = keep
