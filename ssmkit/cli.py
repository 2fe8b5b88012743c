"""The ``ssmkit`` command line. Subcommands so far: ``env`` (the environment report) and ``demo``
(the CPU training demo); ``train``, ``data``, ``eval``, ``bench``, ``convert`` and ``workbook`` join
as their modules land."""

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
    args, rest = parser.parse_known_args(argv)
    if args.command == "env":
        if rest:
            parser.error(f"unrecognized arguments for env: {' '.join(rest)}")
        from . import env_report

        print(env_report())
    elif args.command == "demo":
        from .demo import main as demo_main

        demo_main(rest)


if __name__ == "__main__":
    main()
