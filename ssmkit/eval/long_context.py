"""Long context: what a sequence of L tokens costs to train on and to generate from, and how a model
trained at a short length scores at longer ones.

An SSM layer carries a fixed-size state, attention a key/value cache that grows with L, so the two
diverge as L grows:

    training step   Mamba O(L) time and memory      attention O(L²) time
                                                    (O(L) memory with flash / SDPA)
    generation      Mamba O(1) memory per sequence  attention O(L) memory (the KV cache)
                                                    and time per token

    run, extra_mb = peak_rss_mb(lambda: model(ids))               # MiB the call added at its peak
    run, seconds, extra_mb = measure_call(lambda: model(ids))     # the same, and fn's wall time
    train_step_cost(model, seq_len=4096)      # {"seq_len", "batch", "step_s", "tokens_per_s", ...}
    generation_cost(model, prompt_len=4096)   # {"prefill_s", "decode_tokens_per_s", "peak_mb", ...}
    crossover(lengths, mamba_rows, llama_rows)  # first length from which the SSM stays ahead
    length_extrapolation(model, "data/val", [256, 1024, 4096])    # loss and ppl at each length

Every function takes an ssmkit :class:`~ssmkit.models.MambaLM` (anything with ``allocate_cache``) or
a transformers causal LM (``LlamaForCausalLM``: ``labels=``, a ``DynamicCache``).
Memory is in MiB (2**20 bytes), times in seconds, rates in tokens per second (batch x positions).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import inspect
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .. import checks, env
from ..data import TokenLoader
from .loss import model_device, perplexity

MMAP_THRESHOLD = (
    128 * 1024
)  # bytes: larger blocks get their own mmap, returned to the OS when freed
_libc = None
_mmap_fixed: bool | None = None


def fix_mmap_threshold() -> bool:
    """The memory-measuring allocator setting (:func:`ssmkit.env.measure_freed_memory`: every block
    above 128 KiB gets its own ``mmap``, so RSS follows the live tensors); :func:`measure_call`
    applies it for the call it measures and restores the Trainer's setting afterwards if that was in
    effect. Returns False where there is no glibc (macOS, musl)."""
    global _libc, _mmap_fixed
    _mmap_fixed = env.measure_freed_memory(MMAP_THRESHOLD)
    if _mmap_fixed and _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return _mmap_fixed


def timing_allocator() -> bool:
    """The allocator setting calls are timed under: the Trainer's
    (:func:`ssmkit.env.reuse_freed_memory`, freed blocks reused without page faults), not the
    memory-measuring one, under which a model that allocates more also pays more page faults (timing
    there ranks models by their allocations as much as by their arithmetic). Returns whether the
    setting is in effect."""
    return env.reuse_freed_memory()


def _trim_heap():
    """glibc's ``malloc_trim(0)``: free pages inside the heaps go back to the OS (a no-op without
    glibc)."""
    if _mmap_fixed:
        _libc.malloc_trim(0)


def _release_free_memory():
    """``gc.collect()``, then glibc's ``malloc_trim(0)``: free pages inside the heaps go back to the
    OS, so a later allocation that reuses them shows up in RSS again (a no-op without glibc)."""
    gc.collect()
    _trim_heap()


def _status_mb(*fields: str) -> tuple[float, ...] | None:
    """Fields of /proc/self/status (kB) in MiB, or None without procfs."""
    try:
        with open("/proc/self/status") as f:
            found = {
                k: int(v.split()[0]) / 1024
                for k, _, v in (line.partition(":") for line in f)
                if k in fields
            }
        return tuple(found[k] for k in fields)
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _reset_rss_peak() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (VmHWM := VmRSS); False if not
    allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Peak:
    """The peak memory of what runs between ``start()`` and ``stop()``, over a baseline taken at
    ``start(baseline=True)``: CUDA allocator bytes on a CUDA device, else the resident set
    (Linux)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.base: float | None = None
        self.ok = self.cuda or (fix_mmap_threshold() and _status_mb("VmRSS") is not None)

    def start(self, baseline: bool = True):
        """Forget the peak so far; with ``baseline``, measure from the memory in use now."""
        _release_free_memory()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            now = torch.cuda.memory_allocated(self.device) / 2**20
        elif self.ok:
            self.ok = _reset_rss_peak()
            now = (_status_mb("VmRSS") or (0.0,))[0]
        if baseline and self.ok:
            self.base = now

    def stop(self) -> float | None:
        """MiB above the baseline at the peak since the last ``start()``; None where
        unmeasurable."""
        if not self.ok or self.base is None:
            return None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / 2**20 - self.base
        hwm = _status_mb("VmHWM")
        return None if hwm is None else max(0.0, hwm[0] - self.base)


def peak_rss_mb(
    fn: Callable[[], object], device: torch.device | str | None = None
) -> tuple[object, float | None]:
    """Run ``fn()``; return ``(its result, the extra peak memory in MiB while it ran)``.

    CPU (Linux): glibc's mmap threshold is fixed at 128 KiB (once, :func:`fix_mmap_threshold`) so
    freed tensors go back to the OS; then ``gc.collect()``, ``malloc_trim(0)`` (free heap pages back
    to the OS), the kernel's high-water mark is reset (``"5"`` to ``/proc/self/clear_refs``), and
    the result is ``VmHWM`` after minus ``VmRSS`` before, from ``/proc/self/status``. It counts
    every allocation of the process meanwhile (other threads' too), page granular; memory ``fn``
    frees before returning counts at its peak, memory it keeps counts too.
    CUDA device: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus
    ``memory_allocated`` before (tensors only, not the allocator's cache).
    None (``fn`` still runs): no procfs or a clear_refs that refuses the write (macOS, some
    sandboxes), or no glibc (musl), where RSS would not track freed tensors."""
    result, _, peak = measure_call(fn, device)
    return result, peak


def measure_call(
    fn: Callable[[], object], device: torch.device | str | None = None
) -> tuple[object, float, float | None]:
    """``(fn(), seconds, extra peak MiB)``: :func:`peak_rss_mb` plus the wall time of ``fn`` alone
    (the garbage collection and resets before it are not timed; a CUDA device is synchronized after
    it).

    On a CPU the time includes the page faults of the memory-measuring allocator setting
    (:func:`fix_mmap_threshold`): for a throughput, time calls with :func:`timed_call` under
    :func:`timing_allocator` instead. The Trainer's setting, if it was in effect, is restored
    afterwards."""
    restore = env.malloc_mode() == "reuse"
    peak = _Peak(device)
    try:
        peak.start()
        t0 = time.perf_counter()
        result = fn()
        if peak.cuda:
            torch.cuda.synchronize(peak.device)
        seconds = time.perf_counter() - t0
        return result, seconds, peak.stop()
    finally:
        if restore:
            env.reuse_freed_memory()


def timed_call(
    fn: Callable[[], object], device: torch.device | str | None = None
) -> tuple[object, float]:
    """``(fn(), seconds)``: the wall time of ``fn`` (a CUDA device synchronized before and after),
    under whatever allocator setting is in effect (:func:`timing_allocator` for the Trainer's)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - t0


def _is_ssmkit(model: nn.Module) -> bool:
    return hasattr(model, "allocate_cache")


def _random_ids(model: nn.Module, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """(batch, length) int64 token ids, uniform over the model's real vocabulary, on its device."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=g)
    return ids.to(model_device(model))


def make_train_step(
    model: nn.Module,
    seq_len: int,
    batch: int = 1,
    loss_chunk_size: int | None = None,
    seed: int = 0,
) -> Callable[[], float]:
    """One training step without an optimizer, as a callable returning the loss: gradients set to
    None, forward with ``labels=input_ids`` (random ids, (batch, seq_len)), backward. For
    round-robin timing (:func:`ssmkit.eval.time_round_robin`). ``loss_chunk_size``: passed to an
    ssmkit model (None: its own ``loss_chunk_size``); a transformers model has no such option."""
    ids = _random_ids(model, batch, seq_len, seed)
    kwargs = (
        {}
        if loss_chunk_size is None or not _is_ssmkit(model)
        else {"loss_chunk_size": loss_chunk_size}
    )
    if loss_chunk_size is not None and not _is_ssmkit(model):
        raise ValueError("loss_chunk_size is an ssmkit MambaLM option; this model has none")

    def step() -> float:
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, **kwargs).loss
        loss.backward()
        return loss.item()

    return step


def train_step_cost(
    model: nn.Module,
    seq_len: int,
    batch: int = 1,
    steps: int = 2,
    warmup: int = 1,
    loss_chunk_size: int | None = None,
    device: torch.device | str | None = None,
) -> dict:
    """Speed and peak memory of a training step (forward with labels + backward, no optimizer) at
    ``seq_len``: ``warmup`` untimed steps, ``steps`` timed ones under the Trainer's allocator
    setting (:func:`timing_allocator`), then one more step whose peak memory is measured
    (:func:`measure_call`; its time, slowed by the measuring setting's page faults, is not used).
    See :func:`make_train_step`.

    Returns ``{"seq_len", "batch", "step_s": median seconds per step, "tokens_per_s": batch *
    seq_len / step_s, "peak_mb": the extra peak MiB of a step (activations and gradients; None where
    unmeasurable, see :func:`peak_rss_mb`)}``. The model is left in train mode with gradients
    set."""
    seq_len, batch = (
        checks.integer(seq_len, "seq_len", minimum=2),
        checks.integer(batch, "batch", minimum=1),
    )
    steps, warmup = (
        checks.integer(steps, "steps", minimum=1),
        checks.integer(warmup, "warmup", minimum=0),
    )
    device = device if device is not None else model_device(model)
    step = make_train_step(model, seq_len, batch, loss_chunk_size)
    timing_allocator()
    for _ in range(warmup):
        step()
    seconds = [timed_call(step, device)[1] for _ in range(steps)]
    model.zero_grad(set_to_none=True)  # the step's gradients count in its peak
    _, _, peak = measure_call(step, device)
    step_s = statistics.median(seconds)
    return {
        "seq_len": seq_len,
        "batch": batch,
        "step_s": step_s,
        "tokens_per_s": batch * seq_len / step_s,
        "peak_mb": peak,
    }


def cache_nbytes(cache) -> int:
    """Bytes held by a generation cache: ssmkit's ``InferenceCache`` (``nbytes()``), a transformers
    ``Cache`` (its layers' keys and values) or the legacy tuple of (key, value) per layer."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    if hasattr(cache, "layers"):
        tensors = [
            getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values")
        ]
    else:
        tensors = [t for layer in cache for t in layer]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def prefill_cache_nbytes(model: nn.Module, length: int, batch: int = 1, seed: int = 0) -> int:
    """Bytes an ssmkit model's fresh generation cache holds after a prefill of ``length`` random
    tokens, input ids (batch, length): constant in ``length`` for SSM and sliding-window layers,
    linear for full attention (:func:`cache_nbytes`)."""
    cache = model.allocate_cache(batch)
    with torch.inference_mode():
        model(_random_ids(model, batch, length, seed), cache=cache, logits_to_keep=1)
    return cache_nbytes(cache)


def _new_cache(model: nn.Module, batch: int):
    if _is_ssmkit(model):
        return model.allocate_cache(batch)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _next_logits(model: nn.Module, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits (batch, vocab) of the last position of ``ids`` (batch, n), folding ids into
    ``cache``."""
    if _is_ssmkit(model):
        return model(ids, cache=cache, logits_to_keep=1).logits[:, -1, : model.config.vocab_size]
    # transformers 5.x names the argument ``cache``; earlier versions ``past_key_values``
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache})
    return out.logits[:, -1, : model.config.vocab_size]


def generation_cost(
    model: nn.Module,
    prompt_len: int,
    new_tokens: int = 32,
    batch: int = 1,
    prefill_chunk: int | None = None,
    device: torch.device | str | None = None,
) -> dict:
    """Time and memory of greedy generation: a random prompt (batch, prompt_len), then
    ``new_tokens`` one-token steps, each feeding the last argmax token back (the cache then holds
    prompt_len + new_tokens positions). Under ``torch.inference_mode``; the same loop for an ssmkit
    model (``allocate_cache`` + ``model(ids, cache=cache)``) and a transformers one
    (``DynamicCache`` + ``cache=`` / ``past_key_values=``), so the two are timed alike.

    prefill_chunk: feed the prompt through the cache this many positions at a time (None: at once).
    An SSM then needs O(chunk) activation memory instead of O(prompt_len); attention still keeps
    every key. On CPU the heap is trimmed between chunks (``malloc_trim``, microseconds), so what
    one chunk freed does not stay resident and add to the next chunk's peak.

    Returns ``{"prompt_len", "batch", "new_tokens", "prefill_s", "decode_s", "decode_tokens_per_s":
    batch * new_tokens / decode_s, "peak_mb": extra peak MiB over the whole call (cache included),
    "decode_peak_mb": extra peak MiB while decoding, over the memory before the call (what
    generation holds once the prompt is in: cache, one step's activations), "cache_mb": the cache's
    size at the end}``.
    """
    prompt_len = checks.integer(prompt_len, "prompt_len", minimum=1)
    new_tokens = checks.integer(new_tokens, "new_tokens", minimum=1)
    batch = checks.integer(batch, "batch", minimum=1)
    chunk = (
        prompt_len
        if prefill_chunk is None
        else checks.integer(prefill_chunk, "prefill_chunk", minimum=1)
    )
    device = torch.device(device) if device is not None else model_device(model)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    ids = _random_ids(model, batch, prompt_len)
    was_training = model.training
    model.eval()
    whole, decode = _Peak(device), _Peak(device)
    try:
        with torch.inference_mode():
            whole.start()
            decode.base = whole.base  # decode's peak is measured over the same baseline
            t0 = time.perf_counter()
            cache = _new_cache(model, batch)
            for lo in range(0, prompt_len, chunk):
                if lo:
                    _trim_heap()  # what the last chunk freed leaves RSS
                logits = _next_logits(model, ids[:, lo : lo + chunk], cache)
            sync()
            prefill_s = time.perf_counter() - t0
            peak_prefill = whole.stop()
            decode.start(baseline=False)
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                token = logits.argmax(dim=-1, keepdim=True)  # (batch, 1) greedy
                logits = _next_logits(model, token, cache)
            sync()
            decode_s = time.perf_counter() - t0
            decode_peak = decode.stop()
            cache_mb = cache_nbytes(cache) / 2**20
            del cache, logits
    finally:
        model.train(was_training)
    peak = None if peak_prefill is None or decode_peak is None else max(peak_prefill, decode_peak)
    return {
        "prompt_len": prompt_len,
        "batch": batch,
        "new_tokens": new_tokens,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_tokens_per_s": batch * new_tokens / decode_s,
        "peak_mb": peak,
        "decode_peak_mb": decode_peak,
        "cache_mb": cache_mb,
    }


def _value(cost, key: str) -> float | None:
    value = cost.get(key) if isinstance(cost, dict) else cost
    return (
        None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)
    )


def crossover(
    lengths: Sequence[int],
    ssm_costs: Sequence,
    attn_costs: Sequence,
    key: str = "tokens_per_s",
    higher_is_better: bool | None = None,
) -> int | None:
    """The first length from which the SSM beats the attention model at every longer length
    measured, or None if it is behind at the longest one.

    lengths: ascending; ssm_costs, attn_costs: one entry per length, a dict holding ``key`` (rows of
    :func:`train_step_cost` / :func:`generation_cost`) or a number; a None entry (or value) is a
    length not measured and is skipped. higher_is_better: None infers it from the key (rates
    "..._per_s": higher; memory and seconds, e.g. "peak_mb", "prefill_s": lower). "From which it
    stays ahead" rather than "the first win" so one noisy win at a short length does not make the
    crossover. If the SSM wins everywhere the answer is ``lengths[0]`` (the crossover is at or below
    the shortest length)."""
    if not (len(lengths) == len(ssm_costs) == len(attn_costs)):
        raise ValueError(
            f"need one cost per length; got {len(lengths)} lengths, {len(ssm_costs)} SSM "
            f"and {len(attn_costs)} attention costs"
        )
    if list(lengths) != sorted(lengths):
        raise ValueError(f"lengths must be ascending; got {list(lengths)}")
    if higher_is_better is None:
        higher_is_better = "per_s" in key
    answer = None
    for length, s, a in zip(lengths, ssm_costs, attn_costs):
        s, a = _value(s, key), _value(a, key)
        if s is None or a is None:
            continue
        wins = s > a if higher_is_better else s < a
        if not wins:
            answer = None
        elif answer is None:
            answer = length
    return answer


def length_extrapolation(
    model: nn.Module, val_dir, lengths: Sequence[int], max_windows: int = 4
) -> list[dict]:
    """Validation loss at each of ``lengths``: a model trained at a short length, scored on windows
    of longer ones (does it keep improving with more context, or break past its training length?).

    val_dir: a prepared shard directory (:func:`ssmkit.data.prepare`); each length L reads up to
    ``max_windows`` windows of L tokens (``TokenLoader(val_dir, L, 1)``, the same windows every
    call). Returns one row per length:
    ``{"seq_len", "loss": nats/token, "ppl": exp(loss), "windows", "note"}``; a length longer than
    the split (fewer than L + 1 tokens) gets loss and ppl None and a note instead."""
    max_windows = checks.integer(max_windows, "max_windows", minimum=1)
    rows = []
    for length in lengths:
        length = checks.integer(length, "length", minimum=1)
        try:
            loader = TokenLoader(val_dir, length, 1)
        except ValueError as exc:
            if "not one batch" not in str(exc):
                raise
            rows.append(
                {
                    "seq_len": length,
                    "loss": None,
                    "ppl": None,
                    "windows": 0,
                    "note": f"skipped: the split is shorter than one window of {length + 1} tokens",
                }
            )
            continue
        result = perplexity(model, loader, batches=max_windows)
        rows.append(
            {
                "seq_len": length,
                "loss": result["loss"],
                "ppl": result["ppl"],
                "windows": result["batches"],
                "note": "",
            }
        )
    return rows


__all__ = [
    "cache_nbytes",
    "crossover",
    "fix_mmap_threshold",
    "generation_cost",
    "length_extrapolation",
    "make_train_step",
    "measure_call",
    "peak_rss_mb",
    "train_step_cost",
]
