"""Evaluation: how good a model is and how fast it runs. The Trainer calls it for its evaluations; the
notebooks and benchmarks for their tables.

    ssmkit.eval.summarize_run(history)     # first/last validation loss, perplexity, median tokens/s
"""

from .summary import summarize_run

__all__ = ["summarize_run"]
