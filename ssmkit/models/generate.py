"""Autoregressive generation with the recurrent cache.

The prompt is processed in one parallel pass (the scan, which also returns the final states);
after that every new token is one recurrent step per layer: O(1) time and memory per token,
whatever the length so far. ``use_cache=False`` re-runs the full forward at every step instead,
the slow path the tests compare against.
"""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row. logits: (batch, vocab) -> (batch,) int64.

    temperature 0 or top_k 1 is greedy (argmax). top_k keeps the k most likely tokens; top_p keeps
    the smallest set whose probability reaches p (nucleus sampling, Holtzman et al. 2020).
    """
    if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"need temperature >= 0, top_k >= 1, 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs                     # mass of the strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= top_p, -torch.inf)   # the top token always stays
        logits = torch.full_like(logits, -torch.inf).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int = 64, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
             use_cache: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue ``input_ids`` (batch, prompt_len) by up to ``max_new_tokens`` tokens.

    Returns (batch, prompt_len + n_new). A row that produced ``eos_token_id`` is padded with it
    afterwards; generation stops when every row has. Sampling only sees the real vocabulary
    (``config.vocab_size``), never the padding rows of the embedding.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, prompt_len) with prompt_len >= 1; got {tuple(input_ids.shape)}")
    was_training = model.training
    model.eval()
    vocab = model.config.vocab_size
    ids = input_ids
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    cache = model.allocate_cache(ids.shape[0]) if use_cache else None
    logits = model(ids, cache=cache, logits_to_keep=1).logits[:, -1, :vocab]          # prefill
    try:
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                token = token.masked_fill(done, eos_token_id)
                done |= token == eos_token_id
            ids = torch.cat([ids, token[:, None]], dim=1)
            if done.all() or step == max_new_tokens - 1:
                break
            if use_cache:
                logits = model(token[:, None], cache=cache).logits[:, -1, :vocab]      # one recurrent step
            else:
                logits = model(ids, logits_to_keep=1).logits[:, -1, :vocab]           # full re-run
    finally:
        model.train(was_training)
    return ids
