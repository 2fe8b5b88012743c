"""What the Trainer costs: its tokens/s against a bare hand-written loop, same model, data and
recipe.

    python benchmarks/trainer_overhead.py [--windows 10] [--steps 5] [--mixer mamba1|mamba2]

Both run in one process, interleaved: the Trainer logs every ``--steps`` steps, and a callback then
runs ``--steps`` steps of the bare loop (AdamW with the same groups, the same lr schedule, clipping,
gradient accumulation, the same loader). Each side is timed over its own windows only (the Trainer
excludes callback time from its rates); the medians and the median of window-by-window ratios are
compared. Target: ratio >= 0.95.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ssmkit
from ssmkit.data import TokenLoader, prepare
from ssmkit.eval import lm_loss
from ssmkit.train import TrainConfig, Trainer, build_optimizer, lr_at


class BareLoop:
    """The loop a user would write by hand, advanced ``n`` steps at a time."""

    def __init__(self, cfg: TrainConfig, data: Path, vocab: int):
        torch.manual_seed(cfg.seed)
        self.model = ssmkit.build_model(
            ssmkit.ModelConfig.preset(cfg.model, vocab_size=vocab, **cfg.model_overrides)
        )
        self.opt = build_optimizer(self.model, cfg)
        self.batches = iter(TokenLoader(data, cfg.seq_len, cfg.micro_batch, seed=cfg.seed))
        self.cfg, self.step, self.rates = cfg, 0, []
        self.accum = cfg.grad_accum(1)

    def run(self, n: int):
        t0 = time.perf_counter()
        for _ in range(n):
            for group in self.opt.param_groups:
                group["lr"] = lr_at(self.step, self.cfg)
            for _ in range(self.accum):
                x, y = next(self.batches)
                (lm_loss(self.model, x, y) / self.accum).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
        self.rates.append(n * self.cfg.batch_tokens / (time.perf_counter() - t0))


class Interleave:
    """Trainer callback: after each Trainer window, one window of the bare loop."""

    def __init__(self, bare: BareLoop, steps: int):
        self.bare, self.steps, self.rates = bare, steps, []

    def on_log(self, trainer, record):
        self.rates.append(record["tokens_per_s"])
        self.bare.run(self.steps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--windows", type=int, default=10, help="timed windows per side (after one warm-up window)"
    )
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per window")
    p.add_argument("--mixer", default="mamba1", choices=["mamba1", "mamba2"])
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shards"
        index = prepare("stdlib-docs", "byte", data, max_tokens=1_500_000, progress=False)
        preset = "tiny" if args.mixer == "mamba1" else "tiny-mamba2"
        steps = (args.windows + 1) * args.steps
        cfg = TrainConfig(
            model=preset,
            model_overrides={"d_model": 128, "n_layer": 4},
            data=str(data),
            seq_len=256,
            micro_batch=8,
            batch_tokens=4096,
            warmup_steps=5,
            max_steps=steps,
            log_every=args.steps,
            eval_every=0,
            eval_batches=1,
            progress=False,
            out_dir=str(Path(tmp) / "run"),
        )
        bare = BareLoop(cfg, data, index["vocab_size"])
        inter = Interleave(bare, args.steps)
        trainer = Trainer(config=cfg, callbacks=[inter])
        trainer.fit()
    trainer_rates, bare_rates = inter.rates[1:], bare.rates[1:]  # drop the warm-up window
    t, b = statistics.median(trainer_rates), statistics.median(bare_rates)
    # neighbours share the load
    paired = statistics.median(x / y for x, y in zip(trainer_rates, bare_rates))
    print(
        f"model: {preset} d_model 128, 4 layers, {trainer.model.num_parameters():,} params; "
        f"batch 4096 tokens (2 x 8 x 256), fp32, {torch.get_num_threads()} threads"
    )
    print(f"{'':8}{'median tok/s':>14}  windows")
    print(f"{'Trainer':8}{t:>14,.0f}  {', '.join(f'{r:,.0f}' for r in trainer_rates)}")
    print(f"{'bare':8}{b:>14,.0f}  {', '.join(f'{r:,.0f}' for r in bare_rates)}")
    print(
        f"median of window-by-window ratios: {paired:.3f} "
        "(robust to load drift on a shared machine)"
    )
    print(
        json.dumps(
            {
                "trainer_tok_s": round(t),
                "bare_tok_s": round(b),
                "ratio": round(t / b, 3),
                "paired_ratio": round(paired, 3),
                "target": 0.95,
            }
        )
    )


if __name__ == "__main__":
    main()
