"""``ssmkit train --config FILE [--set key=value ...] [--resume] [--nproc N] [--nnodes M
--rdzv-endpoint HOST:PORT [--rdzv-id ID] [--rdzv-timeout S]]``.

``--nproc N`` (N > 1) runs torchrun's launcher (``--standalone --nproc-per-node N``) in this
process. ``--nnodes M`` (M > 1): the same command runs on each of M machines (Slurm's ``srun`` in
scripts/slurm/train.sbatch), and each launches its N processes after torchrun's c10d rendezvous at
``--rdzv-endpoint`` (a port on one of the machines, the same for all) has gathered all M:

    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        --rdzv-id ID --rdzv-conf join_timeout=S,read_timeout=S -m ssmkit.train ...

The rendezvous assigns the machines' ranks (RANK counts over all machines, LOCAL_RANK within one);
a machine that is not there within ``--rdzv-timeout`` seconds fails the others with one line naming
the endpoint. Under torchrun already, run ``python -m ssmkit.train`` directly (the launcher
options are then ignored). A user's error (bad config, a locked or foreign out_dir, a corrupt
checkpoint, a full disk) is one line on stderr: exit status 2 for a bad config or launcher option, 1
otherwise. Under the launcher each rank's line is collected and printed once at the end, instead of
torchrun's traceback. The options are declared once, in :func:`add_arguments` (``ssmkit train``
takes them from there too).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

RANK_ERRORS = "SSMKIT_RANK_ERRORS"  # a directory where each rank leaves its one-line error
RDZV_ID = "ssmkit"  # the rendezvous' name when --rdzv-id is not given (Slurm: the job id)
RDZV_TIMEOUT = 600.0  # seconds to wait for every machine: torchrun's own join_timeout


def torchrun_args(
    nproc: int,
    nnodes: int | str = 1,
    endpoint: str | None = None,
    rdzv_id: str = RDZV_ID,
    timeout: float = RDZV_TIMEOUT,
) -> list[str]:
    """torchrun's options for ``nproc`` processes on this machine, one of ``nnodes``: standalone
    (a rendezvous of its own) for one machine; for several, torchrun's c10d rendezvous at
    ``endpoint`` (``HOST:PORT``) under ``rdzv_id``, waiting ``timeout`` seconds for every machine
    (``join_timeout``) and for the rendezvous' store (``read_timeout``: a machine started before the
    one that hosts it waits that long). ``nnodes`` may be a shell variable (``"$SLURM_NNODES"``) for
    a command shown, not run."""
    if nnodes == 1:
        return ["--standalone", f"--nproc-per-node={nproc}"]
    wait = f"{timeout:g}"
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=join_timeout={wait},read_timeout={wait}",
    ]


def _launch(launcher: list[str], rest: list[str], nproc: int, where: str | None = None) -> int:
    """Run ``torchrun LAUNCHER -m ssmkit.train REST`` in this process (torchrun's own code, not a
    subprocess); returns the exit status. ``where``: the rendezvous of several machines in words
    (for the messages; None: this machine alone)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    errors = Path(tempfile.mkdtemp(prefix="ssmkit-ranks-"))
    os.environ[RANK_ERRORS] = str(errors)
    words = [*launcher, "-m", "ssmkit.train", *rest]
    args = get_args_parser().parse_args(words)
    plural = "es" if nproc > 1 else ""
    print(f"launching {nproc} process{plural}: torchrun {' '.join(words)}", flush=True)
    logging.getLogger("torch.distributed.elastic").setLevel(
        logging.CRITICAL
    )  # we report failures below
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        lines = []
        for rank, failure in sorted(exc.failures.items()):  # global ranks
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
            f"ssmkit train: {len(lines)} of {nproc} processes"
            f"{' on this machine' if where else ''} failed:\n" + "\n".join(lines),
            file=sys.stderr,
        )
        return 1
    except RendezvousError as exc:  # a machine missing, the endpoint unreachable
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(
            f"ssmkit train: the rendezvous {where or 'of this machine'} failed "
            f"({type(exc).__name__}: {first}); "
            "check that every machine runs the same command with the same --nnodes, "
            "--rdzv-endpoint and --rdzv-id, that the endpoint's host is one of them and its port "
            "is free there and reachable from the others, or raise --rdzv-timeout",
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
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines that run this same command together (each with --nproc processes)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="with --nnodes > 1: where the machines meet (torchrun's c10d rendezvous), a free "
        "port on one of them, e.g. the first node of a Slurm job",
    )
    p.add_argument(
        "--rdzv-id",
        default=RDZV_ID,
        help=f"with --nnodes > 1: the run's name at the rendezvous, the same on every machine "
        f"(Slurm: the job id; default {RDZV_ID})",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=RDZV_TIMEOUT,
        metavar="SECONDS",
        help=f"with --nnodes > 1: how long to wait for every machine before failing "
        f"(default {RDZV_TIMEOUT:g})",
    )
    return p


def _launcher(args) -> tuple[list[str], str | None] | None:
    """torchrun's options for the launcher options of ``args`` and the rendezvous in words, or None
    to train in this process (one process on one machine, or under torchrun already); a bad option
    exits with status 2."""
    from .. import checks

    try:
        nproc, nnodes = args.nproc, args.nnodes  # ints: argparse's type
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1 (processes on this machine); got {nproc}")
        if nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1 (machines in the run); got {nnodes}")
        if nnodes > 1:
            if args.rdzv_endpoint is None:
                raise ValueError(
                    f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: where the machines meet "
                    "(a free port on one of them, the same on every machine)"
                )
            checks.endpoint(args.rdzv_endpoint, "--rdzv-endpoint")
            checks.number(args.rdzv_timeout, "--rdzv-timeout", low=0, low_open=True)
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.rdzv_id or ""):
                raise ValueError(
                    f"--rdzv-id must be letters, digits, '_', '.' or '-' (e.g. a Slurm job id); "
                    f"got {args.rdzv_id!r}"
                )
    except ValueError as exc:
        _fail(2, str(exc))
    if "LOCAL_RANK" in os.environ or (nproc == 1 and nnodes == 1):
        return None
    launcher = torchrun_args(nproc, nnodes, args.rdzv_endpoint, args.rdzv_id, args.rdzv_timeout)
    where = (
        None
        if nnodes == 1
        else f"of {nnodes} machines at {args.rdzv_endpoint} (id {args.rdzv_id}, "
        f"waited up to {args.rdzv_timeout:g} s)"
    )
    return launcher, where


def run(args) -> int:
    """Train as ``args`` says (under ``--nproc N`` or ``--nnodes M``: launch the N processes of
    this machine that do); returns the exit status. A user's error is one line on stderr
    (:func:`_fail`)."""
    launch = _launcher(args)
    if launch is not None:
        sets = [word for item in args.overrides for word in ("--set", item)]
        resume = ["--resume"] if args.resume else []
        return _launch(launch[0], ["--config", args.config, *sets, *resume], args.nproc, launch[1])

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
