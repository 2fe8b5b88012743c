r"""Depthwise causal 1-D convolution, the short convolution before every Mamba scan.

Each channel d has its own filter w_d of width W (``d_conv``, 4 in the official models):

$$ y_{d,t} = b_d + \sum_{k=0}^{W-1} w_{d,k}\, x_{d,\,t-W+1+k}
   \qquad (x_{d,t} = 0 \text{ for } t < 0) $$

then an optional activation: SiLU in every Mamba, or any of
:data:`ssmkit.ops.activations.ACTIVATIONS` by its transformers name (Jamba's conv takes the config's
``hidden_act``). For generation, :func:`causal_conv1d_update` keeps the last inputs of each channel
as the conv state and produces the outputs of k >= 1 new inputs per call (one token, or a
speculative draft of k), the state shifting or circular (``cache_seqlens``) as causal-conv1d's.

Shapes follow the ``causal_conv1d`` package: ``x: (batch, dim, seqlen)``, ``weight: (dim, width)``,
``bias: (dim,)``, ``conv_state: (batch, dim, state_len)`` with state_len >= width - 1 (the models
keep state_len = width).

Packed samples (``seq_idx: (batch, seqlen)``, see :mod:`ssmkit.ops.packing`): tap k of output t
counts only when ``seq_idx[t-W+1+k] == seq_idx[t]``, as causal-conv1d's kernel: each sample sees
zeros left of its first token, exactly as if it ran alone. With ``initial_sample_states``
(n_samples, dim, W-1) each sample sees its own W-1 inputs there instead, as causal-conv1d's
``initial_states`` for one sequence (x prepended with them); ``return_sample_states`` returns every
sample's last W-1 inputs, (n_samples, dim, W-1), its initial state to their left when it is shorter
than W-1 (as ``return_final_states``). The kernel takes neither with seq_idx, so the ``cuda`` path
runs it with every sample from zeros and recomputes in PyTorch the only outputs an initial state
reaches, the first W-1 of each sample: O(n_samples · W² · dim) extra work, no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend as _backend
from .activations import activation as _activation
from .packing import check_seq_idx, positions_in_sample, sample_numbers, sample_state_spans

KERNEL_ACTIVATIONS = (None, "silu", "swish")  # what the causal_conv1d kernels apply themselves


def _check_activation(activation):
    """An unknown name is a ValueError listing the valid ones (before any state is written)."""
    if activation is not None:
        _activation(activation)


def _activate(y, activation):
    """y after ``activation`` (None: y itself); an unknown name is a ValueError listing the valid
    ones."""
    return y if activation is None else _activation(activation)(y)


def _kernel_call(fn, x, activation, *args, **kwargs):
    """The kernel ``fn`` with an activation it applies itself, or without one and the activation
    applied after it, in fp32 (the kernels know only SiLU)."""
    if activation in KERNEL_ACTIVATIONS:
        return fn(*args, activation=activation, **kwargs)
    act = _activation(activation)  # refused before the kernel runs
    return act(fn(*args, activation=None, **kwargs).float()).to(x.dtype)


def _check(x, weight, bias, seq_idx=None, initial_sample_states=None, return_sample_states=False):
    """The arguments checked; returns :func:`~ssmkit.ops.packing.sample_spans` when per-sample
    states are used, else None."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"x must be (batch, dim, seqlen) and weight (dim, width) with the same dim; "
            f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (x.shape[1],):
        raise ValueError(f"bias must be (dim={x.shape[1]},); got {tuple(bias.shape)}")
    check_seq_idx(seq_idx, x.shape[0], x.shape[2])
    return sample_state_spans(
        seq_idx, initial_sample_states, return_sample_states, (x.shape[1], weight.shape[1] - 1)
    )


def _same_sample(seq_idx, shift):
    """(batch, seqlen) bool: position t - shift belongs to t's sample (t < shift: False; a zero
    input)."""
    seqlen = seq_idx.shape[1]
    earlier = F.pad(seq_idx, (shift, 0), value=-1)[:, :seqlen] if shift else seq_idx
    return earlier == seq_idx


def causal_conv1d_reference(
    x,
    weight,
    bias=None,
    activation=None,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """The sum over the W taps written out (the formula in the module docstring); with ``seq_idx`` a
    tap counts only inside the output's own sample, and with ``initial_sample_states`` a tap left
    of the sample reads the sample's initial state. Returns y, or (y, final sample states) with
    ``return_sample_states``."""
    spans = _check(x, weight, bias, seq_idx, initial_sample_states, return_sample_states)
    width, seqlen = weight.shape[1], x.shape[2]
    xp = F.pad(x.float(), (width - 1, 0))  # W-1 zeros before t = 0
    if initial_sample_states is not None:
        number, offset = sample_numbers(seq_idx), positions_in_sample(seq_idx)
        # state j (0..W-2) holds the input W-1-j steps before the sample's first token
        state_rows = initial_sample_states.float().transpose(1, 2)  # (n, W-1, dim)
    y = 0
    for k in range(width):  # tap k reads x_{t-(W-1)+k}
        tap = weight[:, k, None].float() * xp[:, :, k : k + seqlen]
        if seq_idx is not None:
            tap = tap * _same_sample(seq_idx, width - 1 - k)[:, None, :]
        if initial_sample_states is not None and k < width - 1:
            # the output at offset p of its sample reads offset p-(W-1)+k: before the first token
            # when j = p + k < W-1, where it is the sample's state j
            j = offset + k
            left = state_rows[number, j.clamp(max=width - 2)] * (j < width - 1)[..., None]
            tap = tap + weight[:, k, None].float() * left.transpose(1, 2)
        y = y + tap
    if bias is not None:
        y = y + bias.float()[:, None]
    y = _activate(y, activation).to(x.dtype)
    if not return_sample_states:
        return y
    finals = []  # each sample's last W-1 inputs, with its initial state (or zeros) to their left
    for i, (r, s, e) in enumerate(zip(*(t.tolist() for t in spans))):
        left = (
            x.new_zeros(x.shape[1], width - 1)
            if initial_sample_states is None
            else initial_sample_states[i].to(x.dtype)
        )
        finals.append(torch.cat([left, x[r, :, s:e]], dim=1)[:, e - s :])
    return y, torch.stack(finals)


def _sample_inputs(x, states, row, start, offset, before):
    """(n, m, dim) fp32: the input at ``offset`` (n, m) steps from the first token of each sample
    (``row``, ``start``: (n,)); offsets -before..-1 are left of it, in the sample's initial conv
    state ``states`` (n, dim, before), zeros if None. Offsets past a sample's end are not read."""
    seqlen = x.shape[2]
    inside = x.transpose(1, 2)[row[:, None], (start[:, None] + offset).clamp(0, seqlen - 1)]
    if states is None:
        return torch.where((offset >= 0)[..., None], inside.float(), 0.0)
    n = states.shape[0]
    left = states.transpose(1, 2)[
        torch.arange(n, device=states.device)[:, None], (offset + before).clamp(0, before - 1)
    ]
    return torch.where((offset >= 0)[..., None], inside.float(), left.float())


def _with_sample_states(y, x, weight, bias, activation, spans, states, return_states):
    """The torch and cuda paths' per-sample states: y (batch, dim, seqlen) was computed with every
    sample from zeros. An initial state reaches only the first W-1 outputs of its sample: those are
    recomputed from the state and the sample's inputs (fp32, as the conv) and written over y, in y's
    layout. The final states are each sample's last W-1 inputs, its state to their left. Both read
    their inputs in one gather (its backward is one pass over x)."""
    row, start, end = spans
    n, dim, width = row.shape[0], x.shape[1], weight.shape[1]
    before = width - 1
    if before == 0:  # width 1: a conv without memory
        return (y, x.new_zeros(n, dim, 0)) if return_states else y
    p = torch.arange(before, device=x.device)  # an output's offset in its sample
    taps = torch.arange(width, device=x.device)  # tap k of output p reads offset p - (W-1) + k
    offsets = []  # (n, m): what to read, as offsets from each sample's first token
    if states is not None:
        offsets.append((p[:, None] - before + taps).reshape(1, -1).expand(n, -1))
    if return_states:
        offsets.append((end - start)[:, None] - before + p)
    read = _sample_inputs(x, states, row, start, torch.cat(offsets, 1), before)
    if states is not None:
        window = read[:, : before * width].view(n, before, width, dim)
        pre = (window * weight.float().t()).sum(2)  # (n, W-1, dim)
        if bias is not None:
            pre = pre + bias.float()
        out = _activate(pre, activation).to(y.dtype)
        inside = p < (end - start)[:, None]  # (n, W-1): a sample shorter than W-1 has fewer
        where = (row[:, None].expand(n, before)[inside], (start[:, None] + p)[inside])
        y = y.transpose(1, 2).index_put(where, out[inside]).transpose(1, 2)
    if not return_states:
        return y
    finals = read[:, read.shape[1] - before :]  # (n, W-1, dim)
    return y, finals.transpose(1, 2).to(x.dtype).contiguous()


def causal_conv1d_torch(
    x,
    weight,
    bias=None,
    activation=None,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """``F.conv1d`` with groups = dim and left padding W-1; for a (batch, dim, seqlen) view of
    channels-last memory (what the mixers pass), the W taps as shifted multiply-adds over
    (batch, seqlen, dim) rows instead, which keeps that layout and needs no transposing copy.
    With ``seq_idx`` always the taps, each masked to the output's own sample (result in x's layout).

    Precision as the ``causal_conv1d`` kernel: weight, bias, the sum over taps and the activation in
    fp32 whatever x's dtype, one rounding to x's dtype at the end; the weight and bias gradients are
    accumulated in fp32 too (casting the weight to bf16 first made its gradient ~1e4 times less
    exact). Per-sample states: every sample from zeros, then :func:`_with_sample_states`."""
    spans = _check(x, weight, bias, seq_idx, initial_sample_states, return_sample_states)
    y = _conv_torch(x, weight, bias, activation, seq_idx)
    if spans is None:
        return y
    return _with_sample_states(
        y, x, weight, bias, activation, spans, initial_sample_states, return_sample_states
    )


def _conv_torch(x, weight, bias, activation, seq_idx):
    width, seqlen = weight.shape[1], x.shape[2]
    channels_last = x.stride(1) == 1 and x.shape[1] != 1
    w, b, xf = (
        weight.float(),
        None if bias is None else bias.float(),
        x.float(),
    )  # no copies in fp32
    if not channels_last and seq_idx is None:
        y = F.conv1d(F.pad(xf, (width - 1, 0)), w.unsqueeze(1), b, groups=x.shape[1])
        return _activate(y, activation).to(x.dtype)
    rows = F.pad(xf.transpose(1, 2), (0, 0, width - 1, 0))  # (batch, W-1 + seqlen, dim)

    def tap(k):  # tap k reads x_{t-(W-1)+k}
        if seq_idx is None or k == width - 1:  # (the current input: its own sample)
            return rows[:, k : k + seqlen]
        return rows[:, k : k + seqlen] * _same_sample(seq_idx, width - 1 - k)[:, :, None]

    y = tap(0) * w[:, 0]
    for k in range(1, width):
        y = torch.addcmul(y, tap(k), w[:, k])
    if b is not None:
        y = y + b
    y = _activate(y, activation).to(x.dtype).transpose(1, 2)
    return y if channels_last else y.contiguous()


def causal_conv1d_cuda(
    x,
    weight,
    bias=None,
    activation=None,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """The ``causal_conv1d`` package's kernel. It reads ``seq_idx`` (int32, contiguous) only for
    channels-last x (``x.stride(1) == 1``, ``x.stride(2) > 1``): other layouts are copied into it
    first. It refuses initial and final states with seq_idx: per-sample states run it with every
    sample from zeros, then :func:`_with_sample_states` (exact; O(n_samples) small PyTorch ops)."""
    spans = _check(x, weight, bias, seq_idx, initial_sample_states, return_sample_states)
    fn = _backend.kernel_module("causal_conv1d").causal_conv1d_fn
    if seq_idx is None:
        return _kernel_call(fn, x, activation, x, weight, bias)
    if not (x.stride(1) == 1 and x.stride(2) > 1):
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    seq_idx = seq_idx.to(torch.int32).contiguous()
    y = _kernel_call(fn, x, activation, x, weight, bias, seq_idx=seq_idx)
    if spans is None:
        return y
    return _with_sample_states(
        y, x, weight, bias, activation, spans, initial_sample_states, return_sample_states
    )


_IMPLS = {
    "reference": causal_conv1d_reference,
    "torch": causal_conv1d_torch,
    "cuda": causal_conv1d_cuda,
}


def causal_conv1d(
    x,
    weight,
    bias=None,
    activation=None,
    backend=None,
    seq_idx=None,
    initial_sample_states=None,
    return_sample_states=False,
):
    """Depthwise causal convolution. x: (batch, dim, seqlen), weight: (dim, width), bias: (dim,);
    seq_idx: (batch, seqlen) integer sample indices of packed rows, or None (see
    :mod:`ssmkit.ops.packing`); initial_sample_states: (n_samples, dim, width - 1), the inputs left
    of each packed sample (only with seq_idx; samples numbered as
    :func:`~ssmkit.ops.packing.sample_numbers`).

    Returns (batch, dim, seqlen) in x's dtype; ``activation``: None or a name in
    :data:`ssmkit.ops.activations.ACTIVATIONS` ("silu" for Mamba), applied in fp32. With
    ``return_sample_states`` (only with seq_idx) returns ``(y, final_sample_states)``, the
    latter (n_samples, dim, width - 1) in x's dtype: each sample's last width - 1 inputs.
    """
    name = _backend.select("causal_conv1d", x, backend=backend)
    if (
        name == "cuda"
        and seq_idx is not None
        and x.shape[1] == 1
        and (backend or _backend.forced_backend()) != "cuda"
    ):
        name = (
            "torch"  # one channel cannot be channels-last, the layout the kernel needs for seq_idx
        )
    if seq_idx is None and initial_sample_states is None and not return_sample_states:
        return _IMPLS[name](x, weight, bias, activation)
    return _IMPLS[name](
        x,
        weight,
        bias,
        activation,
        seq_idx=seq_idx,
        initial_sample_states=initial_sample_states,
        return_sample_states=return_sample_states,
    )


def _check_update(x, conv_state, weight, bias, cache_seqlens, conv_state_indices):
    """The shapes of :func:`causal_conv1d_update`'s arguments, causal-conv1d's rules; a ValueError
    names what was wrong. Returns x as (batch, dim, seqlen)."""
    if x.dim() not in (2, 3) or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"expected x (batch, dim) or (batch, dim, seqlen), conv_state (batch, dim, state_len), "
            f"weight (dim, width); got x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    x3 = x if x.dim() == 3 else x[:, :, None]
    batch, dim, seqlen = x3.shape
    width, state_len = weight.shape[1], conv_state.shape[2]
    rows = "n_entries" if conv_state_indices is not None else f"batch={batch}"
    if (
        weight.shape[0] != dim
        or conv_state.shape[1] != dim
        or state_len < max(width - 1, 1)
        or (conv_state_indices is None and conv_state.shape[0] != batch)
        or seqlen == 0
    ):
        raise ValueError(
            f"expected x (batch, dim) or (batch, dim, seqlen >= 1), conv_state ({rows}, dim, "
            f"state_len) with state_len >= width - 1 and >= 1, weight (dim, width); "
            f"got x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must be (dim={dim},); got {tuple(bias.shape)}")
    for name, t in (("cache_seqlens", cache_seqlens), ("conv_state_indices", conv_state_indices)):
        if t is None:
            continue
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype.is_floating_point
            or t.dtype.is_complex
            or t.dtype == torch.bool
            or tuple(t.shape) != (batch,)
        ):
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be an integer tensor (batch={batch},) (int32 as the kernel takes it, "
                f"or int64); got {got}"
            )
        if t.device.type == "cpu":  # values are read only where that costs no GPU sync
            low, high = (0, None) if name == "cache_seqlens" else (None, conv_state.shape[0])
            if (low is not None and bool((t < low).any())) or (
                high is not None and bool((t >= high).any())
            ):
                valid = "non-negative" if low is not None else f"below n_entries={high}"
                raise ValueError(f"{name} must be {valid}; got {t.tolist()}")
    return x3


def _update_reference(x3, conv_state, weight, bias, activation, cache_seqlens):
    """The definition, one token at a time: token t's window is the W-1 inputs before it (read from
    the state: its last W-1 slots, or the W-1 slots before ``cache_seqlens + t`` of a circular one)
    and itself; then the token enters the state (shifted in at the end, or written at slot
    (cache_seqlens + t) mod state_len). conv_state: (batch, dim, state_len), updated in place."""
    width, state_len, seqlen = weight.shape[1], conv_state.shape[2], x3.shape[2]
    rows = torch.arange(x3.shape[0], device=x3.device)
    seen = None if cache_seqlens is None else cache_seqlens.long()
    w, ys = weight.float(), []
    for t in range(seqlen):
        xt = x3[:, :, t]
        if seen is None:
            # a copy: the state is overwritten below, and autograd keeps what the sum read
            before = conv_state[:, :, state_len - width + 1 :].clone().unbind(-1)
        else:
            slots = [torch.remainder(seen + t - width + 1 + j, state_len) for j in range(width)]
            before = [conv_state[rows, :, slots[j]] for j in range(width - 1)]
        window = [*(v.to(x3.dtype) for v in before), xt]  # the state is read in x's dtype
        y = sum(w[:, j] * window[j].float() for j in range(width))
        ys.append(y if bias is None else y + bias.float())
        new = xt.to(conv_state.dtype)
        if seen is None:
            conv_state.copy_(torch.cat([conv_state[:, :, 1:], new[:, :, None]], dim=-1))
        else:
            conv_state[rows, :, slots[-1]] = new  # slot (cache_seqlens + t) mod state_len
    return _activate(torch.stack(ys, dim=-1), activation).to(x3.dtype)


def _update_torch(x3, conv_state, weight, bias, activation, cache_seqlens):
    """All k tokens at once: the state's last W-1 inputs (or the W-1 slots before
    ``cache_seqlens``) and the k new ones side by side, the k windows of W taps as an ``unfold``
    (for k = 1 the single window times the weight); then the state shifted by k (or the last
    min(k, state_len) tokens written into their slots: later ones overwrite earlier ones, as the
    kernel's sequential writes do)."""
    batch, dim, seqlen = x3.shape
    width, state_len = weight.shape[1], conv_state.shape[2]
    if cache_seqlens is None:
        full = torch.cat([conv_state.to(x3.dtype), x3], dim=-1)  # (batch, dim, state_len + k)
        ext = full[:, :, state_len - width + 1 :]  # the W-1 inputs before the first new token on
        conv_state.copy_(full[:, :, -state_len:])
    else:
        seen = cache_seqlens.long()[:, None]
        read = torch.remainder(seen + torch.arange(1 - width, 0, device=x3.device), state_len)
        before = conv_state.gather(2, read[:, None, :].expand(batch, dim, width - 1))
        ext = torch.cat([before.to(x3.dtype), x3], dim=-1)
        kept = min(seqlen, state_len)
        slots = seen + torch.arange(seqlen - kept, seqlen, device=x3.device)
        conv_state.scatter_(
            2,
            torch.remainder(slots, state_len)[:, None, :].expand(batch, dim, kept),
            x3[:, :, seqlen - kept :].to(conv_state.dtype),
        )
    y = (ext.float().unfold(2, width, 1) * weight.float()[:, None, :]).sum(-1)  # (b, d, k)
    if bias is not None:
        y = y + bias.float()[:, None]
    return _activate(y, activation).to(x3.dtype)


def _kernel_takes(x, conv_state, weight, bias) -> bool:
    """What causal-conv1d's update kernel accepts (its TORCH_CHECKs): width 2..4, the state in x's
    dtype, the bias in the weight's."""
    return (
        2 <= weight.shape[1] <= 4
        and conv_state.dtype == x.dtype
        and (bias is None or bias.dtype == weight.dtype)
    )


def causal_conv1d_update(
    x,
    conv_state,
    weight,
    bias=None,
    activation=None,
    backend=None,
    cache_seqlens=None,
    conv_state_indices=None,
):
    """The conv of generation: the outputs for k >= 1 new inputs, continuing ``conv_state``, which
    is updated in place. causal-conv1d's ``causal_conv1d_update`` (its arguments and semantics):

    x: (batch, dim) for one token, or (batch, dim, k) for k tokens in one call (speculative
    decoding's verification step), which equals k one-token calls. weight: (dim, width); bias:
    (dim,). conv_state: (batch, dim, state_len) with state_len >= width - 1 (the models keep
    state_len = width): the last state_len inputs, oldest first; each call shifts the k new inputs
    in at the end.

    cache_seqlens: (batch,) integer, or None. Given, conv_state is a circular buffer:
    ``cache_seqlens[b]`` tokens have been written so far, the newest at slot (cache_seqlens - 1) mod
    state_len, and the k new tokens go to slots cache_seqlens, cache_seqlens + 1, ... mod state_len
    (the caller advances cache_seqlens by k afterwards). A circular buffer rotated to start at slot
    cache_seqlens mod state_len is the shifting form: both give the same outputs and states.

    conv_state_indices: (batch,) integer, or None. Given, conv_state is a pool of n_entries rows
    (continuous batching) and row b of the batch reads and writes entry ``conv_state_indices[b]``;
    a negative index marks padding: output 0, no entry touched. Indices must be distinct.

    Returns (batch, dim) or (batch, dim, k), as x, in x's dtype (taps summed in fp32, as the
    kernel). ``activation``: None, "silu" or "swish".
    """
    x3 = _check_update(x, conv_state, weight, bias, cache_seqlens, conv_state_indices)
    _check_activation(activation)  # before the state is touched
    name = _backend.select("causal_conv1d_update", x, backend=backend)
    if (
        name == "cuda"
        and not _kernel_takes(x, conv_state, weight, bias)
        and (backend or _backend.forced_backend()) != "cuda"
    ):
        name = "torch"  # a width or dtype the kernel refuses: the torch path computes the same
    if name == "cuda":
        fn = _backend.kernel_module("causal_conv1d_update").causal_conv1d_update
        as_int32 = lambda t: None if t is None else t.to(torch.int32).contiguous()  # noqa: E731
        return _kernel_call(
            fn,
            x,
            activation,
            x,
            conv_state,
            weight,
            bias,
            cache_seqlens=as_int32(cache_seqlens),
            conv_state_indices=as_int32(conv_state_indices),
        )
    impl = _update_reference if name == "reference" else _update_torch
    if conv_state_indices is None:
        y = impl(x3, conv_state, weight, bias, activation, cache_seqlens)
    else:  # the batch's rows gathered from the pool, updated, written back (padding rows: none)
        index = conv_state_indices.long()
        rows = conv_state[index.clamp(min=0)]
        y = impl(x3, rows, weight, bias, activation, cache_seqlens)
        real = index >= 0
        y = y.masked_fill(~real[:, None, None], 0)
        conv_state[index[real]] = rows[real]
    return y if x.dim() == 3 else y[:, :, 0]
