r"""Gradient checkpointing over time: a scan whose backward keeps its inputs, not its intermediates.

A scan whose state is carried across time, ``y, h_out = fn(h_in, inputs)``, can be cut into
segments of whole chunks: run over steps ``s:e`` from the state entering step ``s`` it gives that
segment's outputs and the state leaving it. Under autograd the chunked scans (Mamba-2's SSD,
Mamba-3's scan) keep every intermediate of every chunk for the backward: the (Q, Q) decay matrices,
the scores, the einsums' operands, the states of every chunk, tens of times the inputs' bytes.
:func:`scan_in_segments` keeps only what is needed to recompute them:

* forward, without a graph: segment by segment, keeping each segment's entering state
  (O(L / segment) states) and the inputs (which the caller's graph mostly holds already);
* backward, segments last to first: one segment's forward again under autograd, from its entering
  state made a leaf, and ``torch.autograd.grad`` of its outputs against (dy of the segment, dh
  leaving it): the segment's input gradients and dh entering it, which the segment before receives.

Memory: the inputs, the entering states, and one segment's intermediates at a time; compute: one
more forward of the scan. The same trade as ``torch.utils.checkpoint`` but along time inside one
op, which is how the official kernels organise their backward (mamba_ssm's Triton SSD and selective
scan save the chunk states and recompute the rest chunk by chunk); "gradient checkpointing" is
Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", applied here to the time axis.

    y, h = scan_in_segments(fn, h0, seq=(x, dt, B, C), rest=(A,), bounds=segment_bounds(L, 2048))

``fn(h_in, seq_slices, rest) -> (y, h_out)``: ``h_in`` is None for the first segment when ``h0`` is
None (the scan's zero state), ``seq_slices`` the sequence inputs cut to the segment along dim 1
(None stays None; integer tensors such as a packed row's sample numbers are cut alike and get no
gradient), ``rest`` the inputs every segment reads whole (parameters: their gradients are summed
over the segments). ``y``: (batch, e - s, ...), concatenated along dim 1.
"""

from __future__ import annotations

import torch

__all__ = ["scan_in_segments", "segment_bounds"]


def segment_bounds(seqlen: int, segment: int, chunk: int = 1) -> list[tuple[int, int]]:
    """Steps ``0..seqlen-1`` cut into ``(start, end)`` pieces of ``segment`` steps rounded down to a
    multiple of ``chunk`` (at least one chunk), the last one shorter: whole chunks, so a chunked
    scan cuts its chunks where it would without segments."""
    if seqlen < 1 or segment < 1 or chunk < 1:
        raise ValueError(
            f"seqlen, segment and chunk must be positive integers; got seqlen={seqlen}, "
            f"segment={segment}, chunk={chunk}"
        )
    step = max(chunk, segment // chunk * chunk)
    return [(s, min(s + step, seqlen)) for s in range(0, seqlen, step)]


def _cut(t, s, e):
    return None if t is None else t[:, s:e]


def _leaf(t, grad: bool):
    """A detached alias of ``t`` that autograd differentiates against when ``grad``."""
    return None if t is None else t.detach().requires_grad_(grad)


class _Segments(torch.autograd.Function):
    """The forward and backward of :func:`scan_in_segments`; tensors = (h0, *seq, *rest)."""

    @staticmethod
    def forward(ctx, fn, bounds, n_seq, *tensors):
        h, seq, rest = tensors[0], tensors[1 : 1 + n_seq], tensors[1 + n_seq :]
        ys, entering = [], []
        for s, e in bounds:  # no graph: Function.forward runs with grad off
            entering.append(h)
            y, h = fn(h, [_cut(t, s, e) for t in seq], list(rest))
            ys.append(y)
        ctx.fn, ctx.bounds, ctx.n_seq = fn, bounds, n_seq
        ctx.n_tensors = len(tensors)
        # the backward recomputes under the forward's autocast (as torch.utils.checkpoint does), so
        # bf16 / fp16 training differentiates the forward it ran
        device = next(t.device.type for t in tensors if isinstance(t, torch.Tensor))
        ctx.autocast = dict(
            device_type=device,
            dtype=torch.get_autocast_dtype(device),
            enabled=torch.is_autocast_enabled(device),
        )
        # the first entering state is h0 itself (or None); the others are O(L / segment) states
        ctx.save_for_backward(*tensors, *entering[1:])
        return torch.cat(ys, dim=1), h

    @staticmethod
    def backward(ctx, dy, dh):
        saved = ctx.saved_tensors
        tensors, entering = saved[: ctx.n_tensors], (saved[0], *saved[ctx.n_tensors :])
        n_seq, need = ctx.n_seq, ctx.needs_input_grad[3:]
        seq, rest = tensors[1 : 1 + n_seq], tensors[1 + n_seq :]
        need_seq, need_rest = need[1 : 1 + n_seq], need[1 + n_seq :]
        # a sequence input's gradient is written segment by segment into one buffer
        d_seq = [torch.zeros_like(t) if n else None for t, n in zip(seq, need_seq)]
        d_rest = [None] * len(rest)
        for k in reversed(range(len(ctx.bounds))):
            s, e = ctx.bounds[k]
            h_grad = entering[k] is not None and (k > 0 or need[0])
            with torch.enable_grad(), torch.autocast(**ctx.autocast):
                h_in = _leaf(entering[k], h_grad)
                seq_k = [_leaf(_cut(t, s, e), n) for t, n in zip(seq, need_seq)]
                rest_k = [_leaf(t, n) for t, n in zip(rest, need_rest)]
                y, h_out = ctx.fn(h_in, seq_k, rest_k)
            wrt = [t for t in (h_in, *seq_k, *rest_k) if t is not None and t.requires_grad]
            grads = iter(
                torch.autograd.grad(
                    (y, h_out), wrt, (dy[:, s:e], dh), allow_unused=True, materialize_grads=True
                )
                if wrt
                else ()
            )
            dh = next(grads) if h_grad else None
            for i, t in enumerate(seq_k):
                if t is not None and t.requires_grad:
                    d_seq[i][:, s:e] = next(grads)
            for i, t in enumerate(rest_k):
                if t is not None and t.requires_grad:
                    g = next(grads)
                    d_rest[i] = g if d_rest[i] is None else d_rest[i] + g
        return (None, None, None, dh if need[0] else None, *d_seq, *d_rest)


def scan_in_segments(fn, h0, seq, rest, bounds):
    """Run the scan ``fn`` over time segments with a recomputing backward (module docstring).

    Args:
        fn: ``fn(h_in, seq_slices, rest) -> (y, h_out)``, the scan over one segment; it must be a
            function of its arguments only (it is run again in the backward).
        h0: the state entering step 0, or None (``fn`` then gets None for the first segment).
        seq: tensors (batch, seqlen, ...) (or None), cut along dim 1 for each segment.
        rest: tensors (or None) every segment reads whole.
        bounds: ``[(start, end), ...]`` covering 0..seqlen-1 in order (:func:`segment_bounds`).
    Returns:
        ``(y, h)``: the segments' outputs concatenated along dim 1, and the state after the last
        step; both differentiable with respect to h0, seq and rest.
    """
    return _Segments.apply(fn, tuple(bounds), len(seq), h0, *seq, *rest)
