"""`ssmkit generate` on what the Trainer writes: a checkpoint carries its tokenizer, every way of
naming it gives the same text, and that text is ssmkit.generate's on the same weights (the oracle).
Also `ssmkit demo --help`."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import jsonl, small

import ssmkit
from ssmkit import cli
from ssmkit.data import get_tokenizer
from ssmkit.hub import save_tokenizer
from ssmkit.train import Trainer
from ssmkit.train.manifest import write_manifest
from ssmkit.train.resolve import resolve


@pytest.fixture
def run(trained_run):
    """conftest's 2-step run of the tiny model on the byte-level shards; its out_dir (read only)."""
    return trained_run


def oracle(model_dir, prompt: str, n: int) -> str:
    """What the command must print: greedy ssmkit.generate on the saved weights, decoded ('' starts
    from the end-of-text token)."""
    model, tok = ssmkit.from_pretrained(model_dir), get_tokenizer(model_dir)
    ids = ssmkit.generate(
        model,
        torch.tensor([tok.encode(prompt) or [tok.eos_token_id]]),
        max_new_tokens=n,
        temperature=0,
        eos_token_id=tok.eos_token_id,
    )
    return tok.decode(ids[0].tolist(), skip_special_tokens=True)


def ssmkit_generate(*args, capsys) -> str:
    cli.main(["generate", *map(str, args)])
    return capsys.readouterr().out


def test_a_checkpoint_carries_its_tokenizer(run):
    where = resolve(run)
    model_dir, step = where.model_dir, where.step_dir
    assert where.kind == "checkpoint" and step.name == "step_00000002"
    assert model_dir == step / "model" and where.tokenizer_dir == model_dir
    assert (model_dir / "tokenizer.json").is_file()
    assert (
        "model/tokenizer.json" in (step / "manifest.json").read_text()
    )  # checked like the weights
    tok, byte = get_tokenizer(model_dir), get_tokenizer("byte")
    for text in ["def f(x):\n\treturn x", "héllo — 日本語", ""]:
        assert tok.encode(text) == byte.encode(text) and tok.decode(tok.encode(text)) == text


def test_generate_from_latest_is_greedy_ssmkit_generate(run):
    latest = run / "checkpoints" / "latest"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ssmkit.cli",
            "generate",
            str(latest),
            "--prompt",
            "def",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    expected = oracle(run / "checkpoints" / "step_00000002" / "model", "def", 5)
    assert (
        done.stdout == expected + "\n" and expected.startswith("def") and len(expected) > len("def")
    )


def test_every_way_of_naming_the_checkpoint_gives_the_same_text(run, capsys):
    step = run / "checkpoints" / "step_00000002"
    texts = {
        ssmkit_generate(
            path,
            "--prompt",
            "The ",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.9",
            "--top-k",
            "20",
            "--top-p",
            "0.9",
            "--seed",
            "3",
            capsys=capsys,
        )
        for path in (run, run / "checkpoints", run / "checkpoints" / "latest", step, step / "model")
    }
    assert len(texts) == 1 and next(iter(texts)).startswith("The ")
    other_seed = ssmkit_generate(
        run,
        "--prompt",
        "The ",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.9",
        "--seed",
        "4",
        capsys=capsys,
    )
    assert other_seed.startswith("The ")


def test_several_prompts_are_generated_together_one_json_line_each(run, tmp_path, capsys):
    """Repeated --prompt and --prompts-file lines go through generate's packed path together; each
    JSON line's text is what that prompt gives alone (greedy, the oracle)."""
    import json

    model_dir = run / "checkpoints" / "step_00000002" / "model"
    prompts = ["def", "The for statement", "", "x = [i for i in"]
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(prompts[2:]) + "\n", encoding="utf-8")
    out = ssmkit_generate(
        run,
        *("--prompt", prompts[0], "--prompt", prompts[1]),
        *("--prompts-file", file, "--max-new-tokens", "6", "--temperature", "0"),
        capsys=capsys,
    )
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["prompt"] for line in lines] == prompts
    for line in lines:
        assert line["text"] == oracle(model_dir, line["prompt"], 6), line
    with pytest.raises(SystemExit) as exc:
        ssmkit_generate(run, capsys=capsys)
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "--prompt TEXT (repeatable) or --prompts-file" in err
    with pytest.raises(SystemExit):
        ssmkit_generate(run, "--prompts-file", tmp_path / "missing.txt", capsys=capsys)
    assert "missing.txt: no such file or directory" in capsys.readouterr().err


def test_without_tokenizer_files_it_says_which_to_pass(run, tmp_path, capsys):
    import shutil

    old = tmp_path / "old-run"
    shutil.copytree(run, old)
    step = old / "checkpoints" / "step_00000002"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (step / "model" / f).unlink()
    write_manifest(step)  # a checkpoint as ssmkit wrote them before
    with pytest.raises(SystemExit) as exc:
        ssmkit_generate(old, "--prompt", "def", capsys=capsys)
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "holds no tokenizer files; pass --tokenizer NAME" in err
    assert "trained with 'byte': --tokenizer byte" in err
    text = ssmkit_generate(
        old,
        "--prompt",
        "def",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0",
        "--tokenizer",
        "byte",
        capsys=capsys,
    )
    assert text == oracle(run / "checkpoints" / "step_00000002" / "model", "def", 5) + "\n"
    with pytest.raises(SystemExit):
        ssmkit_generate(old, "--prompt", "def", "--tokenizer", "gpt2", capsys=capsys)
    assert "50,257 tokens, more than the model's vocabulary" in capsys.readouterr().err


@pytest.mark.parametrize(
    "where, message",
    [
        (
            "missing",
            "missing: no such directory; expected a model directory (config.json), a "
            "checkpoint step_N/",
        ),
        ("empty", "holds no model and no complete checkpoint"),
        ("file.txt", "is a file: expected a model directory"),
    ],
)
def test_what_is_not_a_checkpoint_is_one_line(where, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(SystemExit) as exc:
        ssmkit_generate(tmp_path / where, "--prompt", "x", capsys=capsys)
    err = capsys.readouterr().err
    assert exc.value.code == 1 and message in err and err.count("\n") == 1


def test_a_corrupt_checkpoint_is_refused(run, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    weights = bad / "checkpoints" / "step_00000002" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(SystemExit):
        ssmkit_generate(bad, "--prompt", "x", capsys=capsys)
    assert (
        "the sha256 of model/model.safetensors differs from its manifest" in capsys.readouterr().err
    )


def test_trainer_saves_the_bpe_it_trained_on_local_data(tmp_path):
    """data = a local corpus, tokenizer = bpe-N: the shards and the checkpoint use the BPE trained
    on it."""
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = ["".join(rng.choice(list("zqxjkvw"), size=rng.integers(4, 9))) for _ in range(60)]
    src = jsonl(
        tmp_path / "corpus.jsonl", [" ".join(rng.choice(vocab, size=80)) for _ in range(300)]
    )
    cfg = small(tmp_path, tmp_path, data=str(src), val_data=None, tokenizer="bpe-300", max_steps=1)
    trainer = Trainer(config=cfg)
    trainer.fit()
    model_dir = resolve(cfg.out_dir).model_dir
    saved, trained = get_tokenizer(model_dir), get_tokenizer("bpe-300", corpus=str(src))
    assert trainer.loader.index["tokenizer"] == str(trained.name_or_path)
    sample = " ".join(vocab[:10])
    assert len(saved) == 300 and saved.encode(sample) == trained.encode(sample)
    assert saved.encode(sample) != get_tokenizer("bpe-300").encode(
        sample
    )  # not the default corpus'


def test_a_transformers_baseline_checkpoint_carries_the_tokenizer_too(tmp_path, shards):
    cfg = small(tmp_path, shards, max_steps=1)
    model = ssmkit.build_model(cfg.model_config(vocab_size=257))
    Trainer(ssmkit.models.matched_transformer(model, max_len=cfg.seq_len), cfg).fit()
    model_dir = tmp_path / "run" / "checkpoints" / "step_00000001" / "model"
    assert (model_dir / "config.json").is_file() and get_tokenizer(model_dir).encode("def") == [
        100,
        101,
        102,
    ]


def test_save_tokenizer_never_costs_the_checkpoint(tmp_path):
    model = ssmkit.build_model(ssmkit.ModelConfig.preset("tiny", vocab_size=257))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not save_tokenizer("gpt2", tmp_path, model)  # 50257 tokens: does not fit
        assert not save_tokenizer(str(tmp_path / "nowhere"), tmp_path, model)  # cannot be loaded
        assert not save_tokenizer(None, tmp_path, model)  # nothing to save
    assert len(caught) == 2 and "do not fit the model's vocabulary of 257" in str(caught[0].message)
    assert not list(tmp_path.iterdir())
    assert save_tokenizer("byte", tmp_path, model) and (tmp_path / "tokenizer.json").is_file()


def test_demo_help_names_the_subcommand_and_its_options():
    done = subprocess.run(
        [sys.executable, "-m", "ssmkit.cli", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.startswith(
        "usage: ssmkit demo [-h] [--steps STEPS]"
    )
    for option in (
        "--steps",
        "--mixer {mamba1,mamba2,mamba3,hybrid}",
        "--batch-size",
        "--seq-len",
        "--lr",
        "--seed",
    ):
        assert option in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ssmkit.cli", "demo", "--bogus"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        bad.returncode == 2 and "ssmkit demo: error: unrecognized arguments: --bogus" in bad.stderr
    )
