"""The ``ssmkit`` command line. Subcommands so far: ``env`` (the environment report), ``demo`` (the
CPU training demo) and ``convert`` (checkpoint layouts); ``train``, ``data``, ``eval``, ``bench`` and
``workbook`` join as their modules land."""

from __future__ import annotations

import argparse
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="ssmkit", description="train state-space language models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="torch, device, kernels and the backend of every op")
    sub.add_parser("demo", help="train the tiny preset on CPU for a few hundred steps, then sample",
                   add_help=False)
    conv = sub.add_parser("convert", help="rewrite a checkpoint in the transformers or mamba_ssm layout")
    conv.add_argument("src", help="checkpoint directory (transformers or mamba_ssm layout) or hub id")
    conv.add_argument("dst", help="output directory (replaced atomically)")
    conv.add_argument("--to", required=True, choices=["hf", "mamba_ssm"], help="layout to write")
    args, rest = parser.parse_known_args(argv)
    if args.command == "env":
        if rest:
            parser.error(f"unrecognized arguments for env: {' '.join(rest)}")
        from . import env_report

        print(env_report())
    elif args.command == "convert":
        if rest:
            parser.error(f"unrecognized arguments for convert: {' '.join(rest)}")
        from .hub import CheckpointError, from_pretrained

        try:
            model = from_pretrained(args.src)
            out = model.save_pretrained(args.dst, format=args.to, tokenizer_from=args.src)
        except CheckpointError as exc:
            parser.exit(1, f"ssmkit convert: {exc}\n")
        print(f"wrote {out} ({args.to} layout, {model.num_parameters():,} parameters)")
    elif args.command == "demo":
        from .demo import main as demo_main

        demo_main(rest)


if __name__ == "__main__":
    main()
