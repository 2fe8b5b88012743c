"""Autoregressive generation with the recurrent cache.

The prompt is processed in one parallel pass (the scan, which also returns the final states);
after that every new token is one recurrent step per layer: O(1) time and memory per token,
whatever the length so far. ``use_cache=False`` re-runs the full forward at every step instead,
the slow path the tests compare against.

Prompts of different lengths share a batch with LEFT padding and an ``attention_mask``: the
mixers zero the padded positions' conv and SSM inputs, so a padded row's states after the
prompt are exactly those of the row run alone (see :func:`ssmkit.models.mixer_parts.zero_padding`).
"""

from __future__ import annotations

import torch

from ..checks import is_integer, is_number
from .lm import check_attention_mask, check_token_ids


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


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Continue ``input_ids`` (batch, prompt_len) by up to ``max_new_tokens`` tokens (an int >= 0;
    0 returns the prompt as it is).

    Returns (batch, prompt_len + n_new). A row that produced ``eos_token_id`` is padded with it
    afterwards; generation stops when every row has. Sampling only sees the real vocabulary
    (``config.vocab_size``), never the padding rows of the embedding.

    attention_mask: (batch, prompt_len), 1 for real tokens, 0 for LEFT padding (prompts of
    different lengths in one batch; ``tokenizer.padding_side = "left"``). Each row then gives what
    its prompt gives alone, unpadded; the padding stays at the front of the output.
    """
    cfg = model.config
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        got = (
            tuple(input_ids.shape)
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise ValueError(
            f"input_ids must be a (batch, prompt_len) tensor with prompt_len >= 1; got {got}"
        )
    check_token_ids(input_ids, cfg)
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
    if attention_mask is not None:
        check_attention_mask(attention_mask, input_ids)
        empty = (~attention_mask.bool().any(dim=1)).nonzero()
        if len(empty):
            raise ValueError(
                f"attention_mask row {int(empty[0])} is all padding: "
                "every prompt needs a real token"
            )
        # no padding: plain path
        attention_mask = None if attention_mask.bool().all() else attention_mask.long()
    if max_new_tokens == 0:
        return input_ids
    was_training = model.training
    model.eval()
    vocab = cfg.vocab_size
    ids, mask = input_ids, attention_mask
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    cache = model.allocate_cache(ids.shape[0]) if use_cache else None
    try:
        # prefill
        logits = model(ids, cache=cache, logits_to_keep=1, attention_mask=mask).logits[
            :, -1, :vocab
        ]
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                token = token.masked_fill(done, eos_token_id)
                done |= token == eos_token_id
            ids = torch.cat([ids, token[:, None]], dim=1)
            if done.all() or step == max_new_tokens - 1:
                break
            if use_cache:
                logits = model(token[:, None], cache=cache).logits[
                    :, -1, :vocab
                ]  # one recurrent step
            else:  # full re-run
                mask = (
                    None
                    if mask is None
                    else torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                )
                logits = model(ids, logits_to_keep=1, attention_mask=mask).logits[:, -1, :vocab]
    finally:
        model.train(was_training)
    return ids
