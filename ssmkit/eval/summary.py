"""The headline numbers of a training run, from the Trainer's history (its metrics.jsonl records)."""

from __future__ import annotations


def summarize_run(records: list[dict]) -> dict:
    """The headline numbers of a Trainer history: tokens seen, first and last validation loss, the last
    perplexity, and the median training tokens/s (``None`` where the history has no such records)."""
    evals = [r for r in records if r.get("kind") == "eval"]
    rates = sorted(r["tokens_per_s"] for r in records if r.get("kind") == "train")
    return {"tokens": evals[-1]["tokens"] if evals else None,
            "first_val_loss": round(evals[0]["val_loss"], 4) if evals else None,
            "val_loss": round(evals[-1]["val_loss"], 4) if evals else None,
            "val_ppl": round(evals[-1]["val_ppl"], 2) if evals else None,
            "train_tok_s": round(rates[len(rates) // 2]) if rates else None}
