"""What a path names (ssmkit.train.resolve) and loading it (ssmkit.train.load), on a checkpoint laid
out by hand: every way of naming it gives the same record, a mistyped local path is "no such
directory", and a loaded checkpoint holds the weights ssmkit.from_pretrained reads from its model/
(the oracle)."""

from __future__ import annotations

import shutil

import pytest
import torch

import ssmkit
from ssmkit.hub import is_hub_id, parse_dtype
from ssmkit.io import write_json
from ssmkit.train.load import load_model
from ssmkit.train.manifest import CheckpointCorrupt, write_manifest
from ssmkit.train.resolve import Resolved, resolve


@pytest.fixture
def run(tmp_path):
    """out_dir/checkpoints/{latest, step_00000002/{model/, trainer.json, manifest.json}}, and a LoRA
    run's step_00000004/{adapter/, trainer.json, manifest.json} in another out_dir."""
    model = ssmkit.build_model(ssmkit.ModelConfig(d_model=16, n_layer=1, vocab_size=32))
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    model.save_pretrained(step / "model")
    write_json(step / "trainer.json", {"step": 2})
    write_manifest(step)
    (step.parent / "latest").write_text("step_00000002\n")
    lora = tmp_path / "lora" / "checkpoints" / "step_00000004"
    (lora / "adapter").mkdir(parents=True)
    write_json(lora / "trainer.json", {"step": 4})
    write_manifest(lora)
    (lora.parent / "latest").write_text("step_00000004\n")
    return tmp_path


def test_every_name_of_a_checkpoint_resolves_to_it(run):
    step = run / "run" / "checkpoints" / "step_00000002"
    for path in (
        run / "run",
        run / "run" / "checkpoints",
        step.parent / "latest",
        step,
        step / "model",
    ):
        where = resolve(path)
        assert (where.kind, where.model_dir, where.step_dir, where.adapter_dir) == (
            "checkpoint",
            step / "model",
            step,
            None,
        ), path
        assert where.tokenizer_dir == step / "model" and where.model_source() == str(step / "model")
    plain = shutil.copytree(step / "model", run / "plain")
    assert resolve(plain) == Resolved("model", str(plain), model_dir=plain)


def test_a_lora_run_a_hub_id_and_what_is_neither(run, monkeypatch):
    step = run / "lora" / "checkpoints" / "step_00000004"
    where = resolve(run / "lora")
    assert (where.kind, where.step_dir, where.tokenizer_dir) == ("lora", step, step / "adapter")
    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        where.model_source()
    monkeypatch.chdir(run)
    assert resolve("state-spaces/mamba-130m") == Resolved(
        "hub", "state-spaces/mamba-130m", hub_id="state-spaces/mamba-130m"
    )
    with pytest.raises(ValueError, match=r"^run/nope: no such directory; expected a model dir"):
        resolve("run/nope")  # run/ is here: a mistyped path, not a hub id
    (run / "empty").mkdir()
    (run / "notes.txt").write_text("x")
    for path, message in (
        ("empty", "holds no model and no complete checkpoint"),
        ("notes.txt", "is a file: expected"),
    ):
        with pytest.raises(ValueError, match=message):
            resolve(path)


@pytest.mark.parametrize(
    "text, hub",
    [
        ("state-spaces/mamba-130m", True),
        ("run/nope", False),
        ("./a/b", False),
        ("/a", False),
        ("a/b/c", False),
        ("~/a", False),
        ("a/", False),
        ("nope", False),
        ("EleutherAI/gpt-neox-20b", True),
        ("my runs/x", False),  # characters no hub id has: a mistyped path
        ("runz/no*pe", False),
        ("runz/nope.", False),
        ("-a/b", False),
    ],
)
def test_is_hub_id(run, monkeypatch, text, hub):
    monkeypatch.chdir(run)
    assert is_hub_id(text) is hub


def test_parse_dtype():
    assert [parse_dtype(x) for x in (None, "bf16", "torch.float16", "FP32", torch.float64)] == [
        None,
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
    ]
    for bad in ("int8", torch.int64, 16):
        with pytest.raises(ValueError, match="is not supported; valid: float32, fp32, bfloat16"):
            parse_dtype(bad)


def test_load_model_verifies_then_loads_what_from_pretrained_reads(run):
    step = run / "run" / "checkpoints" / "step_00000002"
    model, where = load_model(run / "run", dtype="bf16")
    oracle = ssmkit.from_pretrained(step / "model")
    assert where.step_dir == step and model.lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(model.lm_head.weight, oracle.lm_head.weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype='int8' is not supported"):
        load_model(run / "nowhere", dtype="int8")  # checked before the path is read
    weights = step / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="sha256 of model/model.safetensors differs"):
        load_model(step)
