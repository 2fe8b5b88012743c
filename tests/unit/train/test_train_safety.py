"""Nothing lost, nothing executed: the training engine under injected faults.

Each test injects one fault and checks the outcome against a second path: a crash at every point of
the checkpoint commit sequence (simulated deterministically: the hook raises where a kill -9 would
stop the process, and nothing after it runs), a failed or killed overwrite, tampered and
corrupt checkpoints, two writers, torn metrics, a changed model on resume, a full disk, bad configs.
"""

import errno
import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, copy_run, losses, small  # the fixtures (shards, ...): tests/conftest.py

from ssmkit.io import LockError
from ssmkit.train import TrainConfig, Trainer, checkpoint, safe_load
from ssmkit.train.manifest import CheckpointCorrupt, write_manifest
from ssmkit.train.rundir import PREVIOUS

POINTS = ["written", "old moved aside", "renamed", "latest written"]


class Killed(BaseException):
    """Stands in for kill -9: a BaseException, so no `except Exception` cleanup runs after it."""


def crash_at(point):
    def hook(where):
        if where == point:
            raise Killed(where)

    return hook


@pytest.fixture(scope="module")
def straight(tmp_path_factory, shards):
    """Losses of 8 uninterrupted steps: the oracle every resumed run must reproduce."""
    return losses(
        Trainer(config=small(tmp_path_factory.mktemp("straight"), shards, max_steps=8)).fit()
    )


def train_losses(run: Path) -> list[float]:
    """The training losses in metrics.jsonl, in order."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("."))


# --- the commit sequence --------------------------------------------------------------------------
@pytest.mark.parametrize("point", [p for p in POINTS if p != "old moved aside"])
def test_a_kill_while_saving_a_new_step_resumes_exactly(
    tmp_path, shards, straight, monkeypatch, point
):
    cfg = small(tmp_path, shards, max_steps=8)
    first = Trainer(config=cfg)
    first.fit(until=4)  # step_00000004 committed
    monkeypatch.setattr(checkpoint, "_commit_point", crash_at(point))
    with pytest.raises(Killed):
        first.fit(until=6)  # killed while saving step 6
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # `latest` is intact: no fallback
        resumed = Trainer(config=cfg)
        assert resumed.resume()
    expected = 6 if point == "latest written" else 4  # committed = `latest` names it
    assert resumed.step == expected and leftovers(tmp_path / "run") == []
    resumed.fit()
    assert train_losses(tmp_path / "run") == pytest.approx(
        straight, abs=1e-6
    )  # each step once, exact


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_while_saving_the_same_step_again_keeps_it(
    tmp_path, shards, straight, monkeypatch, point
):
    cfg = small(tmp_path, shards, max_steps=8)
    first = Trainer(config=cfg)
    first.fit(until=4)
    monkeypatch.setattr(checkpoint, "_commit_point", crash_at(point))
    with pytest.raises(Killed):
        # step 4 again, over the committed one
        first.save_checkpoint()
    monkeypatch.undo()
    ckpts = tmp_path / "run" / "checkpoints"
    if point == "old moved aside":  # the window that lost it before
        assert not (ckpts / "step_00000004").exists() and (ckpts / ".old-step_00000004").is_dir()
    resumed = Trainer(config=cfg)
    assert resumed.resume()  # recover() puts it back
    assert resumed.step == 4 and leftovers(tmp_path / "run") == []
    resumed.fit()
    assert train_losses(tmp_path / "run") == pytest.approx(straight, abs=1e-6)


def test_a_missing_or_dangling_latest_falls_back_to_the_newest_complete(tmp_path, shards):
    cfg = small(tmp_path, shards, max_steps=8, ckpt_every=2, keep_last=5)
    Trainer(config=cfg).fit(until=6)
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "latest").unlink()
    with pytest.warns(
        UserWarning,
        match="no latest pointer; resuming from the newest complete checkpoint step_00000006",
    ):
        resumed = Trainer(config=cfg)
        assert resumed.resume() and resumed.step == 6
    (ckpts / "latest").write_text("step_00000008\n")  # points at nothing
    (ckpts / "step_00000006" / "manifest.json").unlink()  # and step 6 is incomplete
    with pytest.warns(UserWarning, match="names step_00000008, which is not a complete checkpoint"):
        resumed = Trainer(config=cfg)
        assert resumed.resume() and resumed.step == 4


@pytest.mark.parametrize(
    "pointer", ["../..", "../../other/checkpoints/step_00000002", "/etc", "step_2"]
)
def test_latest_outside_the_checkpoint_folder_is_refused(tmp_path, shards, pointer):
    cfg = small(tmp_path, shards, max_steps=4)
    Trainer(config=cfg).fit(until=2)
    (tmp_path / "run" / "checkpoints" / "latest").write_text(pointer + "\n")
    with pytest.raises(ValueError, match="expected a name matching step_"):
        Trainer(config=cfg).resume()


def test_stale_temporaries_are_cleaned_at_start(tmp_path, shards):
    cfg = small(tmp_path, shards, max_steps=4)
    Trainer(config=cfg).fit(until=2)
    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step_00000003" / "state").mkdir(parents=True)
    (run / "checkpoints" / ".latest.tmp-999").write_text("step_00000003\n")
    (run / ".metrics.jsonl.tmp-999").write_text("{")
    (run / "notes.txt").write_text("mine")  # not ours: stays
    Trainer(config=cfg).resume()
    assert leftovers(run) == [] and not (run / ".metrics.jsonl.tmp-999").exists()
    assert (run / "notes.txt").read_text() == "mine"


# --- overwrite ------------------------------------------------------------------------------------
def _old_run(tmp_path, trained_run):
    """A finished 2-step run in tmp_path / "run" (a copy of conftest's): its files, by name."""
    return _files(copy_run(trained_run, tmp_path))


def _files(run):
    return {
        p.relative_to(run).as_posix(): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


class Boom(torch.nn.Module):
    """A model whose forward raises on the 2nd training call: a run that fails before its first
    checkpoint."""

    def __init__(self):
        super().__init__()
        import ssmkit

        self.inner = ssmkit.build_model(
            ssmkit.ModelConfig.preset("tiny", d_model=32, n_layer=2, vocab_size=257)
        )
        self.config, self.calls = self.inner.config, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("boom")
        return self.inner(x).logits


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(
    tmp_path, shards, trained_run
):
    before = _old_run(tmp_path, trained_run)
    aside = []

    class Probe:  # after step 1, before the boom
        def on_log(self, trainer, record):
            aside.append((tmp_path / "run" / PREVIOUS / "checkpoints").is_dir())

    failing = Trainer(
        Boom(),
        small(tmp_path, shards, max_steps=4, overwrite=True, micro_batch=8),
        callbacks=[Probe()],
    )
    assert _files(tmp_path / "run") == before  # building touches nothing there
    with pytest.raises(RuntimeError, match="boom"):
        failing.fit()
    assert aside == [True]  # moved aside, not deleted, while it ran
    assert _files(tmp_path / "run") == before and not (tmp_path / "run" / PREVIOUS).exists()
    with pytest.raises(ValueError, match="no longer belongs to this Trainer"):
        failing.fit()  # it must not write into the old run
    good = Trainer(config=small(tmp_path, shards, max_steps=3, overwrite=True))
    good.fit()
    assert not (tmp_path / "run" / PREVIOUS).exists()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")] == ["step_00000003"]


def test_a_killed_overwrite_gives_the_old_run_back_at_the_next_start(
    tmp_path, shards, trained_run, monkeypatch
):
    before = _old_run(tmp_path, trained_run)
    new = Trainer(config=small(tmp_path, shards, max_steps=4, overwrite=True))
    monkeypatch.setattr(checkpoint, "_commit_point", crash_at("written"))
    with pytest.raises(Killed):
        new.fit()  # killed in its first save
    monkeypatch.undo()
    assert not (tmp_path / "run" / "checkpoints" / "step_00000004").exists()
    resumed = Trainer(config=small(tmp_path, shards, max_steps=4))
    assert resumed.resume()
    after = _files(tmp_path / "run")
    assert resumed.step == 2 and {k: v for k, v in after.items() if k != "config.yaml"} == {
        k: v for k, v in before.items() if k != "config.yaml"
    }


# --- what a checkpoint may contain ----------------------------------------------------------------
def _committed(tmp_path, shards, **kw):
    cfg = small(tmp_path, shards, max_steps=4, **kw)
    Trainer(config=cfg).fit(until=2)
    return cfg, tmp_path / "run" / "checkpoints" / "step_00000002"


def test_rng_state_is_json_not_pickle(tmp_path, shards):
    _, ckpt = _committed(tmp_path, shards)
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_00000.json"]
    json.loads((ckpt / "rng" / "rank_00000.json").read_text())


def test_a_bit_flip_in_an_optimizer_shard_is_refused(tmp_path, shards):
    cfg, ckpt = _committed(tmp_path, shards)
    shard = next((ckpt / "state").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointCorrupt, match=rf"the sha256 of state/{shard.name} differs from its manifest"
    ):
        Trainer(config=cfg).resume()


@pytest.mark.parametrize("name", ["trainer.json", "model/model.safetensors", "state/.metadata"])
def test_a_truncated_checkpoint_file_is_refused(tmp_path, shards, name):
    cfg, ckpt = _committed(tmp_path, shards)
    path = ckpt / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        CheckpointCorrupt, match=rf"{name} has \d+ bytes, the manifest says \d+ \(truncated\?\)"
    ):
        Trainer(config=cfg).resume()


class Payload:
    """Unpickling this creates a marker file: what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_pickle_payload_in_dcp_metadata_never_runs(tmp_path, shards):
    cfg, ckpt = _committed(tmp_path, shards)
    marker = tmp_path / "pwned"
    (ckpt / "state" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    write_manifest(ckpt)  # a forger updates the manifest too
    with pytest.raises(CheckpointCorrupt, match=r"refers to pathlib.Path.touch|refers to pathlib"):
        Trainer(config=cfg).resume()
    assert not marker.exists()


def test_a_pickle_payload_in_a_dcp_value_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    with pytest.raises(CheckpointCorrupt, match="optim.param_groups.0.lr is not a plain value"):
        payload = io.BytesIO(pickle.dumps(Payload(marker), protocol=2))
        safe_load.SafePlanner().load_bytes(item, payload)
    assert not marker.exists()


def test_resume_after_changing_the_model_names_the_difference(tmp_path, shards):
    cfg, _ = _committed(tmp_path, shards)
    before = (tmp_path / "run" / "config.yaml").read_text()
    changed = small(tmp_path, shards, max_steps=4, model_overrides={"d_model": 48, "n_layer": 2})
    with pytest.raises(
        ValueError,
        match=r"its model differs from this run's \(backbone\.embedding\.weight: "
        r"\(264, 32\) there, \(264, 48\) here.* after model_overrides=",
    ):
        Trainer(config=changed).resume()
    # written only after a successful resume
    assert (tmp_path / "run" / "config.yaml").read_text() == before
    mixer = small(tmp_path, shards, max_steps=4, model="tiny-mamba2")
    with pytest.raises(ValueError, match="its model differs from this run's"):
        Trainer(config=mixer).resume()


def test_a_torn_last_metrics_line_does_not_block_resume(tmp_path, shards, straight):
    cfg, _ = _committed(tmp_path, shards)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # killed mid-line
    with pytest.warns(UserWarning, match="dropped 1 unreadable line"):
        resumed = Trainer(config=cfg)
        assert resumed.resume()
    resumed.fit()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]


# --- one writer -----------------------------------------------------------------------------------
def test_a_second_trainer_in_the_same_out_dir_is_refused_naming_the_first(tmp_path, shards):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from ssmkit.io import DirLock; "
            "lock = DirLock(sys.argv[1], 'training').acquire(); "
            "print('held', flush=True); time.sleep(60)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        trainer = Trainer(config=small(tmp_path, shards))  # building needs no lock
        for start in (trainer.fit, trainer.resume):
            with pytest.raises(LockError, match=rf"in use by pid {holder.pid} on .*training since"):
                start()
        assert not (out / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    Trainer(config=small(tmp_path, shards, max_steps=1)).fit()  # a dead holder's lock is taken over


def test_a_trainer_whose_out_dir_was_claimed_by_another_stops(tmp_path, shards):
    first = Trainer(config=small(tmp_path, shards, max_steps=2))
    first.fit(until=1)  # out_dir is first's run now
    Trainer(config=small(tmp_path, shards, max_steps=2, overwrite=True)).fit()
    with pytest.raises(
        ValueError, match="no longer belongs to this Trainer: another run claimed it"
    ):
        first.fit()


def test_the_lock_is_held_while_training(tmp_path, shards):
    from ssmkit.io import DirLock

    seen = []

    class Probe:
        def on_log(self, trainer, record):
            try:
                DirLock(tmp_path / "run", "probe").acquire()
                seen.append("free")
            except LockError as exc:
                seen.append(str(exc))

    Trainer(config=small(tmp_path, shards, max_steps=1), callbacks=[Probe()]).fit()
    assert len(seen) == 1 and "in use by this process" in seen[0]


# --- bad configs and the command line -------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(betas=5), r"betas must be two numbers in \[0, 1\); got 5"),
        (dict(betas=["a", "b"]), r"betas must be two numbers"),
        (dict(betas=[0.9]), r"betas must be two numbers"),
        (dict(out_dir=5), "out_dir must be a non-empty string"),
        (dict(compile="yes"), "compile must be true or false"),
        (dict(decay_frac="x"), r"decay_frac must be a number in \(0, 1\]"),
    ],
)
def test_bad_values_are_one_clear_error(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**dict(max_steps=1), **kw})


def test_a_config_path_that_is_a_directory(tmp_path):
    with pytest.raises(ValueError, match="is a directory, not a YAML file"):
        TrainConfig.from_yaml(tmp_path)
    with pytest.raises(ValueError, match=r"betas must be two numbers"):
        TrainConfig.from_dict({"max_steps": 1}, overrides=["betas=[a,b]"])


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "ssmkit", "train", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_cli_bad_nproc_and_config_directory(tmp_path):
    bad = run_cli("--config", str(tmp_path), "--nproc", "0")
    assert (
        bad.returncode == 2
        and "--nproc must be >= 1" in bad.stderr
        and "Traceback" not in bad.stderr
    )
    folder = run_cli("--config", str(tmp_path))
    assert folder.returncode == 2 and folder.stderr.strip().endswith(
        "is a directory, not a YAML file (see configs/*.yaml)"
    )


@pytest.mark.parametrize(
    "code, words", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only")]
)
def test_cli_disk_full_or_read_only_is_one_line(tmp_path, shards, monkeypatch, capsys, code, words):
    from ssmkit.train import cli

    config = tmp_path / "c.yaml"
    config.write_text(small(tmp_path, shards, max_steps=2).to_yaml())

    def full(path, *a, **k):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(checkpoint, "write_json", full)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", str(config)])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and words in err and len(err.strip().splitlines()) == 1
    assert leftovers(tmp_path / "run") == []  # no partial checkpoint left


@pytest.mark.slow
def test_errors_of_every_rank_come_first_under_nproc(tmp_path, shards):
    config = tmp_path / "c.yaml"
    config.write_text(small(tmp_path, shards, max_steps=1, strategy="ddp").to_yaml())
    assert run_cli("--config", str(config)).returncode == 0  # the out_dir now holds a run
    again = run_cli("--config", str(config), "--nproc", "2")
    assert again.returncode == 1
    tail = again.stderr.strip().splitlines()[-3:]
    assert tail[0] == "ssmkit train: 2 of 2 processes failed:" or tail[0].startswith(
        "ssmkit train: 1 of 2"
    )
    assert (
        any("already holds a run" in line for line in tail)
        and "ChildFailedError" not in again.stderr
    )


@pytest.mark.parametrize("disk_full", [True, False], ids=["ENOSPC", "short-write"])
def test_torch_s_checkpoint_exception_is_one_line_and_leaves_no_temporary(
    tmp_path, shards, monkeypatch, capsys, disk_full
):
    """Fault injected: torch's DCP writer fails at step 2 with its CheckpointException, a
    BaseException (before: a long traceback, `except Exception` cleanup skipped, .tmp-step_2 left
    behind). Once wrapping ENOSPC; once a zip writer's short write with space to spare."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ssmkit.train import cli

    config = tmp_path / "c.yaml"
    config.write_text(small(tmp_path, shards, max_steps=2, ckpt_every=1).to_yaml())
    real, calls = checkpoint._quiet, []

    def writer(fn, *args, **kwargs):
        calls.append(fn)
        if fn is dcp.save and len(calls) == 2:  # step 2's state
            cause = (
                OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                if disk_full
                else RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
            )
            raise CheckpointException(
                "CheckpointException ranks:dict_keys([0])", {0: (cause, None)}
            )
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "_quiet", writer)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", str(config)])
    err = capsys.readouterr().err
    what = (
        "the disk is full (free space, or choose another out_dir, then --resume)"
        if disk_full
        else "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704"
    )
    assert exit_.value.code == 1 and err == (
        f"ssmkit train: could not write checkpoint step 2 to {tmp_path / 'run' / 'checkpoints'}: "
        f"{what}; latest still points at step_00000001\n"
    )
    assert leftovers(tmp_path / "run") == []  # .tmp-step_00000002 removed at once
