"""ssmkit.workbook.cells (what every notebook's cells share) and chapter 00's estimates, against a
second path: the run config built by TrainConfig itself, a model built and counted, a file read
back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ssmkit
from ssmkit import workbook
from ssmkit.workbook.chapters import ch00_setup


def test_train_config_evals_and_overrides():
    cfg = workbook.train_config("cpu-tiny", max_tokens=40960, evals=3, micro_batch=4, lr=1e-3)
    assert (cfg.total_steps(), cfg.eval_every, cfg.micro_batch, cfg.lr) == (10, 3, 4, 1e-3)
    assert workbook.train_config("cpu-tiny", max_tokens=4096, evals=6).eval_every == 1
    with pytest.raises(workbook.WorkbookError, match="give evals or eval_every, not both"):
        workbook.train_config("cpu-tiny", evals=3, eval_every=2)
    with pytest.raises(workbook.WorkbookError, match="micro_batch must be a positive integer"):
        workbook.train_config("cpu-tiny", micro_batch=0)
    with pytest.raises(
        workbook.WorkbookError, match="config='nope' is not a run config; valid: cpu-tiny"
    ):
        workbook.train_config("nope")
    names = workbook.run_config_names()
    assert names.index("cpu-tiny") < names.index("tiny") and "mamba2-130m" in names


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU error")
def test_pick_device_without_gpu():
    assert workbook.pick_device("auto") in ("cpu", "mps") and workbook.pick_device("cpu") == "cpu"
    with pytest.raises(workbook.WorkbookError, match="CUDA is not available"):
        workbook.pick_device("cuda:0")


def test_run_config_info_counts_like_a_built_model():
    info = ch00_setup.run_config_info(
        "tiny", max_tokens=1000
    )  # what train_config("tiny") would train
    assert (
        info["params"]
        == ssmkit.build_model(
            workbook.train_config("tiny", max_steps=1).model_config()
        ).num_parameters()
    )
    assert info["vocab_size"] == len(ssmkit.data.get_tokenizer("gpt2")) == 50257
    assert info["train_flops"] == 6 * info["params"] * 1000
    assert info["train_state_gb"] == round(16 * info["params"] / 2**30, 3)


def test_system_info_names_the_kernels_state(tmp_path):
    info = ch00_setup.system_info(tmp_path)
    assert info["mamba_ssm"] in ("not installed",) or info["mamba_ssm"].startswith(("broken", "2."))
    assert info["cpus"] >= 1 and info["disk_free_gb"] > 0


def test_write_metrics_and_format_duration(tmp_path):
    path = workbook.write_metrics(tmp_path / "m", {"loss": 1.5, "where": Path("/x")})
    assert json.loads(path.read_text()) == {"loss": 1.5, "where": "/x"} and list(
        path.parent.iterdir()
    ) == [path]
    assert [workbook.format_duration(s) for s in (42, 300, 25200, 3e5)] == [
        "42 s",
        "5 min",
        "7 h",
        "3.5 days",
    ]
    assert workbook.markdown_table([{"a": 1.23456, "b": 12345}, {"a": None}]).splitlines() == [
        "| a | b |",
        "|---|---|",
        "| 1.235 | 12,345 |",
        "| — |  |",
    ]
