"""Helpers shared by test files (imported as ``from helpers import ...``; fixtures live in
conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ssmkit.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]  # the checkout: configs/, notebooks/, benchmarks/

# mamba_ssm builds MambaConfig(**config.json): exactly its dataclass fields
# (mamba_ssm/models/config_mamba.py)
MAMBA_SSM_CONFIG_FIELDS = {
    "d_model",
    "d_intermediate",
    "n_layer",
    "vocab_size",
    "ssm_cfg",
    "attn_layer_idx",
    "attn_cfg",
    "rms_norm",
    "residual_in_fp32",
    "fused_add_norm",
    "pad_vocab_size_multiple",
    "tie_embeddings",
}


def perturb_(model, seed):
    """Move every parameter by 0.1 x N(0, 1) (seeded), so a test does not compare only the init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def small(tmp_path, shards, **kw) -> TrainConfig:
    """A tiny training run on conftest's byte-level ``shards``: d_model 32, 2 layers, seq_len 32, 6
    steps."""
    base = dict(
        model="tiny",
        model_overrides={"d_model": 32, "n_layer": 2},
        data=str(shards / "train"),
        val_data=str(shards / "val"),
        seq_len=32,
        micro_batch=4,
        batch_tokens=256,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=2,
        max_steps=6,
        log_every=1,
        eval_every=0,
        eval_batches=2,
        progress=False,
        out_dir=str(tmp_path / "run"),
    )
    return TrainConfig(**{**base, **kw})


def copy_run(run: Path, tmp_path: Path) -> Path:
    """A copy of the run directory ``run`` (conftest's ``trained_run``) at ``tmp_path / "run"``,
    where :func:`small` with ``tmp_path`` puts its run: to change without touching the shared
    one."""
    import shutil

    return Path(shutil.copytree(run, tmp_path / "run"))


def losses(history):
    """The training losses of a run's history (``Trainer.fit()``'s records of kind "train")."""
    return [r["loss"] for r in history if r["kind"] == "train"]


def jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def make_notebook(path: Path, params: str, *cells: str) -> Path:
    """A notebook: a `parameters` cell with ``params`` (always declaring out_dir), then code
    cells."""
    path.parent.mkdir(parents=True, exist_ok=True)
    import nbformat

    nb = nbformat.v4.new_notebook(
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        }
    )
    pcell = nbformat.v4.new_code_cell(params + "\nout_dir = 'unused'")
    pcell.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# test"), pcell] + [
        nbformat.v4.new_code_cell(c) for c in cells
    ]
    nbformat.write(nb, path)
    return path


def check_parameters(chapter, tmp_path, **changes) -> dict:
    """``chapter.PARAMETERS.check`` on its defaults with ``changes``, out_dir in ``tmp_path`` (the
    default would create ../runs/lab/... in the checkout) and device cpu."""
    values = {**chapter.PARAMETERS.defaults(), "out_dir": str(tmp_path), "device": "cpu", **changes}
    return chapter.PARAMETERS.check(values)


def one_hot_logits(batch, vocab: int, offset: int = 1) -> torch.Tensor:
    """Logits of a synthetic ``batch`` whose argmax at position t - offset is the answer at t
    (offset=1: the right alignment)."""
    n, L = batch.input_ids.shape
    logits = torch.zeros(n, L, vocab)
    rows, cols = batch.answer_mask.nonzero(as_tuple=True)
    logits[rows, cols - offset, batch.input_ids[rows, cols]] = 1.0
    return logits


def synthetic_corruptions(task, batch, context):
    """(description, corrupted copy of ``batch``) pairs that a correct checker must reject.

    The first answer (row r, position t) gets a wrong label, a wrong input token, a dropped mask
    bit; position 0 becomes an answer the inputs do not justify; and ``context(ids, r, t)`` edits
    row r of a copy of ``input_ids`` in place so that the derived answer changes while labels and
    the answer tokens keep the old one."""
    from ssmkit.data import SyntheticBatch

    def copy():
        return SyntheticBatch(
            batch.input_ids.clone(), batch.labels.clone(), batch.answer_mask.clone()
        )

    rows, cols = batch.answer_mask.nonzero(as_tuple=True)
    r, t = rows[0].item(), cols[0].item()
    answer, out = batch.input_ids[r, t].item(), []
    other = answer - 1 if answer > 0 else answer + 1  # another id inside the vocabulary
    b = copy()
    b.labels[r, t] = other
    out.append(("label", b))
    b = copy()
    b.input_ids[r, t] = other
    out.append(("input answer", b))
    b = copy()
    b.answer_mask[r, t] = False
    out.append(("mask", b))
    b = copy()
    context(b.input_ids, r, t)
    assert not torch.equal(b.input_ids, batch.input_ids)  # the edit did something
    out.append(("context", b))
    b = copy()
    b.answer_mask[r, 0] = True
    b.labels[r, 0] = b.input_ids[r, 0]
    out.append(("extra answer", b))
    return out
