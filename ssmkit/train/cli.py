"""``ssmkit train --config FILE [--set key=value ...] [--resume] [--nproc N]``.

``--nproc N`` (N > 1) re-launches itself under ``torchrun --nproc_per_node N``; under torchrun already
(or on several nodes, with torchrun's own ``--nnodes``/``--rdzv-endpoint``), run ``python -m ssmkit.train``
directly. Errors from bad configs exit with status 2 and one message.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="ssmkit train", description="train a model from a YAML config")
    p.add_argument("--config", required=True, help="YAML file of TrainConfig keys (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set max_steps=100 --set model_overrides.d_model=128")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in out_dir")
    p.add_argument("--nproc", type=int, default=1, help="processes on this machine (launches torchrun)")
    args = p.parse_args(argv)
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        rest = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")
                and not a.startswith("--nproc=")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "ssmkit.train", *rest]
        print("launching:", " ".join(cmd), flush=True)
        os.execv(sys.executable, cmd)

    from .config import TrainConfig
    from .distributed import teardown
    from .trainer import Trainer, TrainingError

    try:
        cfg = TrainConfig.from_yaml(args.config, overrides=args.overrides)
    except ValueError as exc:
        p.exit(2, f"ssmkit train: {exc}\n")
    try:
        trainer = Trainer(config=cfg, resume=args.resume)
        history = trainer.fit()
    except (ValueError, TrainingError) as exc:
        rank = os.environ.get("RANK", "0")
        teardown()
        p.exit(1, f"ssmkit train (rank {rank}): {exc}\n")
    evals = [r for r in history if r["kind"] == "eval"]
    last = f", val loss {evals[-1]['val_loss']:.4f} (ppl {evals[-1]['val_ppl']:.2f})" if evals else ""
    done = f"done: {trainer.step} steps, {trainer.tokens:,} tokens{last}; checkpoints in {trainer.ckpt_dir}"
    is_main = trainer.dist.is_main
    # Free the model, optimizer and FSDP state (and the collectives they hold) while the interpreter is
    # fully alive: gloo work objects freed during interpreter shutdown abort the process (SIGABRT).
    del trainer
    gc.collect()
    teardown(sync=True)
    if is_main:
        print(done)


if __name__ == "__main__":
    main()
