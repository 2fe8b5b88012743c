"""The ``ssmkit`` command: one table, :data:`COMMANDS`, from each command to the line that
``ssmkit --help`` shows, the function that declares its options and the function that runs it.

    ssmkit --help                  every command, one line each
    ssmkit CMD --help              that command's options (data prepare, workbook run: two words)
    ssmkit generate runs/cpu-tiny/checkpoints/latest --prompt "The for statement" \
        --max-new-tokens 64
    ssmkit eval --model runs/cpu-tiny --tasks ssmkit_docstring_cloze,ssmkit_lastword \
        --out runs/cpu-tiny/eval

Each command's options are declared once, by one function that adds them to an ``argparse``
parser: env, generate, eval, convert and data prepare here; train, plan, demo and the workbook's
run, strip and build in their own modules, whose ``main`` builds its parser from the same function
(``python -m ssmkit.train``, what torchrun starts on each rank; ``python -m ssmkit.demo``;
``python -m ssmkit.workbook``). A run function takes the parsed options and returns the exit
status (0 or None: success); a user's mistake is one line on stderr. What a command does not catch
:func:`main` prints as one line too, never a traceback, unless ``ssmkit --debug CMD ...`` asks for
it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import NamedTuple


class Command(NamedTuple):
    """One ``ssmkit`` command. Its functions are named ``"module:function"`` and imported only when
    the command runs, so ``ssmkit --help`` imports none of them (``ssmkit.train`` alone brings in
    torch.distributed, ``ssmkit.workbook`` the whole workbook)."""

    help: str  # its line in `ssmkit --help`, its description in `ssmkit CMD --help`
    options: str | None  # function(parser) adding the command's options; None: it takes none
    run: str  # function(parsed options) -> exit status (0 or None: success)


COMMANDS = {
    "env": Command(
        "torch, device, kernels and the backend of every op", None, "ssmkit.cli:run_env"
    ),
    "demo": Command(
        "train a tiny model (--mixer mamba1, mamba2, mamba3 or hybrid) on CPU for a "
        "few hundred steps, then sample",
        "ssmkit.demo:add_arguments",
        "ssmkit.demo:run",
    ),
    "data prepare": Command(
        "tokenize a source into packed token shards (resumable)",
        "ssmkit.cli:data_prepare_options",
        "ssmkit.cli:run_data_prepare",
    ),
    "train": Command(
        "train a model from a YAML config (see configs/)",
        "ssmkit.train.cli:add_arguments",
        "ssmkit.train.cli:run",
    ),
    "plan": Command(
        "per-GPU memory of a training step and the largest micro-batch that fits",
        "ssmkit.train.planner:add_arguments",
        "ssmkit.train.planner:run",
    ),
    "generate": Command(
        "continue a prompt with a trained model (checkpoint or model dir)",
        "ssmkit.cli:generate_options",
        "ssmkit.cli:run_generate",
    ),
    "eval": Command(
        "score a model on lm-evaluation-harness tasks (offline ones included)",
        "ssmkit.cli:eval_options",
        "ssmkit.cli:run_eval",
    ),
    "convert": Command(
        "rewrite a checkpoint in the transformers (Mamba / Mamba2, Jamba, Zamba2) "
        "or mamba_ssm layout (hybrids included)",
        "ssmkit.cli:convert_options",
        "ssmkit.cli:run_convert",
    ),
    "workbook run": Command(
        "run the notebooks headless with papermill into runs/NAME/, and write summary.md",
        "ssmkit.workbook.cli:add_run_arguments",
        "ssmkit.workbook.cli:run",
    ),
    "workbook strip": Command(
        "clear the notebooks' outputs and execution counts in place",
        "ssmkit.workbook.cli:add_strip_arguments",
        "ssmkit.workbook.cli:strip",
    ),
    "workbook build": Command(
        "write the student, solution or instructor copies of the notebooks (workshops)",
        "ssmkit.workbook.cli:add_build_arguments",
        "ssmkit.workbook.cli:build",
    ),
}

# ssmkit.hub.layouts.FORMATS, spelled out so `ssmkit --help` needs no torch import (a test keeps
# them equal)
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


def generate_options(gen: argparse.ArgumentParser) -> None:
    """The options of ``ssmkit generate``."""
    gen.description = "Print the prompt and its continuation, decoded."
    gen.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a model directory (config.json), a Trainer checkpoint step_N/, a checkpoints/ "
        "directory or its latest file, a run's out_dir, or a hub id",
    )
    gen.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="the text to continue ('' starts a new document); repeat it for several prompts",
    )
    gen.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help="more prompts, one per line (UTF-8). Several prompts are generated together "
        "(packed into one prefill, then decoded as one batch) and printed as one JSON line "
        'each: {"prompt": ..., "text": ...}',
    )
    gen.add_argument(
        "--max-new-tokens",
        type=lambda t: 0 if t.strip() == "0" else _count(t),
        default=64,
        metavar="N",
        help="tokens to add (default 64; generation stops early at end-of-text)",
    )
    gen.add_argument(
        "--temperature",
        type=_number,
        default=0.8,
        metavar="T",
        help="sampling temperature; 0 is greedy (default 0.8)",
    )
    gen.add_argument(
        "--top-k", type=_count, default=None, metavar="K", help="sample from the K most likely"
    )
    gen.add_argument(
        "--top-p",
        type=_number,
        default=None,
        metavar="P",
        help="sample from the smallest set of tokens whose probability reaches P (0 < P <= 1)",
    )
    gen.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of the sampling (default 0)"
    )
    gen.add_argument(
        "--tokenizer",
        default=None,
        metavar="NAME",
        help="gpt2, byte, bpe-<N>, a hub id or a directory (default: the checkpoint's files)",
    )
    gen.add_argument(
        "--device", default="auto", help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N"
    )
    gen.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: as saved)")


def load_with_tokenizer(source: str, tokenizer: str | None, dtype=None, device=None):
    """(model, tokenizer name) behind a path a user gave ``ssmkit generate`` / ``eval``: a model
    directory, a checkpoint, a run's out_dir (a LoRA run: its base with the adapter merged in) or a
    hub id (:func:`ssmkit.train.load.load_model`). The tokenizer: ``tokenizer``, else the files
    saved with the model; none there is a ValueError naming the one trainer.json recorded."""
    from .data.tokenizers import TOKENIZER_FILES
    from .io import read_json
    from .train.load import load_model

    model, where = load_model(source, dtype=dtype, device=device)
    tok_dir = where.tokenizer_dir
    if (
        tokenizer is None
        and where.kind != "hub"
        and not any((tok_dir / f).is_file() for f in TOKENIZER_FILES)
    ):
        trained = None
        if where.step_dir is not None:
            state = read_json(where.step_dir / "trainer.json", "checkpoint state")
            trained = state.get("tokenizer") or (state.get("config") or {}).get("tokenizer")
        hint = (
            f" (trainer.json says it was trained with {trained!r}: --tokenizer {trained})"
            if trained
            else ""
        )
        raise ValueError(
            f"{tok_dir} holds no tokenizer files; pass --tokenizer NAME, the tokenizer the "
            f"model was trained with{hint}"
        )
    return model, tokenizer or str(tok_dir)


def prompts_of(args) -> list[str]:
    """``ssmkit generate``'s prompts: every ``--prompt``, then the lines of ``--prompts-file``."""
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:  # a missing file: OSError, one line in run_generate
        lines = Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
        if not lines:
            raise ValueError(f"{args.prompts_file} holds no prompts (one per line)")
        prompts += lines
    if not prompts:
        raise ValueError("give the text to continue: --prompt TEXT (repeatable) or --prompts-file")
    return prompts


def generate_text(args) -> str:
    """``ssmkit generate``: the checkpoint's model and tokenizer, the prompt continued, decoded;
    several prompts (repeated ``--prompt``, ``--prompts-file``) go through
    :func:`ssmkit.generate`'s packed path together and come back as one JSON line each. A user's
    mistake (no such checkpoint, no tokenizer, a tokenizer that does not fit) raises ValueError."""
    import json

    import torch

    from .data import get_tokenizer
    from .models import generate
    from .models.generate import check_sampling

    check_sampling(args.temperature, args.top_k, args.top_p)
    prompts = prompts_of(args)
    model, name = load_with_tokenizer(
        str(args.checkpoint), args.tokenizer, dtype=args.dtype, device=args.device
    )
    tok = get_tokenizer(name)
    vocab = model.config.vocab_size
    if len(tok) > vocab:
        raise ValueError(
            f"the tokenizer {name!r} has {len(tok):,} tokens, more than the model's vocabulary "
            f"of {vocab:,}: it is not the tokenizer this model was trained with"
        )
    encoded = []
    for prompt in prompts:
        ids = tok.encode(prompt, add_special_tokens=False) if prompt else []
        if not ids:  # '' starts a new document: the end-of-text token
            if tok.eos_token_id is None:
                raise ValueError(
                    "a prompt is empty and the tokenizer has no end-of-text token to start from"
                )
            ids = [tok.eos_token_id]
        encoded.append(ids)
    device = next(model.parameters()).device
    eos = tok.eos_token_id if tok.eos_token_id is not None and tok.eos_token_id < vocab else None
    options = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=eos,
        generator=torch.Generator(device=device).manual_seed(args.seed),
    )
    if len(encoded) == 1:
        out = generate(model, torch.tensor(encoded, device=device), **options)
        return tok.decode(out[0].tolist(), skip_special_tokens=True)
    outs = generate(model, encoded, **options)
    return "\n".join(
        json.dumps({"prompt": p, "text": tok.decode(o.tolist(), skip_special_tokens=True)})
        for p, o in zip(prompts, outs)
    )


def eval_options(ev: argparse.ArgumentParser) -> None:
    """The options of ``ssmkit eval``."""
    ev.description = (
        "Run lm-eval tasks on a model through the `ssmkit` lm-eval model; print "
        "the results as a markdown table. Offline tasks: ssmkit_docstring_cloze, "
        "ssmkit_lastword; lm-eval's own (hellaswag, piqa, arc_easy, arc_challenge, "
        "winogrande, lambada_openai, ...) need the hub or its datasets cache."
    )
    ev.add_argument(
        "--model",
        required=True,
        metavar="PATH",
        help="a model directory (config.json), a Trainer checkpoint step_N/, a checkpoints/ "
        "directory or its latest file, a run's out_dir, or a hub id",
    )
    ev.add_argument(
        "--tasks", required=True, metavar="T1,T2", help="comma-separated lm-eval task names"
    )
    ev.add_argument(
        "--batch-size",
        type=_count,
        default=8,
        metavar="N",
        help="requests per forward pass (default 8)",
    )
    ev.add_argument(
        "--limit", type=_count, default=None, metavar="N", help="at most N items per task"
    )
    ev.add_argument(
        "--out", default=None, metavar="DIR", help="also write results.json and results.md there"
    )
    ev.add_argument(
        "--tokenizer",
        default=None,
        metavar="NAME",
        help="gpt2, byte, bpe-<N>, a hub id or a directory (default: the checkpoint's files)",
    )
    ev.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto")


def eval_table(args) -> str:
    """``ssmkit eval``: the checkpoint behind ``--model`` scored on ``--tasks``; lm-eval's results
    written to ``--out``; the markdown table returned. A user's mistake (no such checkpoint, no
    tokenizer, an unknown task, a dataset out of reach) raises ValueError."""
    import contextlib

    from .eval.harness_run import lm_eval_table, run_lm_eval, task_names

    names = task_names(args.tasks)
    model, tokenizer = load_with_tokenizer(str(args.model), args.tokenizer, dtype="float32")
    with contextlib.redirect_stdout(
        sys.stderr
    ):  # lm-eval prints progress: keep stdout for the table
        results = run_lm_eval(
            model,
            names,
            tokenizer=tokenizer,
            batch_size=args.batch_size,
            limit=args.limit,
            out_dir=args.out,
            device=args.device,
        )
    return lm_eval_table(results)


def run_generate(args) -> int:
    """``ssmkit generate``: print :func:`generate_text`; a user's mistake is one line, status 1."""
    from .io import describe_os_error

    try:
        text = generate_text(args)
    except ValueError as exc:  # no checkpoint, no tokenizer, a corrupt file, a bad value
        return _fail("generate", str(exc))
    except OSError as exc:
        return _fail("generate", describe_os_error(exc))
    print(text)
    return 0


def run_eval(args) -> int:
    """``ssmkit eval``: print :func:`eval_table` (and where ``--out`` put the results); a user's
    mistake is one line, status 1."""
    from .io import describe_os_error

    try:
        table = eval_table(args)
    except (ValueError, RuntimeError) as exc:  # no checkpoint/tokenizer, unknown task, offline data
        return _fail("eval", " ".join(str(exc).split()))
    except OSError as exc:
        return _fail("eval", describe_os_error(exc))
    print(table, end="")
    if args.out:
        print(f"wrote {Path(args.out) / 'results.json'} and results.md")
    return 0


def convert_options(conv: argparse.ArgumentParser) -> None:
    """The options of ``ssmkit convert``."""
    conv.add_argument(
        "src", help="checkpoint directory (transformers or mamba_ssm layout) or hub id"
    )
    conv.add_argument(
        "dst",
        help="output directory: new, empty, or a checkpoint ssmkit wrote (replaced atomically)",
    )
    conv.add_argument(
        "--to",
        required=True,
        choices=CONVERT_FORMATS,
        help="layout to write: hf (transformers' Mamba / FalconMamba / Mamba2), "
        "mamba_ssm (MambaLMHeadModel, attention hybrids too), jamba, zamba2",
    )
    conv.add_argument(
        "--overwrite",
        action="store_true",
        help="DST holds other files too: replace only the checkpoint's files in it, keep the rest",
    )


def run_convert(args) -> int:
    """``ssmkit convert``: the model behind SRC (a LoRA run: its base with the adapter merged)
    saved in DST in the ``--to`` layout; a user's mistake is one line, status 1."""
    from .io import describe_os_error, overlapping

    if Path(args.src).exists() and overlapping(args.src, args.dst):  # writing DST destroys SRC
        return _fail(
            "convert",
            f"source {args.src} and target {args.dst} overlap (the same "
            "directory, or one inside the other); choose a target outside the "
            "source",
        )
    try:
        from .train.load import load_model

        model, where = load_model(args.src)  # a LoRA run: base + adapter, merged
        out = model.save_pretrained(
            args.dst,
            format=args.to,
            tokenizer_from=str(where.tokenizer_dir),
            overwrite=args.overwrite,
        )
    except ValueError as exc:  # CheckpointError, a refused target, an unsupported layout
        return _fail("convert", str(exc))
    except OSError as exc:  # disk full, read-only, permission denied
        return _fail("convert", describe_os_error(exc))
    print(f"wrote {out} ({args.to} layout, {model.num_parameters():,} parameters)")
    return 0


def data_prepare_options(prep: argparse.ArgumentParser) -> None:
    """The options of ``ssmkit data prepare``."""
    prep.add_argument(
        "--source", default="stdlib-docs", help="stdlib-docs, a remote corpus name, or a local path"
    )
    prep.add_argument(
        "--tokenizer", default="gpt2", help="gpt2, byte, bpe-<N>, a hub id or a directory"
    )
    prep.add_argument("--out", required=True, help="output directory (re-running resumes)")
    prep.add_argument("--split", default="train", choices=["train", "validation", "all"])
    prep.add_argument("--max-tokens", type=_count, default=None, help="stop after this many tokens")
    prep.add_argument("--shard-tokens", type=_count, default=1 << 24, help="tokens per shard")
    prep.add_argument("--workers", type=_count, default=1, help="tokenizer processes")
    prep.add_argument(
        "--lock-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for another prepare into --out to finish (default: fail at once)",
    )
    prep.add_argument(
        "--mds-seq-len",
        type=_count,
        default=None,
        metavar="N",
        help="also write a MosaicML streaming (MDS) copy of N+1-token windows into OUT/mds",
    )


def run_data_prepare(args) -> int:
    """``ssmkit data prepare``: :func:`ssmkit.data.prepare`, then what it wrote. The user's
    mistakes (bad source, corrupt file, busy directory, full disk, the offline GPT-2 files missing)
    are one line, status 1."""
    from .data import prepare
    from .io import Stopped, describe_os_error

    try:
        index = prepare(
            args.source,
            args.tokenizer,
            args.out,
            split=args.split,
            max_tokens=args.max_tokens,
            shard_tokens=args.shard_tokens,
            workers=args.workers,
            mds_seq_len=args.mds_seq_len,
            lock_wait=args.lock_wait,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        message = (
            describe_os_error(exc) if isinstance(exc, OSError) else " ".join(str(exc).split("\n"))
        )
        return _fail("data prepare", message)
    except Stopped as exc:  # Ctrl-C, SIGTERM: what was kept, in one line
        _fail("data prepare", str(exc))
        return 128 + exc.signum
    empty = (
        f" ({index['empty_documents']:,} blank ones skipped)"
        if index.get("empty_documents")
        else ""
    )
    print(
        f"{index['total_tokens']:,} tokens from {index['documents']:,} documents{empty}, "
        f"dtype {index['dtype']}"
    )
    if args.mds_seq_len is not None:
        print(
            f"MDS: {args.out}/mds, samples of {args.mds_seq_len + 1} tokens "
            "(streaming.StreamingDataset)"
        )
    return 0


def run_env(args) -> int:
    """``ssmkit env``: print :func:`ssmkit.env.env_report`."""
    from .env import env_report

    print(env_report())
    return 0


def _fail(command: str, message: str) -> int:
    """A user's mistake: ``ssmkit COMMAND: message`` on stderr, exit status 1."""
    print(f"ssmkit {command}: {message}", file=sys.stderr)
    return 1


# what a command raises for a bad input (a file, a value, the disk, a missing extra): its message is
# the line the user sees; anything else is reported as a probable bug, still in one line
USER_ERRORS = (ValueError, RuntimeError, OSError, ImportError)


def _one_line(command: str, exc: BaseException) -> str:
    """The one line ``ssmkit COMMAND`` prints for an error no command caught (``--debug``: the
    traceback instead)."""
    from .io import describe_os_error

    text = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
    text = " ".join(text.split()) or type(exc).__name__
    if isinstance(exc, USER_ERRORS):
        return text
    return (
        f"{type(exc).__name__}: {text} (unexpected: probably a bug in ssmkit; "
        f"`ssmkit --debug {command} ...` prints the traceback)"
    )


# --- dispatch -------------------------------------------------------------------------------------


def _load(target: str):
    """The function a ``"module:function"`` of :data:`COMMANDS` names (imported now)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _listing(group: str = "") -> argparse.ArgumentParser:
    """The parser of ``ssmkit`` (or of ``ssmkit GROUP``, e.g. ``ssmkit data``) that lists the
    commands with their lines: what ``--help``, a missing command or an unknown one show. Each
    command is a stub, so nothing is imported."""
    prefix = f"{group} " if group else ""
    parser = argparse.ArgumentParser(
        prog=f"ssmkit {prefix}".strip(),
        description=None if group else "train state-space language models",
        epilog=f"ssmkit {prefix}COMMAND --help shows a command's options",
    )
    if not group:
        parser.add_argument(
            "--debug",
            action="store_true",
            help="on an error, print Python's traceback (by default: one line, the error)",
        )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, title="commands")
    for name, command in COMMANDS.items():
        if name.startswith(prefix):
            sub.add_parser(name.removeprefix(prefix), help=command.help, add_help=False)
    return parser


def _command(argv: list[str]) -> tuple[str, list[str]]:
    """(the name in :data:`COMMANDS` that ``argv`` starts with, the arguments after it). ``--help``,
    no command or an unknown one: argparse prints the list (or the error, status 2) and exits."""
    for name in COMMANDS:
        words = name.split()
        if argv[: len(words)] == words:
            return name, argv[len(words) :]
    groups = {name.split()[0] for name in COMMANDS if " " in name}
    group = argv[0] if argv and argv[0] in groups else ""
    args, rest = _listing(group).parse_known_args(argv[1:] if group else argv)
    return f"{group} {args.command}".strip(), rest  # a two-word name given as one argument


def main(argv=None) -> None:
    """``ssmkit [--debug] ARGS``: the command ARGS names, with its options parsed; exits with the
    command's status when it is not 0 (2: bad options, as argparse). An error no command caught is
    one line on stderr, status 1 (an interrupt: 130); ``--debug`` lets it raise, traceback and
    all."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = bool(argv) and argv[0] == "--debug"
    name, rest = _command(argv[1:] if debug else argv)
    command = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"ssmkit {name}", description=command.help)
    if command.options:
        _load(command.options)(parser)
    args = parser.parse_args(rest)
    try:
        status = _load(command.run)(args)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"ssmkit {name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if debug:
            raise
        sys.exit(_fail(name, _one_line(name, exc)))
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
