"""The headline numbers of a training run, from the Trainer's history (its metrics.jsonl
records)."""

from __future__ import annotations

import statistics

# per-rank and fp16 numbers a training record may carry; the summary takes them from the last one
LAST_RECORD_KEYS = ("rank_peak_mem_mb", "rank_state_mb", "grad_scale", "scaler_skipped")


def summarize_run(records: list[dict]) -> dict:
    """The headline numbers of a Trainer history (``Trainer.fit()``'s records, or a run's
    metrics.jsonl):

    ``steps`` and ``tokens`` (the last record's; 0 without records), ``final_loss`` (the last
    training loss), ``first_val_loss`` / ``val_loss`` / ``val_ppl`` (the first and last
    evaluations), ``train_tok_s`` (the median training tokens/s, the higher middle one of an even
    count, as an int: a noisy rate), ``peak_mem_mb`` (the largest recorded, rank 0's), and from the
    last training record, where it has them, every rank's ``rank_peak_mem_mb`` / ``rank_state_mb``
    and fp16's ``grad_scale`` / ``scaler_skipped``. A number the history has no record for is None.
    Values are as recorded, not rounded."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    counted = [r for r in records if r.get("kind") in ("train", "eval")]
    rates = [r["tokens_per_s"] for r in train]
    out = {
        "steps": max((r["step"] for r in counted), default=0),
        "tokens": max((r["tokens"] for r in counted), default=0),
        "final_loss": train[-1]["loss"] if train else None,
        "first_val_loss": evals[0]["val_loss"] if evals else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_ppl": evals[-1]["val_ppl"] if evals else None,
        "train_tok_s": round(statistics.median_high(rates)) if rates else None,
        "peak_mem_mb": max(
            (r["peak_mem_mb"] for r in train if r.get("peak_mem_mb") is not None), default=None
        ),
    }
    out.update({k: train[-1][k] for k in LAST_RECORD_KEYS if train and k in train[-1]})
    return out
