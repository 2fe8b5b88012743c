"""Autoregressive generation with the recurrent cache.

The prompt is processed in one parallel pass (the scan, which also returns the final states);
after that every new token is one recurrent step per layer: O(1) time and memory per token,
whatever the length so far. ``use_cache=False`` re-runs the full forward at every step instead,
the slow path the tests compare against.

Prompts of different lengths, two ways:

* a list of prompts (``generate(model, [ids_a, ids_b, ...])``): packed into one row without
  padding (``seq_idx``), prefilled in one pass whose per-sample final states fill a cache of one
  row per prompt, then decoded as one batch. The prefill costs the prompts' total length, not
  batch x the longest (mamba_ssm's varlen prefill; vLLM's packed prefill of a batch);
* a (batch, prompt_len) tensor with an ``attention_mask``: LEFT padding, which the mixers turn into
  no input and no decay (:func:`ssmkit.models.mixer_parts.zero_padding`), attention into masked
  keys; holes anywhere else become left padding first (:func:`ssmkit.models.lm.real_first`).

Either way every prompt gives what it gives alone.
"""

from __future__ import annotations

import torch

from ..checks import is_integer, is_number
from .lm import check_attention_mask, check_token_ids, packed_prefill_refusal, real_first


def check_sampling(temperature, top_k, top_p):
    """temperature: a number >= 0; top_k: None or an int >= 1; top_p: None or a number in (0, 1]."""
    if not (
        is_number(temperature)
        and temperature >= 0
        and (top_k is None or (is_integer(top_k) and top_k >= 1))
        and (top_p is None or (is_number(top_p) and 0 < top_p <= 1))
    ):
        raise ValueError(
            "need temperature a number >= 0, top_k None or an int >= 1, top_p None or a number "
            f"with 0 < top_p <= 1; got temperature={temperature!r}, top_k={top_k!r}, "
            f"top_p={top_p!r}"
        )


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row. logits: (batch, vocab) -> (batch,) int64.

    temperature 0 or top_k 1 is greedy (argmax). top_k keeps the k most likely tokens; top_p keeps
    the smallest set whose probability reaches p (nucleus sampling, Holtzman et al. 2020).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(
            before >= top_p, -torch.inf
        )  # the top token always stays
        logits = torch.full_like(logits, -torch.inf).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def check_prompts(prompts, cfg, device) -> list[torch.Tensor]:
    """prompts: a non-empty list (or tuple) of prompts, each a non-empty 1-D tensor of token ids or
    a list of ints. Returns them as int64 tensors on ``device``."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id sequences")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (list, tuple)) and all(is_integer(t) for t in p):
            p = torch.tensor(list(p), dtype=torch.long)
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() == 0:
            got = f"shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(
                f"prompt {i} must be a non-empty 1-D tensor of token ids or a list of ints; "
                f"got {got}"
            )
        check_token_ids(p[None], cfg)
        out.append(p.to(device=device, dtype=torch.long))
    return out


def _check_options(cfg, max_new_tokens, temperature, top_k, top_p, eos_token_id):
    if not is_integer(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    if eos_token_id is not None and not (
        is_integer(eos_token_id) and 0 <= eos_token_id < cfg.vocab_size
    ):
        raise ValueError(
            f"eos_token_id must be None or a token id in 0..{cfg.vocab_size - 1}; "
            f"got {eos_token_id!r}"
        )


def _sample_loop(logits, step, max_new_tokens, sampling, eos_token_id) -> torch.Tensor:
    """The new tokens, (batch, k) with k <= max_new_tokens: sample from ``logits`` (batch, vocab),
    feed the token to ``step`` (token (batch,) -> the next logits), until max_new_tokens or every
    row has produced ``eos_token_id`` (a finished row repeats it)."""
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    tokens = []
    for i in range(max_new_tokens):
        token = sample_next(logits, **sampling)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done |= token == eos_token_id
        tokens.append(token)
        if done.all() or i == max_new_tokens - 1:
            break
        logits = step(token)
    return torch.stack(tokens, dim=1)


def _packed(sequences: list[torch.Tensor]):
    """Sequences of different lengths as one packed row: ids (1, T), seq_idx (1, T), and the
    position of each one's last token (n,)."""
    lengths = torch.tensor([len(s) for s in sequences], device=sequences[0].device)
    ids = torch.cat(sequences)[None]
    seq_idx = torch.repeat_interleave(torch.arange(len(sequences), device=ids.device), lengths)
    return ids, seq_idx[None], lengths.cumsum(0) - 1


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor | list,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Continue ``input_ids`` (batch, prompt_len) by up to ``max_new_tokens`` tokens (an int >= 0;
    0 returns the prompt as it is).

    Returns (batch, prompt_len + n_new). A row that produced ``eos_token_id`` is padded with it
    afterwards; generation stops when every row has. Sampling only sees the real vocabulary
    (``config.vocab_size``), never the padding rows of the embedding.

    attention_mask: (batch, prompt_len), 1 for real tokens, 0 for padding: LEFT padding (prompts of
    different lengths in one batch; ``tokenizer.padding_side = "left"``), or holes anywhere. Each
    row then gives what its real tokens give alone; the prompt is returned as given, the new
    tokens after it.

    input_ids may instead be a list of prompts of any lengths, each a 1-D tensor of token ids or a
    list of ints: they are prefilled packed into one row (no padding; their total length in one
    pass, a cache row each) and decoded as one batch. Returns a list: each prompt followed by its
    new tokens (up to and including ``eos_token_id``, no padding after it), as a 1-D int64 tensor
    on the model's device. Models whose layers keep no per-sample states (S4D, H3, Zamba2) are
    prefilled as a left-padded batch instead, with the same result.
    """
    cfg = model.config
    param = next(iter(model.parameters()), None)  # a stand-in model may have none
    device = param.device if param is not None else torch.device("cpu")
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError(
                "attention_mask goes with a (batch, prompt_len) tensor; a list of prompts needs "
                "none (each prompt keeps its own length)"
            )
        prompts = check_prompts(input_ids, cfg, device)
        _check_options(cfg, max_new_tokens, temperature, top_k, top_p, eos_token_id)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        return _generate_prompts(model, prompts, max_new_tokens, sampling, eos_token_id, use_cache)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        got = (
            tuple(input_ids.shape)
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise ValueError(
            "input_ids must be a (batch, prompt_len) tensor with prompt_len >= 1, or a list of "
            f"prompts; got {got}"
        )
    check_token_ids(input_ids, cfg)
    _check_options(cfg, max_new_tokens, temperature, top_k, top_p, eos_token_id)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    ids, mask = input_ids, attention_mask
    if mask is not None:
        check_attention_mask(mask, input_ids)
        empty = (~mask.bool().any(dim=1)).nonzero()
        if len(empty):
            raise ValueError(
                f"attention_mask row {int(empty[0])} is all padding: "
                "every prompt needs a real token"
            )
        if mask.bool().all():  # no padding: plain path
            mask = None
        else:  # holes become left padding: each row's real tokens at its end, in order
            order = real_first(mask.bool())
            ids, mask = ids.gather(1, order), mask.gather(1, order).long()
    if max_new_tokens == 0:
        return input_ids
    was_training = model.training
    model.eval()
    vocab = cfg.vocab_size
    try:
        if use_cache:
            cache = model.allocate_cache(ids.shape[0])
            logits = model(ids, cache=cache, logits_to_keep=1, attention_mask=mask).logits

            def step(token):  # one recurrent step
                return model(token[:, None], cache=cache).logits[:, -1, :vocab]

        else:  # full re-run
            logits = model(ids, logits_to_keep=1, attention_mask=mask).logits
            grown = [ids]

            def step(token):
                nonlocal mask
                grown.append(token[:, None])
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                seq = torch.cat(grown, dim=1)
                return model(seq, logits_to_keep=1, attention_mask=mask).logits[:, -1, :vocab]

        new = _sample_loop(logits[:, -1, :vocab], step, max_new_tokens, sampling, eos_token_id)
    finally:
        model.train(was_training)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


def _generate_prompts(model, prompts, max_new_tokens, sampling, eos_token_id, use_cache):
    """:func:`generate` for a list of prompts (checked): packed prefill, batched decode."""
    if max_new_tokens == 0:
        return [p.clone() for p in prompts]
    vocab, n = model.config.vocab_size, len(prompts)
    if use_cache and packed_prefill_refusal(model) is not None:
        # no per-sample states: a left-padded batch, exact as well, padded to the longest
        width = max(len(p) for p in prompts)
        ids = torch.zeros(n, width, dtype=torch.long, device=prompts[0].device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
        out = generate(
            model,
            ids,
            max_new_tokens,
            **sampling,
            eos_token_id=eos_token_id,
            attention_mask=mask,
        )
        new = out[:, width:]
    else:
        was_training = model.training
        model.eval()
        try:
            ids, seq_idx, last = _packed(prompts)
            if use_cache:
                cache = model.allocate_cache(n)
                logits = model(ids, cache=cache, seq_idx=seq_idx, logits_to_keep=last).logits[0]

                def step(token):  # one recurrent step of every prompt
                    return model(token[:, None], cache=cache).logits[:, -1, :vocab]

            else:  # every step re-runs the packed prompts with what they have produced so far
                logits = model(ids, seq_idx=seq_idx, logits_to_keep=last).logits[0]
                produced = []

                def step(token):
                    produced.append(token)
                    grown = torch.stack(produced, dim=1)  # (n, k)
                    ids, seq_idx, last = _packed(
                        [torch.cat([p, g]) for p, g in zip(prompts, grown)]
                    )
                    return model(ids, seq_idx=seq_idx, logits_to_keep=last).logits[0, :, :vocab]

            new = _sample_loop(logits[:, :vocab], step, max_new_tokens, sampling, eos_token_id)
        finally:
            model.train(was_training)
    outs = []
    for p, row in zip(prompts, new):
        if eos_token_id is not None:
            hits = (row == eos_token_id).nonzero()
            if len(hits):
                row = row[: int(hits[0]) + 1]
        outs.append(torch.cat([p, row]))
    return outs
