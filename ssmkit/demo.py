"""A two-minute CPU demo: train the ``tiny`` preset on built-in text, byte by byte, then sample.

    python -m ssmkit.demo [--steps 300] [--mixer mamba1|mamba2|mamba3|hybrid] [--seed 0]

The text is the Python language reference that ships with every CPython (``pydoc_data.topics``),
read as raw UTF-8 bytes (vocabulary 256). The loop is deliberately minimal: the Trainer's AdamW and
schedule (:func:`ssmkit.train.optim.build_optimizer`, :func:`~ssmkit.train.optim.lr_at`: linear
warmup, cosine decay to lr / 10) and gradient clipping, on random windows of one in-memory tensor;
the full training engine (shards, checkpoints, evaluation, several processes) is
:class:`ssmkit.train.Trainer`.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from .models import ModelConfig, build_model, generate
from .train import TrainConfig
from .train.optim import build_optimizer, lr_at


def builtin_bytes(max_bytes: int = 400_000) -> torch.Tensor:
    """The language reference topics, concatenated in sorted order, as a uint8 tensor of bytes."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")[:max_bytes]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Random windows: (batch, seq_len) inputs; labels are the same ids (the model shifts them)."""
    while True:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        yield torch.stack([data[s : s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, data, seq_len=128, n=16, seed=1234) -> float:
    model.eval()
    batch = next(batches(data, n, seq_len, torch.Generator().manual_seed(seed)))
    loss = model(batch, labels=batch).loss.item()
    model.train()
    return loss


DEMO_PRESETS = {
    "mamba1": "tiny",
    "mamba2": "tiny-mamba2",
    "mamba3": "tiny-mamba3",
    "hybrid": "tiny-hybrid",
}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``ssmkit demo`` / ``python -m ssmkit.demo``."""
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    p.add_argument(
        "--mixer",
        default="mamba1",
        choices=list(DEMO_PRESETS),
        help="the tiny model: mamba1 (S6), mamba2 (SSD), mamba3 (exponential-trapezoidal scan "
        "with data-dependent rotations, SISO), or hybrid (Mamba-1 with one causal attention "
        "layer in four, Jamba's layout) (default mamba1)",
    )
    p.add_argument("--batch-size", type=int, default=16, help="windows per step (default 16)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per window (default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the weights, the data order and the sample"
    )
    return p


def run(args):
    """Train the tiny model ``args.mixer`` names, print the losses and a sample; exits with a
    message if the validation loss did not fall."""
    torch.manual_seed(args.seed)
    data = builtin_bytes()
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    cfg = ModelConfig.preset(DEMO_PRESETS[args.mixer])
    model = build_model(cfg)
    print(
        f"model: {args.mixer}, d_model {cfg.d_model}, {cfg.n_layer} layers, "
        f"{model.num_parameters() / 1e3:.0f}K parameters; "
        f"data: {len(data) / 1e3:.0f}K bytes of the Python reference"
    )
    recipe = TrainConfig(
        max_steps=args.steps,
        lr=args.lr,
        min_lr=args.lr / 10,
        weight_decay=0.1,
        warmup_steps=max(1, args.steps // 20),
        betas=(0.9, 0.95),
        grad_clip=1.0,
    )
    opt = build_optimizer(model, recipe)
    stream = batches(train, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed))
    first_val = evaluate(model, val)
    print(f"step    0  val loss {first_val:.3f}  (uniform guess: {math.log(256):.3f})")
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        x = next(stream)
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 25 == 0 or step + 1 == args.steps:
            tok_s = (step + 1) * args.batch_size * args.seq_len / (time.perf_counter() - t0)
            print(
                f"step {step + 1:4d}  train loss {loss.item():.3f}  "
                f"lr {opt.param_groups[0]['lr']:.1e}  {tok_s:,.0f} tok/s"
            )
    last_val = evaluate(model, val)
    print(
        f"val loss {first_val:.3f} -> {last_val:.3f} ({math.exp(last_val):.2f} perplexity per byte)"
    )
    prompt = torch.tensor([list(b"The for statement ")])
    out = generate(
        model,
        prompt,
        max_new_tokens=200,
        temperature=0.8,
        top_k=40,
        generator=torch.Generator().manual_seed(args.seed),
    )
    print("sample:\n" + bytes(out[0].tolist()).decode("utf-8", errors="replace"))
    if not last_val < first_val:
        raise SystemExit("the loss did not fall: something is wrong")


def main(argv=None, prog: str | None = None):
    """``python -m ssmkit.demo``: parse ``argv`` and :func:`run` (``prog`` names the command in
    --help and errors)."""
    run(
        add_arguments(
            argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
        ).parse_args(argv)
    )


if __name__ == "__main__":
    main(prog="python -m ssmkit.demo")
