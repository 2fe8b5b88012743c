"""How well a model does on SFT data (:func:`ssmkit.data.prepare_sft` directories): the held-out
completion loss, exact-match accuracy of greedy answers, and a table of generations for the
notebook.

    ev.completion_loss(model, "data/arith-val")     # {"loss", "per_sample", "tokens", "samples"}
    ev.exact_match(model, "data/arith-val", n=100)  # {"accuracy", "n", "results": [...]}
    print(ev.generation_table({"before": base, "after": tuned}, "data/arith-val", n=5))

Completion loss: the samples run one per row (right padding, which a causal model never reads, so no
``seq_idx`` is needed); over the positions the directory's loss mask trains (the completion tokens
and their EOS when prepared with ``completion_only=True``, every token otherwise)::

    loss          = Σ_samples Σ_t CE_t / Σ_samples T_s   (mean over all scored tokens, nats/token)
    per_sample[s] = Σ_t CE_t / T_s                       (mean over sample s's scored tokens)

Exact match: the prompt of each sample's last completion (everything up to and including the
``<|assistant|>\\n`` header) is continued greedily (:func:`ssmkit.models.generate.generate`,
temperature 0) for at most ``max_new_tokens``. The answer is the generated text up to the first EOS,
and up to the first newline when the reference is one line; it is right when, stripped of
surrounding whitespace, it equals the reference (the completion's text, stripped). accuracy = right
/ n.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import checks
from ..data.sft import SFTData, open_sft, sample_labels
from ..data.tokenizers import loaded_tokenizer
from ..models.generate import generate
from .loss import logits_of, model_device


def _data(sft) -> SFTData:
    return sft if isinstance(sft, SFTData) else open_sft(sft)


def _pick(data: SFTData, n) -> list[int]:
    n = checks.integer(n, "n", minimum=1, none_ok=True)
    return list(range(len(data) if n is None else min(n, len(data))))


@torch.no_grad()
def completion_loss(
    model: nn.Module,
    sft,
    batch_size: int = 16,
    n: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict:
    """Mean cross-entropy of ``model`` on the scored tokens of an SFT directory (see the module
    docstring).

    sft: a directory from :func:`ssmkit.data.prepare_sft` or an opened
    :class:`~ssmkit.data.sft.SFTData`. n: the first n samples (None: all). ``model(input_ids)`` with
    input_ids (batch, seqlen) returns logits (batch, seqlen, vocab) or an object with ``.logits``.
    dtype: autocast to it (None: none). Returns ``{"loss": float, "per_sample": [float, ...] in
    sample order, "tokens": scored tokens, "samples": n}``. The model is in eval mode meanwhile."""
    data, batch_size = _data(sft), checks.integer(batch_size, "batch_size", minimum=1)
    chosen = _pick(data, n)
    device = torch.device(device) if device is not None else model_device(model)
    eos = int(data.index["eos_token_id"])
    sums, counts = np.zeros(len(chosen)), np.zeros(len(chosen), dtype=np.int64)
    order = sorted(range(len(chosen)), key=lambda i: int(data.lengths[chosen[i]]))  # little padding
    training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = max(int(data.lengths[chosen[i]]) for i in rows)
            ids = np.full((len(rows), width), eos, dtype=np.int64)
            labels = np.full((len(rows), width), -100, dtype=np.int64)
            for r, i in enumerate(rows):
                tokens, mask = data.sample(chosen[i])
                ids[r, : len(tokens)], labels[r, : len(tokens)] = (
                    tokens,
                    sample_labels(tokens, mask),
                )
            x, y = torch.from_numpy(ids).to(device), torch.from_numpy(labels).to(device)
            with (
                torch.autocast(device.type, dtype=dtype)
                if dtype is not None
                else contextlib.nullcontext()
            ):
                logits = logits_of(model(x))
            ce = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]),
                y.reshape(-1),
                ignore_index=-100,
                reduction="none",
            ).view(y.shape)
            scored = y != -100
            sums[rows] = (ce * scored).sum(1).double().cpu().numpy()
            counts[rows] = scored.sum(1).cpu().numpy()
    finally:
        model.train(training)
    tokens = int(counts.sum())
    return {
        "loss": float(sums.sum() / tokens),
        "per_sample": (sums / counts).tolist(),
        "tokens": tokens,
        "samples": len(chosen),
    }


def answer_of(text: str, reference: str) -> str:
    """The answer in a generated ``text`` (decoded, cut at EOS): its first line when ``reference``
    is one line, stripped of surrounding whitespace."""
    return (text.split("\n", 1)[0] if "\n" not in reference.strip() else text).strip()


@torch.no_grad()
def exact_match(
    model: nn.Module,
    sft,
    n: int | None = None,
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    device: torch.device | str | None = None,
    use_cache: bool = True,
) -> dict:
    """Greedy answers of ``model`` to the first ``n`` samples of an SFT directory, scored by exact
    match (see the module docstring).

    max_new_tokens: None gives the longest reference's tokens + 8. Prompts of a batch are
    left-padded with an ``attention_mask`` (each row then generates what it would alone). Returns
    ``{"accuracy": right / n, "n": n, "results": [{"prompt", "reference", "generated", "answer",
    "correct"}, ...]}``, with ``generated`` the decoded text up to EOS."""
    data, batch_size = _data(sft), checks.integer(batch_size, "batch_size", minimum=1)
    chosen = _pick(data, n)
    tok = loaded_tokenizer(data.index["tokenizer"])
    eos = int(data.index["eos_token_id"])
    device = torch.device(device) if device is not None else model_device(model)
    refs = []
    for k in chosen:
        tokens, _ = data.sample(k)
        refs.append(tokens[int(data.completion_start[k]) : -1])  # the last completion, without EOS
    if max_new_tokens is None:
        max_new_tokens = max(len(r) for r in refs) + 8
    max_new_tokens = checks.integer(max_new_tokens, "max_new_tokens", minimum=1)
    results = []
    for start in range(0, len(chosen), batch_size):
        # an empty prompt (a plain record with prompt "") starts from EOS, the usual start of a text
        prompts = [
            data.prompt(k) if data.completion_start[k] else np.array([eos])
            for k in chosen[start : start + batch_size]
        ]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), eos, dtype=torch.int64)
        mask = torch.zeros((len(prompts), width), dtype=torch.int64)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.from_numpy(p), 1
        out = generate(
            model,
            ids.to(device),
            max_new_tokens=max_new_tokens,
            temperature=0,
            eos_token_id=eos,
            attention_mask=mask.to(device),
            use_cache=use_cache,
        )[:, width:].cpu()
        for r, p in enumerate(prompts):
            new = out[r].tolist()
            new = new[: new.index(eos)] if eos in new else new
            reference = tok.decode(refs[start + r].tolist()).strip()
            generated = tok.decode(new)
            answer = answer_of(generated, reference)
            results.append(
                dict(
                    prompt=tok.decode(p.tolist()),
                    reference=reference,
                    generated=generated,
                    answer=answer,
                    correct=answer == reference,
                )
            )
    right = sum(r["correct"] for r in results)
    return {"accuracy": right / len(results), "n": len(results), "results": results}


def _cell(text: str, width: int = 80) -> str:
    text = re.sub(r"<\|(system|user|assistant)\|>\n?", " ", text).strip()
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def generation_table(models: dict[str, nn.Module] | nn.Module, sft, n: int = 5, **kw) -> str:
    """A markdown table of the first ``n`` samples of an SFT directory: the prompt (template markers
    removed), the reference, and each model's greedy answer marked ✓ / ✗ (:func:`exact_match`;
    ``kw`` go to it), e.g. ``{"before": base, "after": tuned}``, with each model's exact-match count
    at the end."""
    models = models if isinstance(models, dict) else {"model": models}
    if not models:
        raise ValueError("generation_table needs at least one model")
    data = _data(sft)
    runs = {name: exact_match(m, data, n=n, **kw) for name, m in models.items()}
    first = next(iter(runs.values()))["results"]
    lines = [
        "| prompt | reference | " + " | ".join(models) + " |",
        "|---" * (2 + len(models)) + "|",
    ]
    for i, row in enumerate(first):
        cells = [_cell(row["prompt"]), _cell(row["reference"])]
        cells += [
            f"{'✓' if run['results'][i]['correct'] else '✗'} {_cell(run['results'][i]['answer'])}"
            for run in runs.values()
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "| exact match | | "
        + " | ".join(
            f"{sum(r['correct'] for r in run['results'])}/{run['n']}" for run in runs.values()
        )
        + " |"
    )
    return "\n".join(lines)
