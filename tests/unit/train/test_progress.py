"""Output a person can follow: the progress bar's form ($SSMKIT_PROGRESS) and label, checkpoint
saves without bars of their own, the live plot's axes from the first point, and the one-line notes
of ``--resume``."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import tqdm.auto
from helpers import ROOT, small  # tests/helpers.py; the `shards` fixture is in tests/conftest.py

import ssmkit
from ssmkit import io
from ssmkit.plots import LivePlot
from ssmkit.train import Trainer


# --- the bar's form -------------------------------------------------------------------------------
def test_progress_modes(monkeypatch, capsys):
    monkeypatch.delenv("SSMKIT_PROGRESS", raising=False)
    assert io.progress_mode() == "auto"
    with io.tqdm_bar(total=1, disable=True) as bar:
        assert isinstance(bar, tqdm.auto.tqdm)  # the widget in a Jupyter kernel
    monkeypatch.setenv("SSMKIT_PROGRESS", " Text ")
    with io.tqdm_bar(total=100, desc="work") as bar:  # a fast loop: two lines, not a hundred
        assert not isinstance(bar, tqdm.auto.tqdm)
        for _ in range(100):
            bar.update(1)
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n")
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("work:   0%|") and "100/100" in lines[1], lines
    monkeypatch.setattr(io, "TEXT_INTERVAL", 0.0)  # every redraw is a line of its own
    with io.tqdm_bar(total=3, desc="work") as bar:
        for _ in range(3):
            bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    shown = [line.split("|")[0] for line in lines]
    assert shown[:4] == ["work:   0%", "work:  33%", "work:  67%", "work: 100%"]
    monkeypatch.setenv("SSMKIT_PROGRESS", "off")
    with io.tqdm_bar(total=3) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("SSMKIT_PROGRESS", "txt")
    with pytest.raises(
        ValueError, match=r"SSMKIT_PROGRESS='txt' is not a progress mode; valid: auto .*off"
    ):
        io.tqdm_bar(total=1)


def test_data_prepare_bar_follows_the_mode(tmp_path, monkeypatch, capsys):
    from ssmkit.data import prepare

    monkeypatch.setenv("SSMKIT_PROGRESS", "text")
    prepare("stdlib-docs", "byte", tmp_path / "out", split="validation", max_tokens=2_000)
    err = capsys.readouterr().err
    assert "\r" not in err and "100%" in err.splitlines()[-1]


# --- the trainer's bar: text in logs, named after the model ---------------------------------------
def test_text_bar_names_the_model_and_the_plot_frames_the_run(tmp_path, shards, monkeypatch, capfd):
    mamba = ssmkit.build_model(
        ssmkit.ModelConfig.preset("tiny", d_model=32, n_layer=2, vocab_size=257)
    )
    llama = ssmkit.models.matched_transformer(mamba)
    assert Trainer(config=small(tmp_path / "a", shards)).name == "tiny"  # built from the preset
    assert Trainer(llama, small(tmp_path / "b", shards)).name == "LlamaForCausalLM"
    monkeypatch.setenv("SSMKIT_PROGRESS", "text")
    live = LivePlot(None, display=False)
    cfg = small(tmp_path / "c", shards, max_steps=3, progress=True)
    capfd.readouterr()
    Trainer(llama, cfg, name="Transformer++", callbacks=[live]).fit()
    err = capfd.readouterr().err
    assert "\r" not in err and "Writing model shards" not in err
    bar = [line for line in err.splitlines() if "%|" in line]
    assert bar and all(line.startswith("train Transformer++:") for line in bar), err
    assert "3/3" in bar[-1]
    ax = live.figure().axes[0]
    assert (
        ax.get_xlim() == (0, cfg.total_steps() * cfg.batch_tokens)
        and ax.get_title() == "Transformer++"
    )


# --- checkpoint saves draw no bars ----------------------------------------------------------------
def test_checkpoint_saves_draw_no_bars(tmp_path, shards, monkeypatch, capfd):
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("SSMKIT_PROGRESS", raising=False)
    mamba = ssmkit.build_model(
        ssmkit.ModelConfig.preset("tiny", d_model=32, n_layer=2, vocab_size=257)
    )
    llama = ssmkit.models.matched_transformer(mamba)
    assert hf_logging.is_progress_bar_enabled()
    for name, model in (("mamba", mamba), ("llama", llama)):
        trainer = Trainer(model, small(tmp_path / name, shards))
        capfd.readouterr()
        trainer.save_checkpoint()
        err = capfd.readouterr().err
        assert "%|" not in err and "\r" not in err and "Writing" not in err, (name, err)
        assert (
            tmp_path / name / "run" / "checkpoints" / "step_00000000" / "model" / "config.json"
        ).exists()
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()  # as they were
    disable_progress_bars()  # the hub's bars off before: off after
    try:
        Trainer(llama, small(tmp_path / "quiet", shards)).save_checkpoint()
        assert are_progress_bars_disabled()
    finally:
        enable_progress_bars()
        hf_logging.enable_progress_bar()


# --- the live plot's axes from the first point ----------------------------------------------------
def test_liveplot_frames_the_first_point():
    trainer = SimpleNamespace(
        name="Mamba", config=SimpleNamespace(total_steps=lambda: 50, batch_tokens=2048)
    )
    live = LivePlot(None, display=False)
    live.on_log(trainer, {"step": 1, "tokens": 2048, "loss": 10.8})
    ax = live.figure().axes[0]
    assert ax.get_xlim() == (0, 50 * 2048)  # the whole run, not 2048 +- 0.04
    assert ax.get_ylim() == pytest.approx((0, 11.88)) and ax.get_title() == "Mamba"
    live.on_eval(trainer, {"step": 1, "tokens": 2048, "val_loss": 11.5, "val_ppl": 1e5})
    assert live.figure().axes[0].get_ylim() == pytest.approx(
        (0, 1.1 * 11.5)
    )  # the highest loss fits
    hand = LivePlot(None, display=False, title="by hand")  # fed without a trainer
    hand.on_log(None, {"step": 1, "tokens": 1000, "loss": 5.0})
    ax = hand.figure().axes[0]
    assert ax.get_xlim() == pytest.approx((0, 1050)) and ax.get_ylim() == pytest.approx((0, 5.5))
    assert ax.get_title() == "by hand"


# --- resume: nothing to resume, and a finished run ------------------------------------------------
def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "ssmkit", "train", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_resume_says_what_it_does_and_a_finished_run_stays(tmp_path, shards):
    config = tmp_path / "c.yaml"
    config.write_text(small(tmp_path, shards, max_steps=2, eval_every=1).to_yaml())
    first = run_cli("--config", str(config), "--resume")
    assert first.returncode == 0, first.stderr
    said = (
        f"nothing to resume in {tmp_path / 'run'}: it holds no checkpoint; "
        "starting a new run from step 0"
    )
    assert said in first.stdout
    metrics, latest = (
        tmp_path / "run" / "metrics.jsonl",
        tmp_path / "run" / "checkpoints" / "latest",
    )
    before = metrics.read_text()
    manifest = tmp_path / "run" / "checkpoints" / latest.read_text().strip() / "manifest.json"
    saved_at = manifest.stat().st_mtime_ns
    again = run_cli("--config", str(config), "--resume")
    assert again.returncode == 0, again.stderr
    assert "nothing to train, already at step 2 of 2 (the run is finished" in again.stdout
    after = metrics.read_text()
    evals = [r["step"] for r in map(json.loads, after.splitlines()) if r["kind"] == "eval"]
    assert evals == [0, 1, 2]  # no second row for step 2
    assert (
        after == before and manifest.stat().st_mtime_ns == saved_at
    )  # not evaluated nor saved again


def test_fit_until_a_step_already_reached_returns_at_once(tmp_path, shards, capsys):
    trainer = Trainer(config=small(tmp_path, shards, max_steps=4, eval_every=2))
    assert trainer.fit(until=2)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert trainer.fit(until=2) == [] and trainer.step == 2
    assert capsys.readouterr().out == "tiny: nothing to train, already at step 2 of 2 (until=2)\n"
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == rows
