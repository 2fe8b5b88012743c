"""``ssmkit train --config FILE [--set key=value ...] [--resume] [--nproc N]``.

``--nproc N`` (N > 1) runs torchrun's launcher (``--standalone --nproc_per_node N``) in this
process; under torchrun already (or on several nodes, with torchrun's own
``--nnodes``/``--rdzv-endpoint``), run ``python -m ssmkit.train`` directly. A user's error (bad
config, a locked or foreign out_dir, a corrupt checkpoint, a full disk) is one line on stderr: exit
status 2 for a bad config or ``--nproc``, 1 otherwise. Under ``--nproc`` each rank's line is
collected and printed once at the end, instead of torchrun's traceback. The options are declared
once, in :func:`add_arguments` (``ssmkit train`` takes them from there too).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

RANK_ERRORS = "SSMKIT_RANK_ERRORS"  # a directory where each rank leaves its one-line error


def _launch(nproc: int, rest: list[str]) -> int:
    """Run ``python -m ssmkit.train REST`` in ``nproc`` processes; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    errors = Path(tempfile.mkdtemp(prefix="ssmkit-ranks-"))
    os.environ[RANK_ERRORS] = str(errors)
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc_per_node={nproc}", "-m", "ssmkit.train", *rest]
    )
    print(
        f"launching {nproc} processes: "
        f"torchrun --standalone --nproc_per_node={nproc} -m ssmkit.train {' '.join(rest)}",
        flush=True,
    )
    logging.getLogger("torch.distributed.elastic").setLevel(
        logging.CRITICAL
    )  # we report failures below
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        lines = []
        for rank, failure in sorted(exc.failures.items()):
            own = errors / f"rank_{rank}.txt"
            why = (
                own.read_text().strip()
                if own.exists()
                else (
                    f"exit status {failure.exitcode}" if failure.exitcode >= 0 else failure.message
                )
            )
            lines.append(f"  rank {rank}: {why}")
        print(
            f"ssmkit train: {len(lines)} of {nproc} processes failed:\n" + "\n".join(lines),
            file=sys.stderr,
        )
        return 1
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def _fail(status: int, message: str):
    """Exit with one line; under the launcher also leave it where the launcher collects it."""
    rank = os.environ.get("RANK")
    if rank is not None and os.environ.get(RANK_ERRORS):
        try:
            (Path(os.environ[RANK_ERRORS]) / f"rank_{rank}.txt").write_text(message + "\n")
        except OSError:
            pass
    where = f" (rank {rank})" if rank is not None else ""
    print(f"ssmkit train{where}: {message}", file=sys.stderr)
    sys.exit(status)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``ssmkit train`` / ``python -m ssmkit.train``."""
    p.add_argument("--config", required=True, help="YAML file of TrainConfig keys (see configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, e.g. --set max_steps=100 --set model_overrides.d_model=128"
        " --set model_overrides.mamba2.d_state=64",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in out_dir"
    )
    p.add_argument(
        "--nproc", type=int, default=1, help="processes on this machine (launches torchrun)"
    )
    return p


def run(args) -> int:
    """Train as ``args`` says (under ``--nproc N``: launch N processes that do); returns the exit
    status. A user's error is one line on stderr (:func:`_fail`)."""
    if args.nproc < 1:
        _fail(2, f"--nproc must be >= 1 (processes on this machine); got {args.nproc}")
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        sets = [word for item in args.overrides for word in ("--set", item)]
        resume = ["--resume"] if args.resume else []
        return _launch(args.nproc, ["--config", args.config, *sets, *resume])

    from ..io import Stopped
    from .config import TrainConfig
    from .distributed import teardown
    from .trainer import Trainer, TrainingError

    try:
        cfg = TrainConfig.from_yaml(args.config, overrides=args.overrides)
    except ValueError as exc:
        _fail(2, str(exc))
    try:
        trainer = Trainer(config=cfg)
        if args.resume:  # every rank: the checks and the load are collectives
            trainer.resume()
        history = trainer.fit()
    except (ValueError, TrainingError, OSError) as exc:
        from ..io import describe_os_error

        teardown()
        _fail(1, describe_os_error(exc) if isinstance(exc, OSError) else str(exc))
    except Stopped as exc:  # Ctrl-C: where it stopped and the last checkpoint, in one line
        teardown()
        ckpt = getattr(exc, "checkpoint", None)
        kept = f"last checkpoint {ckpt} (--resume goes on from it)" if ckpt else "no checkpoint"
        _fail(128 + exc.signum, f"{exc.where}; {kept}" if hasattr(exc, "where") else str(exc))
    evals = [r for r in history if r["kind"] == "eval"]
    last = (
        f", val loss {evals[-1]['val_loss']:.4f} (ppl {evals[-1]['val_ppl']:.2f})" if evals else ""
    )
    done = (
        f"done: {trainer.step} steps, {trainer.tokens:,} tokens{last}; "
        f"checkpoints in {trainer.ckpt_dir}"
    )
    is_main = trainer.dist.is_main
    # Free the model, optimizer and FSDP state (and the collectives they hold) while the interpreter
    # is fully alive: gloo work objects freed during interpreter shutdown abort the process
    # (SIGABRT).
    del trainer
    gc.collect()
    teardown(sync=True)
    if is_main:
        print(done)
    return 0


def main(argv=None):
    """``python -m ssmkit.train ARGS`` (what torchrun starts on each rank): parse, :func:`run`."""
    parser = argparse.ArgumentParser(
        prog="ssmkit train", description="train a model from a YAML config"
    )
    status = run(add_arguments(parser).parse_args(sys.argv[1:] if argv is None else argv))
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
