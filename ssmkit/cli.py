"""The ``ssmkit`` command line. Subcommands: ``env`` (the environment report), ``demo`` (the CPU
training demo), ``generate`` (text from a checkpoint), ``eval`` (lm-evaluation-harness tasks), ``convert``
(checkpoint layouts), ``data prepare`` (token shards), ``train`` (ssmkit.train.cli), ``plan`` (the memory
planner, ssmkit.train.planner) and ``workbook`` (ssmkit.workbook); demo, train, plan and workbook parse
their own options.

    ssmkit generate runs/cpu-tiny/checkpoints/latest --prompt "The for statement" --max-new-tokens 64
    ssmkit eval --model runs/cpu-tiny --tasks ssmkit_docstring_cloze,ssmkit_lastword --out runs/cpu-tiny/eval
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# ssmkit.hub.layouts.FORMATS, spelled out so `ssmkit --help` needs no torch import (a test keeps them equal)
CONVERT_FORMATS = ["hf", "mamba_ssm", "jamba", "zamba2"]


def _count(text: str) -> int:
    """argparse type of ``data prepare``'s counts: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _generate_parser(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser("generate", help="continue a prompt with a trained model (checkpoint or model dir)",
                         description="Print the prompt and its continuation, decoded.")
    gen.add_argument("checkpoint", metavar="CHECKPOINT",
                     help="a model directory (config.json), a Trainer checkpoint step_N/, a checkpoints/ "
                          "directory or its latest file, a run's out_dir, or a hub id")
    gen.add_argument("--prompt", required=True, help="the text to continue ('' starts a new document)")
    gen.add_argument("--max-new-tokens", type=lambda t: 0 if t.strip() == "0" else _count(t), default=64,
                     metavar="N", help="tokens to add (default 64; generation stops early at end-of-text)")
    gen.add_argument("--temperature", type=_number, default=0.8, metavar="T",
                     help="sampling temperature; 0 is greedy (default 0.8)")
    gen.add_argument("--top-k", type=_count, default=None, metavar="K", help="sample from the K most likely")
    gen.add_argument("--top-p", type=_number, default=None, metavar="P",
                     help="sample from the smallest set of tokens whose probability reaches P (0 < P <= 1)")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the sampling (default 0)")
    gen.add_argument("--tokenizer", default=None, metavar="NAME",
                     help="gpt2, byte, bpe-<N>, a hub id or a directory (default: the checkpoint's files)")
    gen.add_argument("--device", default="auto", help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N")
    gen.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: as saved)")
    return gen


def load_with_tokenizer(source: str, tokenizer: str | None, dtype=None, device=None):
    """(model, tokenizer name) behind a path a user gave ``ssmkit generate`` / ``eval``: a model directory,
    a checkpoint, a run's out_dir (a LoRA run: its base with the adapter merged in) or a hub id
    (:func:`ssmkit.train.load.load_model`). The tokenizer: ``tokenizer``, else the files saved with
    the model; none there is a ValueError naming the one trainer.json recorded."""
    from .data.tokenizers import TOKENIZER_FILES
    from .io import read_json
    from .train.load import load_model

    model, where = load_model(source, dtype=dtype, device=device)
    tok_dir = where.tokenizer_dir
    if tokenizer is None and where.kind != "hub" and \
            not any((tok_dir / f).is_file() for f in TOKENIZER_FILES):
        trained = None
        if where.step_dir is not None:
            state = read_json(where.step_dir / "trainer.json", "checkpoint state")
            trained = state.get("tokenizer") or (state.get("config") or {}).get("tokenizer")
        hint = f" (trainer.json says it was trained with {trained!r}: --tokenizer {trained})" if trained \
            else ""
        raise ValueError(f"{tok_dir} holds no tokenizer files; pass --tokenizer NAME, the tokenizer the "
                         f"model was trained with{hint}")
    return model, tokenizer or str(tok_dir)


def generate_text(args) -> str:
    """``ssmkit generate``: the checkpoint's model and tokenizer, the prompt continued, decoded. A user's
    mistake (no such checkpoint, no tokenizer, a tokenizer that does not fit) raises ValueError."""
    import torch

    from .data import get_tokenizer
    from .models import generate
    from .models.generate import check_sampling

    check_sampling(args.temperature, args.top_k, args.top_p)
    model, name = load_with_tokenizer(str(args.checkpoint), args.tokenizer, dtype=args.dtype,
                                      device=args.device)
    tok = get_tokenizer(name)
    vocab = model.config.vocab_size
    if len(tok) > vocab:
        raise ValueError(f"the tokenizer {name!r} has {len(tok):,} tokens, more than the model's vocabulary "
                         f"of {vocab:,}: it is not the tokenizer this model was trained with")
    ids = tok.encode(args.prompt, add_special_tokens=False) if args.prompt else []
    if not ids:                                       # '' starts a new document: the end-of-text token
        if tok.eos_token_id is None:
            raise ValueError("the prompt is empty and the tokenizer has no end-of-text token to start from")
        ids = [tok.eos_token_id]
    device = next(model.parameters()).device
    eos = tok.eos_token_id if tok.eos_token_id is not None and tok.eos_token_id < vocab else None
    out = generate(model, torch.tensor([ids], device=device), max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=eos,
                   generator=torch.Generator(device=device).manual_seed(args.seed))
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def _eval_parser(sub) -> argparse.ArgumentParser:
    ev = sub.add_parser("eval", help="score a model on lm-evaluation-harness tasks (offline ones included)",
                        description="Run lm-eval tasks on a model through the `ssmkit` lm-eval model; print "
                                    "the results as a markdown table. Offline tasks: ssmkit_docstring_cloze, "
                                    "ssmkit_lastword; lm-eval's own (hellaswag, piqa, arc_easy, "
                                    "arc_challenge, winogrande, lambada_openai, ...) need the hub or its "
                                    "datasets cache.")
    ev.add_argument("--model", required=True, metavar="PATH",
                    help="a model directory (config.json), a Trainer checkpoint step_N/, a checkpoints/ "
                         "directory or its latest file, a run's out_dir, or a hub id")
    ev.add_argument("--tasks", required=True, metavar="T1,T2",
                    help="comma-separated lm-eval task names")
    ev.add_argument("--batch-size", type=_count, default=8, metavar="N",
                    help="requests per forward pass (default 8)")
    ev.add_argument("--limit", type=_count, default=None, metavar="N", help="at most N items per task")
    ev.add_argument("--out", default=None, metavar="DIR", help="also write results.json and results.md there")
    ev.add_argument("--tokenizer", default=None, metavar="NAME",
                    help="gpt2, byte, bpe-<N>, a hub id or a directory (default: the checkpoint's files)")
    ev.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto")
    return ev


def eval_table(args) -> str:
    """``ssmkit eval``: the checkpoint behind ``--model`` scored on ``--tasks``; lm-eval's results written to
    ``--out``; the markdown table returned. A user's mistake (no such checkpoint, no tokenizer, an unknown
    task, a dataset out of reach) raises ValueError."""
    import contextlib

    from .eval.harness_run import lm_eval_table, run_lm_eval, task_names

    names = task_names(args.tasks)
    model, tokenizer = load_with_tokenizer(str(args.model), args.tokenizer, dtype="float32")
    with contextlib.redirect_stdout(sys.stderr):          # lm-eval prints progress: keep stdout for the table
        results = run_lm_eval(model, names, tokenizer=tokenizer, batch_size=args.batch_size,
                              limit=args.limit, out_dir=args.out, device=args.device)
    return lm_eval_table(results)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="ssmkit", description="train state-space language models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="torch, device, kernels and the backend of every op")
    sub.add_parser("demo", help="train a tiny model (--mixer mamba1, mamba2, mamba3 or hybrid) on CPU for a "
                                "few hundred steps, then sample; --help for options", add_help=False)
    _generate_parser(sub)
    _eval_parser(sub)
    sub.add_parser("train", help="train a model from a YAML config (see configs/); --help for options",
                   add_help=False)
    sub.add_parser("plan", help="per-GPU memory of a training step and the largest micro-batch that fits; "
                                "--help for options", add_help=False)
    sub.add_parser("workbook", help="run the notebooks headless with papermill; --help for options",
                   add_help=False)
    conv = sub.add_parser("convert", help="rewrite a checkpoint in the transformers (Mamba / Mamba2, Jamba, "
                                          "Zamba2) or mamba_ssm layout (hybrids included)")
    conv.add_argument("src", help="checkpoint directory (transformers or mamba_ssm layout) or hub id")
    conv.add_argument("dst", help="output directory: new, empty, or a checkpoint ssmkit wrote "
                                  "(replaced atomically)")
    conv.add_argument("--to", required=True, choices=CONVERT_FORMATS,
                      help="layout to write: hf (transformers' Mamba / FalconMamba / Mamba2), mamba_ssm "
                           "(MambaLMHeadModel, attention hybrids too), jamba, zamba2")
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
        from .io import describe_os_error, overlapping

        if Path(args.src).exists() and overlapping(args.src, args.dst):   # writing DST would destroy SRC
            parser.exit(1, f"ssmkit convert: source {args.src} and target {args.dst} overlap "
                           "(the same directory, or one inside the other); "
                           "choose a target outside the source\n")
        try:
            from .train.load import load_model

            model, where = load_model(args.src)             # a LoRA run: base + adapter, merged
            out = model.save_pretrained(args.dst, format=args.to,
                                        tokenizer_from=str(where.tokenizer_dir),
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
    elif args.command == "generate":
        if rest:
            parser.error(f"unrecognized arguments for generate: {' '.join(rest)}")
        from .io import describe_os_error

        try:
            text = generate_text(args)
        except ValueError as exc:               # no checkpoint, no tokenizer, a corrupt file, a bad value
            parser.exit(1, f"ssmkit generate: {exc}\n")
        except OSError as exc:
            parser.exit(1, f"ssmkit generate: {describe_os_error(exc)}\n")
        print(text)
    elif args.command == "eval":
        if rest:
            parser.error(f"unrecognized arguments for eval: {' '.join(rest)}")
        from .io import describe_os_error

        try:
            table = eval_table(args)
        except (ValueError, RuntimeError) as exc:   # no checkpoint/tokenizer, unknown task, dataset offline
            parser.exit(1, f"ssmkit eval: {' '.join(str(exc).split())}\n")
        except OSError as exc:
            parser.exit(1, f"ssmkit eval: {describe_os_error(exc)}\n")
        print(table, end="")
        if args.out:
            print(f"wrote {Path(args.out) / 'results.json'} and results.md")
    elif args.command == "demo":
        from .demo import main as demo_main

        demo_main(rest, prog="ssmkit demo")
    elif args.command == "train":
        from .train.cli import main as train_main

        train_main(rest)
    elif args.command == "plan":
        from .train.planner import main as plan_main

        sys.exit(plan_main(rest))
    elif args.command == "workbook":
        from .workbook import main as workbook_main

        workbook_main(rest)


if __name__ == "__main__":
    main()
