"""The ``ssmkit`` command line. Subcommands so far: ``env`` (the environment report), ``demo`` (the
CPU training demo), ``convert`` (checkpoint layouts), ``data prepare`` (token shards), ``train``
(ssmkit.train.cli) and ``workbook`` (ssmkit.workbook); the last two parse their own options."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _count(text: str) -> int:
    """argparse type of ``data prepare``'s counts: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="ssmkit", description="train state-space language models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="torch, device, kernels and the backend of every op")
    sub.add_parser("demo", help="train the tiny preset on CPU for a few hundred steps, then sample",
                   add_help=False)
    sub.add_parser("train", help="train a model from a YAML config (see configs/); --help for options",
                   add_help=False)
    sub.add_parser("workbook", help="run the notebooks headless with papermill; --help for options",
                   add_help=False)
    conv = sub.add_parser("convert", help="rewrite a checkpoint in the transformers or mamba_ssm layout")
    conv.add_argument("src", help="checkpoint directory (transformers or mamba_ssm layout) or hub id")
    conv.add_argument("dst", help="output directory: new, empty, or a checkpoint ssmkit wrote "
                                  "(replaced atomically)")
    conv.add_argument("--to", required=True, choices=["hf", "mamba_ssm"], help="layout to write")
    conv.add_argument("--overwrite", action="store_true",
                      help="DST holds other files too: replace only the checkpoint's files in it, "
                           "keep the rest")
    data = sub.add_parser("data", help="data tools").add_subparsers(dest="data_command", required=True)
    prep = data.add_parser("prepare", help="tokenize a source into packed token shards (resumable)")
    prep.add_argument("--source", default="stdlib-docs",
                      help="stdlib-docs, a remote corpus name, or a local path")
    prep.add_argument("--tokenizer", default="gpt2", help="gpt2, byte, bpe-<N>, a hub id or a directory")
    prep.add_argument("--out", required=True, help="output directory (re-running resumes)")
    prep.add_argument("--split", default="train", choices=["train", "validation", "all"])
    prep.add_argument("--max-tokens", type=_count, default=None, help="stop after this many tokens")
    prep.add_argument("--shard-tokens", type=_count, default=1 << 24, help="tokens per shard")
    prep.add_argument("--workers", type=_count, default=1, help="tokenizer processes")
    prep.add_argument("--lock-wait", type=float, default=0.0, metavar="SECONDS",
                      help="wait this long for another prepare into --out to finish (default: fail at once)")
    prep.add_argument("--mds-seq-len", type=_count, default=None, metavar="N",
                      help="also write a MosaicML streaming (MDS) copy of N+1-token windows into OUT/mds")
    args, rest = parser.parse_known_args(argv)
    if args.command == "env":
        if rest:
            parser.error(f"unrecognized arguments for env: {' '.join(rest)}")
        from .env import env_report

        print(env_report())
    elif args.command == "convert":
        if rest:
            parser.error(f"unrecognized arguments for convert: {' '.join(rest)}")
        from .hub import from_pretrained
        from .io import describe_os_error, overlapping

        if Path(args.src).exists() and overlapping(args.src, args.dst):   # writing DST would destroy SRC
            parser.exit(1, f"ssmkit convert: source {args.src} and target {args.dst} overlap "
                           "(the same directory, or one inside the other); "
                           "choose a target outside the source\n")
        try:
            model = from_pretrained(args.src)
            out = model.save_pretrained(args.dst, format=args.to, tokenizer_from=args.src,
                                        overwrite=args.overwrite)
        except ValueError as exc:               # CheckpointError, a refused target, an unsupported layout
            parser.exit(1, f"ssmkit convert: {exc}\n")
        except OSError as exc:                  # disk full, read-only, permission denied
            parser.exit(1, f"ssmkit convert: {describe_os_error(exc)}\n")
        print(f"wrote {out} ({args.to} layout, {model.num_parameters():,} parameters)")
    elif args.command == "data":
        if rest:
            parser.error(f"unrecognized arguments for data prepare: {' '.join(rest)}")
        from .data import prepare
        from .io import describe_os_error

        # the user's mistakes (bad source, corrupt file, busy directory, full disk): one line, status 1
        try:
            index = prepare(args.source, args.tokenizer, args.out, split=args.split,
                            max_tokens=args.max_tokens, shard_tokens=args.shard_tokens,
                            workers=args.workers, mds_seq_len=args.mds_seq_len, lock_wait=args.lock_wait)
        except (ValueError, RuntimeError, OSError) as exc:
            # RuntimeError: the offline GPT-2 files are missing
            message = describe_os_error(exc) if isinstance(exc, OSError) else " ".join(str(exc).split("\n"))
            parser.exit(1, f"ssmkit data prepare: {message}\n")
        empty = f" ({index['empty_documents']:,} blank ones skipped)" if index.get("empty_documents") else ""
        print(f"{index['total_tokens']:,} tokens from {index['documents']:,} documents{empty}, "
              f"dtype {index['dtype']}")
        if args.mds_seq_len is not None:
            print(f"MDS: {args.out}/mds, samples of {args.mds_seq_len + 1} tokens "
                  "(streaming.StreamingDataset)")
    elif args.command == "demo":
        from .demo import main as demo_main

        demo_main(rest)
    elif args.command == "train":
        from .train.cli import main as train_main

        train_main(rest)
    elif args.command == "workbook":
        from .workbook import main as workbook_main

        workbook_main(rest)


if __name__ == "__main__":
    main()
