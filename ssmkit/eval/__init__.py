"""Evaluation: how good a model is and how fast it runs. The Trainer calls it for its evaluations;
the notebooks and benchmarks for their tables.

    from ssmkit import eval as ev
    ev.perplexity(model, val_loader, batches=20)   # {"loss": nats/token, "ppl", "batches"}
    ev.lm_loss(model, input_ids, labels)           # mean next-token cross-entropy, a scalar tensor
    ev.task_accuracy(model, ssmkit.data.make_task("mqar", vocab_size=64, seq_len=64), n=256, seed=1)
    ev.flops_per_token(model, seq_len=256)         # training FLOPs per token (6N + the scans)
    ev.mfu(flops, tokens_per_s, ev.peak_flops(device, "bf16"))   # None on CPUs
    ev.throughput(step, tokens_per_step=8 * 256)   # tokens/s: median over timed calls after warm-up
    ev.time_round_robin({"ours": a, "peer": b}, steps=7)  # seconds per call, peers interleaved
    ev.peak_memory_mb(device)                      # MiB: CUDA allocator peak, else peak RSS
    ev.summarize_run(history)                      # first/last val loss and ppl, median tokens/s
    ev.train_step_cost(model, seq_len=4096)        # {"tokens_per_s", "peak_mb", ...}: long context
    ev.generation_cost(model, prompt_len=4096)     # prefill s, decode tokens/s, peak MB, cache MB
    ev.run_lm_eval(model_or_dir, "ssmkit_lastword,ssmkit_docstring_cloze", tokenizer="gpt2",
                   out_dir=d)
    print(ev.lm_eval_table(results))               # lm-eval's results as markdown
    ev.OFFLINE_TASKS, ev.PLAN_TASKS                # lm-eval tasks shipped with ssmkit; the plan's
    ev.completion_loss(model, "data/arith-val")    # SFT: held-out loss on the completion tokens
    ev.exact_match(model, "data/arith-val", n=100)  # greedy answers == references: {"accuracy"...}
    print(ev.generation_table({"before": a, "after": b}, "data/arith-val", n=5))

Modules: ``loss`` (loss, perplexity), ``tasks`` (synthetic-task accuracy), ``flops`` (FLOPs, peak,
MFU), ``measure`` (timing, memory), ``summary`` (a Trainer history's headline numbers),
``long_context`` (training and generation cost against length, per-call peak memory, crossover,
length extrapolation), ``harness`` (lm-evaluation-harness's ``ssmkit`` model; the one module
importing lm_eval, on first use), ``harness_run`` (run_lm_eval, its table, lm-eval's CLI),
``offline_tasks`` (the lm-eval tasks built from the embedded corpus, in ``lm_tasks/``), ``sft``
(completion loss, exact match and generations on SFT data). This layer sits above models, hub and
data and below train: it imports none of train, workbook or cli.
"""

from .flops import PEAK_BF16_FLOPS, flops_per_token, mfu, peak_flops
from .harness_run import lm_eval_table, run_lm_eval
from .long_context import (
    crossover,
    generation_cost,
    length_extrapolation,
    peak_rss_mb,
    train_step_cost,
)
from .loss import lm_loss, perplexity
from .measure import peak_memory_mb, throughput, time_round_robin
from .offline_tasks import OFFLINE_TASKS, PLAN_TASKS, TASKS_DIR, build_offline_tasks
from .sft import completion_loss, exact_match, generation_table
from .summary import summarize_run
from .tasks import answer_accuracy, task_accuracy

__all__ = [
    "OFFLINE_TASKS",
    "PEAK_BF16_FLOPS",
    "PLAN_TASKS",
    "TASKS_DIR",
    "answer_accuracy",
    "build_offline_tasks",
    "completion_loss",
    "crossover",
    "exact_match",
    "flops_per_token",
    "generation_cost",
    "generation_table",
    "length_extrapolation",
    "lm_eval_table",
    "lm_loss",
    "mfu",
    "peak_flops",
    "peak_memory_mb",
    "peak_rss_mb",
    "perplexity",
    "run_lm_eval",
    "summarize_run",
    "task_accuracy",
    "throughput",
    "time_round_robin",
    "train_step_cost",
]
