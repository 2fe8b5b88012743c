"""``Trainer(model, config, data).fit()``: the plan's training loop, on one CPU or many GPUs.

``Trainer(...)`` builds (data, model, optimizer) and touches nothing in ``out_dir``;
``trainer.resume()`` continues the run ``out_dir`` holds from its latest checkpoint; the first
``fit()`` (or ``save_checkpoint()``) of a Trainer not resumed starts a new run there (refused when
``out_dir`` holds one, unless ``overwrite``). Both claim ``out_dir`` first: :mod:`.rundir`.

One optimizer step (global batch B tokens = micro_batch x grad_accum x world_size x seq_len):

    for each of grad_accum micro-batches (x, y):        # y = x shifted by one (the loader's labels)
        loss = CE(model(x).logits, y) / grad_accum       # bf16/fp16 autocast, fp32 master weights
                                                         # (SFT: (x, y, seq_idx), model(x, seq_idx);
                                                         # experts: + coef · router aux loss)
        loss.backward()                                  # DDP/FSDP reduce on the last one only
    if the loss is not finite: skip the step (counted; stop after max_bad_steps in a row)
    clip the global grad norm to grad_clip; AdamW step at lr_at(step)
    fp16: the grad scaler skips a step whose gradients overflow and halves its scale (counted)

Every ``log_every`` steps a line goes to ``out_dir/metrics.jsonl`` (and the progress bar, callbacks,
wandb; with fp16 ``grad_scale`` and ``scaler_skipped``, under torchrun every rank's
``rank_peak_mem_mb`` and ``rank_state_mb``); every ``eval_every`` steps the validation loss; every
``ckpt_every`` steps a checkpoint. Losses, perplexity, FLOPs/MFU and peak memory come from
:mod:`ssmkit.eval`.
Ctrl-C (Jupyter's stop button) stops at the end of the step in one line: :mod:`.stopping`.
Callbacks are objects with any of ``on_log(trainer, record)``, ``on_eval(trainer, record)``,
``on_end(trainer)``.

What is trained comes from :mod:`.model_setup` (a preset, or ``base`` fine-tuned whole or with LoRA,
bf16-pure), the data from :mod:`.data` (token shards, or SFT samples whose batches carry ``seq_idx``
so the scan restarts at each packed sample). A LoRA run checkpoints only its adapter and the
adapter's optimizer state, and records a fingerprint of its base, so resuming on another base is
refused.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from ..data import TokenLoader
from ..env import release_freed_memory, reuse_freed_memory
from ..eval import flops_per_token, lm_loss, mfu, peak_flops, peak_memory_mb, perplexity
from ..io import Stopped, read_json, tqdm_bar, write_atomically
from ..ops.compiled import check_setting as check_compile_setting
from . import checkpoint
from .config import TrainConfig
from .data import (
    loader_index,
    make_loader,
    make_val,
    prepare_data,
    resume_keys,
    sft_val_loss,
)
from .distributed import DTYPES, gather_floats, held_mb, setup, wrap
from .load import base_location
from .model_setup import base_module, build_run_model, is_lora, long_context
from .optim import build_optimizer, lr_at
from .rundir import RunDir
from .stopping import StopAtStepEnd, stopped

__all__ = ["Trainer", "TrainingError"]


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss stayed non-finite for max_bad_steps steps in a row)."""


class Trainer:
    """Train ``model`` (None: built from ``config.model``, or ``config.base`` fine-tuned, with LoRA
    when ``config.lora``) on ``data``: None (``config.data``, prepared if it is a source), a shard
    or SFT directory, or a :class:`~ssmkit.data.TokenLoader` / :class:`~ssmkit.data.SFTLoader`
    matching the config. ``val_data``: a directory of the same kind (None: ``config.val_data`` or
    the source's validation split). ``name``: the model's name on the progress bar and in messages
    (default: the preset's name when the model is built from the config, else the model's class
    name). It only builds: :meth:`resume` continues the run in ``config.out_dir``, :meth:`fit`
    trains."""

    def __init__(
        self,
        model: nn.Module | None = None,
        config: TrainConfig | None = None,
        data=None,
        val_data=None,
        callbacks=(),
        name: str | None = None,
    ):
        cfg = self.config = config or TrainConfig()
        check_compile_setting()  # SSMKIT_COMPILE_SCAN: now, not at the first step
        self.dist = d = setup(cfg.strategy, cfg.device)
        self.grad_accum = cfg.grad_accum(d.world_size)
        if d.device.type == "cpu":
            reuse_freed_memory()  # no page faults for each step's large blocks: see ssmkit.env
        torch.manual_seed(cfg.seed + d.rank)
        if data is None:
            data, default_val = prepare_data(cfg, d)
            val_data = val_data or default_val
        elif val_data is None:
            val_data = cfg.val_data
        if isinstance(data, TokenLoader) or hasattr(data, "windows"):  # a TokenLoader, an SFTLoader
            mine = dict(
                seq_len=cfg.seq_len,
                batch_size=cfg.micro_batch,
                rank=d.rank,
                world_size=d.world_size,
            )
            theirs = {k: getattr(data, k) for k in mine}
            if theirs != mine:
                raise ValueError(
                    f"the {type(data).__name__} given has {theirs}; this run needs {mine} "
                    "(seq_len, micro_batch, rank and world size of the config): pass its "
                    "directory instead"
                )
            self.loader = data
        else:
            self.loader = make_loader(data, cfg, d, seed=cfg.seed)  # verified once
        self.sft = hasattr(self.loader, "windows")  # batches (x, y, seq_idx): packed SFT samples
        self.val_loader = None
        if val_data is not None and cfg.eval_batches:
            self.val_loader = make_val(val_data, cfg, d, self.sft)
        index = loader_index(self.loader)
        vocab = index["vocab_size"]
        self.name = name or (
            type(model).__name__
            if model is not None
            else Path(cfg.base).name or cfg.base
            if cfg.base is not None
            else cfg.model
        )
        # a relative base is read from this directory now; recorded absolute, the run loads from
        # any directory later (generate / eval / convert)
        self.base_path = base_location(cfg.base) if cfg.base is not None else None
        model, self.base_fingerprint = build_run_model(cfg, vocab, model)
        self.lora = is_lora(model)  # checkpoints hold the adapter only
        inner = base_module(model)
        rows = getattr(inner.config, "padded_vocab_size", None) or getattr(
            inner.config, "vocab_size", vocab
        )
        if rows < vocab:
            raise ValueError(
                f"the model has {rows} vocabulary rows but the data's tokenizer "
                f"{index['tokenizer']!r} has {vocab} tokens"
            )
        self.model = model.to(d.device)  # fp32 master weights (but bf16-pure)
        # a mixture of experts trains its router with the load-balancing loss: the model's own loss
        self.moe = bool(getattr(inner.config, "moe_layers", None))
        self.loss_chunk = cfg.loss_chunk_size
        if cfg.activation_checkpointing or cfg.loss_chunk_size:
            self.loss_chunk = long_context(inner, cfg)
        self.module = wrap(self.model, cfg.strategy, cfg.precision, d)
        if cfg.compile:
            self.module = torch.compile(self.module)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scaler = torch.amp.GradScaler(d.device.type, enabled=cfg.precision == "fp16")
        self.callbacks = list(callbacks)
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.step = self.tokens = self.skipped = self.bad_in_row = 0
        self.scaler_skipped = 0  # fp16: steps the grad scaler skipped
        self.history: list[dict] = []
        self.flops_per_token = flops_per_token(self.model, cfg.seq_len)
        self.peak_flops = peak_flops(d.device, cfg.precision)
        self._wandb = None
        self.run_dir = RunDir(self.out_dir, d)  # claimed by resume() or the first fit()
        self._started = False  # out_dir is claimed for this run
        self._committed = False  # this run has a checkpoint on disk
        self._stop = StopAtStepEnd(enabled=False)  # fit()'s: Ctrl-C asked to stop

    # --- pieces of a step -----------------------------------------------------------------------
    def _autocast_dtype(self) -> torch.dtype | None:
        """The dtype forward passes autocast to; None: no autocast (fp32; bf16-pure, whose weights
        are bf16 already; FSDP, which casts through its MixedPrecisionPolicy)."""
        if (
            self.config.precision in ("fp32", "bf16-pure")
            or self.config.strategy == "fsdp"
            and self.dist.world_size > 1
        ):
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
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _batches(self, loader):
        """The loader's batches on the device: (x, y), or (x, y, seq_idx) from an SFTLoader."""
        for batch in loader:
            yield tuple(t.to(self.dist.device, non_blocking=True) for t in batch)

    def _loss(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean loss of one micro-batch: the next-token loss (:func:`ssmkit.eval.lm_loss`), or for
        SFT the loss on the labelled (completion) tokens with ``seq_idx``, so the scan restarts at
        each sample. A mixture of experts computes its loss itself, the router's load-balancing
        loss included (:mod:`ssmkit.models.moe`); that aux loss is the second value (else None)."""
        if len(batch) == 2:
            if not self.moe:
                return lm_loss(self.module, *batch, self.loss_chunk), None
            x, y = batch
            out = self.module(x, labels=y, shift_labels=False, loss_chunk_size=self.loss_chunk)
        else:
            x, y, seq_idx = batch
            out = self.module(x, labels=y, shift_labels=False, seq_idx=seq_idx)
        return out.loss, getattr(out, "aux_loss", None)

    # --- the loop -------------------------------------------------------------------------------
    def fit(self, until: int | None = None) -> list[dict]:
        """Train to ``config.max_steps`` (or ``until``: stop early, e.g. to look at a notebook's
        plot, with a checkpoint; the schedule is still the full run's). Returns the records of this
        call. With no step left to take (a finished run resumed) it says so in one line and returns
        [] at once: no evaluation, no checkpoint, no callbacks."""
        cfg, d = self.config, self.dist
        self._start()
        total = cfg.total_steps()
        stop = total if until is None else min(until, total)
        first_record = len(self.history)
        if self.step >= stop:  # a finished run resumed: no evaluation or checkpoint again
            if d.is_main:
                print(
                    f"{self.name}: nothing to train, already at step {self.step} of "
                    + (
                        f"{total} (the run is finished; raise max_steps or max_tokens to go on)"
                        if stop == total
                        else f"{stop} (until={until})"
                    ),
                    flush=True,
                )
            return []
        self._start_tracking()
        bar = tqdm_bar(
            total=stop,
            initial=self.step,
            unit="step",
            disable=not (d.is_main and cfg.progress),
            desc=f"train {self.name}",
            dynamic_ncols=True,
        )
        # Ctrl-C: stop at the step's end, in one line (.stopping)
        self._stop = StopAtStepEnd(enabled=d.world_size == 1)
        with self.run_dir.hold(), self._stop:  # no other run writes out_dir meanwhile
            self.run_dir.check_owner()
            try:
                self._loop(bar, stop, total)
            except KeyboardInterrupt as exc:
                if isinstance(exc, Stopped):  # at a step's end: said already
                    raise
                raise stopped(self, total, False, getattr(exc, "signum", 2)) from None
            except Exception:  # a failed replacement gives back the old run
                if not self._committed:
                    self.run_dir.restore_previous(
                        "the run that replaced it failed before its first checkpoint"
                    )
                raise
            finally:
                bar.close()
                if d.device.type == "cpu":  # the steps' freed activations back to the OS
                    release_freed_memory()  # (kept in the process while training: ssmkit.env)
        for cb in self.callbacks:
            getattr(cb, "on_end", lambda t: None)(self)
        if self._wandb is not None and self.step == total:
            self._wandb.finish()
        return self.history[first_record:]

    def _loop(self, bar, stop: int, total: int):
        """Steps up to ``stop``, then a final evaluation and checkpoint (the loop of the module
        docstring)."""
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
            aux_sum = torch.zeros((), device=d.device)
            for micro in range(self.grad_accum):
                batch = next(batches)
                with self._sync(micro == self.grad_accum - 1), self._autocast():
                    loss, aux = self._loss(batch)
                self.scaler.scale(loss / self.grad_accum).backward()
                loss_sum += loss.detach()
                if aux is not None:
                    aux_sum += aux.detach()
            loss = d.all_reduce_mean(loss_sum / self.grad_accum).item()
            aux = d.all_reduce_mean(aux_sum / self.grad_accum).item() if self.moe else None
            self.step += 1
            self.tokens += cfg.batch_tokens
            bar.update(1)
            if not math.isfinite(loss):
                self._skip(loss)
                continue
            self.bad_in_row = 0
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), cfg.grad_clip or float("inf")
            )
            scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if scale is not None and self.scaler.get_scale() < scale:
                self.scaler_skipped += 1  # inf/NaN gradients: no optimizer step, the scale halved
            self.optimizer.zero_grad(set_to_none=True)
            window.append(
                (loss, float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm), aux)
            )
            if self.step % cfg.log_every == 0 or self.step == stop:
                elapsed = time.perf_counter() - t0
                record = self._log_record(window, lr, (self.tokens - tokens0) / max(elapsed, 1e-9))
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    lr=f"{lr:.2e}",  # shown at the next redraw
                    tok_s=f"{record['tokens_per_s']:,.0f}",
                    refresh=False,
                )
                window = []
            if not window:
                t0, tokens0 = time.perf_counter(), self.tokens
            pause = time.perf_counter()  # rates exclude eval and checkpoints
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step != stop:
                self.evaluate()
            if cfg.ckpt_every and self.step % cfg.ckpt_every == 0 and self.step != stop:
                self.save_checkpoint()
            t0 += time.perf_counter() - pause
            if self._stop.requested and self.step != stop:  # Ctrl-C during this step
                raise stopped(self, total, True)
        if self.val_loader is not None:
            self.evaluate()
        self.save_checkpoint()
        if self._stop.requested:  # Ctrl-C during the last step or the final checkpoint
            raise stopped(self, total, True)

    def _skip(self, loss: float):
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        self.bad_in_row += 1
        self._emit(
            {
                "kind": "skip",
                "step": self.step,
                "tokens": self.tokens,
                "loss": loss,
                "skipped": self.skipped,
            }
        )
        if self.dist.is_main:
            warnings.warn(
                f"step {self.step}: loss is {loss}; step skipped ({self.bad_in_row} in a row)",
                stacklevel=2,
            )
        if self.bad_in_row >= self.config.max_bad_steps:
            raise TrainingError(
                f"the loss was not finite for {self.bad_in_row} steps in a row (up to step "
                f"{self.step}); lower lr (now {self.config.lr}), use bf16 instead of fp16, "
                f"or raise max_bad_steps ({self.config.max_bad_steps})"
            )

    def _log_record(self, window, lr: float, tokens_per_s: float) -> dict:
        record = {
            "kind": "train",
            "step": self.step,
            "tokens": self.tokens,
            "loss": sum(w[0] for w in window) / len(window),
            "lr": lr,
            "grad_norm": sum(w[1] for w in window) / len(window),
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.dist.world_size),
            "peak_mem_mb": peak_memory_mb(self.dist.device),
            "skipped": self.skipped,
        }
        if self.moe:  # the router's load-balancing loss (its coefficient times it is in "loss")
            record["aux_loss"] = sum(w[2] for w in window) / len(window)
        if self.scaler.is_enabled():  # fp16: the loss scale and its skips
            record.update(grad_scale=self.scaler.get_scale(), scaler_skipped=self.scaler_skipped)
        if self.dist.world_size > 1:  # every rank's, rank order (a collective)
            record.update(
                rank_peak_mem_mb=gather_floats(record["peak_mem_mb"], self.dist.device),
                rank_state_mb=gather_floats(held_mb(self.model, self.optimizer), self.dist.device),
            )
        self._emit(record)
        for cb in self.callbacks:
            getattr(cb, "on_log", lambda t, r: None)(self, record)
        return record

    def evaluate(self) -> dict | None:
        """Mean validation loss over the first ``eval_batches`` micro-batches of the validation
        shards (all ranks together, so any world size evaluates the same windows):
        :func:`ssmkit.eval.perplexity`; for SFT the held-out completion loss of eval_batches x
        micro_batch samples (:func:`.sft_val_loss`). Called before the run has started (no fit or
        resume yet), it only returns the record: ``out_dir`` is not this Trainer's to write yet."""
        if self.val_loader is None:
            return None
        if self.sft:  # the held-out completion loss, samples one per row
            result = sft_val_loss(
                self.module, self.val_loader, self.config, self.dist.device, self._autocast_dtype()
            )
        else:
            result = perplexity(
                self.module,
                self.val_loader,
                self.config.eval_batches,
                device=self.dist.device,
                dtype=self._autocast_dtype(),
                reduce=self.dist.all_reduce_mean,
            )
        record = {
            "kind": "eval",
            "step": self.step,
            "tokens": self.tokens,
            "val_loss": result["loss"],
            "val_ppl": result["ppl"],
        }
        self._emit(record)
        for cb in self.callbacks:
            getattr(cb, "on_eval", lambda t, r: None)(self, record)
        return record

    # --- records, tracking, checkpoints ---------------------------------------------------------
    def _emit(self, record: dict):
        self.history.append(record)
        if self.dist.is_main and self._started:
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            if self._wandb is not None:
                values = {
                    k: v for k, v in record.items() if k not in ("kind", "step") and v is not None
                }
                self._wandb.log(values, step=record["step"])

    def _start_tracking(self):
        if self.config.tracking != "wandb" or not self.dist.is_main or self._wandb is not None:
            return
        try:
            import wandb
        except ImportError:
            warnings.warn(
                "tracking=wandb but wandb is not installed (pip install wandb); training goes on "
                "without it",
                stacklevel=2,
            )
            return
        os.environ.setdefault("WANDB_MODE", "offline")
        self._wandb = wandb.init(
            project=self.config.wandb_project,
            config=self.config.to_dict(),
            dir=str(self.out_dir),
            resume="allow",
        )

    def save_checkpoint(self) -> Path:
        state = {
            "step": self.step,
            "tokens": self.tokens,
            "skipped": self.skipped,
            "scaler_skipped": self.scaler_skipped,
            "bad_in_row": self.bad_in_row,
            "loader": self.loader.state_dict(),
            "scaler": self.scaler.state_dict(),
            "world_size": self.dist.world_size,
            "config": self.config.to_dict(),
            "tokenizer": loader_index(self.loader).get("tokenizer"),  # its files go into model/
            "base_fingerprint": self.base_fingerprint,
            "base_path": self.base_path,
        }  # a LoRA run's base: its fingerprint and absolute location (None: a hub id, or no base)
        self._start()
        with self.run_dir.hold():
            path = checkpoint.save(
                self.ckpt_dir,
                self.step,
                self.model,
                self.optimizer,
                state,
                self.dist,
                self.config.keep_last,
                adapter_only=self.lora,
            )
            self._committed = True
            self.run_dir.committed()  # an overwritten run can go now
        return path

    # --- starting: a new run, or the one out_dir holds ---------------------------------------
    @contextlib.contextmanager
    def _claimed(self, resume: bool):
        """Make ``out_dir`` this run's for the block, which starts the run (rank 0 holds the lock;
        :meth:`.RunDir.claim` recovers what a crash left, then resumes, replaces (``overwrite``) or
        refuses a run ``out_dir`` holds). ``config.yaml`` is written when the block succeeds; when
        it fails, the run ``out_dir`` held before is put back. Once per Trainer."""
        if self._started:
            raise ValueError(
                f"this Trainer has already started its run in {self.out_dir}: "
                "resume() comes before the first fit(); to resume again, create a new "
                "Trainer"
            )
        with self.run_dir.hold():
            self.run_dir.claim(resume, self.config.overwrite)
            try:
                yield
                if self.dist.is_main:  # only once the run has (re)started
                    write_atomically(self.out_dir / "config.yaml", self.config.to_yaml())
            except Exception:
                self.run_dir.restore_previous("this run failed to start")
                raise
            self._started = True
            self.dist.barrier()

    def _start(self):
        """A Trainer not resumed starts a new run in ``out_dir`` when it first trains or saves."""
        if not self._started:
            with self._claimed(resume=False):
                pass  # a new run: nothing to load

    def resume(self) -> bool:
        """Continue the run in ``out_dir`` from its latest checkpoint, before the first :meth:`fit`;
        returns whether it did (False, said in one line: no checkpoint, so a new run from step 0).

        In order, nothing of this Trainer changed until the checks pass: claim ``out_dir``; find the
        latest complete checkpoint; verify every file against its manifest (rank 0; every rank
        agrees); refuse a model whose tensors differ from the saved ones (naming the config keys
        that changed), a LoRA adapter trained on another base, a data loader over other data; then
        load the model, optimizer and this rank's RNG state, the counters, the grad scaler and the
        loader's position, and drop the metrics the interrupted run wrote after the checkpoint."""
        d = self.dist
        with self._claimed(resume=True):
            path = checkpoint.latest(self.ckpt_dir)
            if path is None:
                if d.is_main:
                    print(
                        f"nothing to resume in {self.out_dir}: it holds no checkpoint; "
                        "starting a new run from step 0",
                        flush=True,
                    )
                return False
            checkpoint.verify_everywhere(path, d)  # before anything of it is read
            saved = read_json(path / "trainer.json", "checkpoint state")
            checkpoint.check_model(
                path, self.model, saved.get("config"), self.config.to_dict(), adapter_only=self.lora
            )
            theirs = saved.get("base_fingerprint")
            if self.lora and theirs != self.base_fingerprint:
                raise ValueError(
                    f"cannot resume {path}: its LoRA adapter was trained on another "
                    f"base model (fingerprint {theirs}, this base "
                    f"{self.base_fingerprint}); set base to the checkpoint the run "
                    "started from"
                )
            position = self._loader_position(path, saved["loader"])
            checkpoint.load(
                path, self.model, self.optimizer, d, verified=True, adapter_only=self.lora
            )
            self.step, self.tokens, self.skipped = saved["step"], saved["tokens"], saved["skipped"]
            self.bad_in_row = saved["bad_in_row"]
            self.scaler.load_state_dict(saved["scaler"])
            self.scaler_skipped = saved.get("scaler_skipped", 0)  # absent from older checkpoints
            self.loader.epoch, self.loader.step = position
            if d.is_main:  # the lines written after the checkpoint, and a torn last line
                self.history = self.run_dir.truncate_metrics(self.step)
                print(f"resumed from {path} (step {self.step}, {self.tokens:,} tokens)")
        self._committed = True
        return True

    def _loader_position(self, path: Path, saved: dict) -> tuple[int, int]:
        """(epoch, step) of this run's loader that continue the saved loader's position (at any
        world size); ValueError when the saved loader read other data (seq_len, seed, ...)."""
        mine = self.loader.state_dict()
        for key in resume_keys(self.loader):
            if saved.get(key) != mine[key]:
                raise ValueError(
                    f"cannot resume {path}: its data loader had {key}={saved.get(key)!r}, this "
                    f"run has {mine[key]!r} (same data, seq_len and seed are needed)"
                )
        windows = (
            saved["step"] * saved["batch_size"] * saved["world_size"]
        )  # consumed this epoch, all ranks
        per_step = self.loader.batch_size * self.loader.world_size
        if windows % per_step:
            raise ValueError(
                f"cannot resume {path}: {windows} windows consumed is not a multiple of "
                f"micro_batch x world_size = {per_step}"
            )
        return saved["epoch"], windows // per_step
