"""Shared by every test file.

* The offline environment, set once, before any test module imports transformers or huggingface_hub
  (they read it at import): hub ids load from the local cache only, and subprocesses started with
  ``env={**os.environ, ...}`` inherit it.
* Under pytest-xdist (``make test`` runs ``-n 2``: one worker per core), each worker and what it
  starts (notebook kernels, torchrun ranks, CLIs) computes on one thread, so two workers share the
  two cores instead of fighting over them.
* ``SSMKIT_KERNEL_CACHE``: the fused CPU kernels (:mod:`ssmkit.ops.s6_cpu`) build once per machine
  into the user's cache, as outside the tests; pinned here so a test that points ``SSMKIT_CACHE``
  elsewhere (and the notebooks and CLIs it starts) reuses that build instead of compiling again.
* ``SSMKIT_EXERCISES=strict``: an exercise's ``check(...)`` raises on a wrong or missing answer
  instead of printing a line, so every master a test runs under papermill (its kernel inherits this
  environment) fails on a wrong solution. A test of the printed lines unsets it.
* ``shards``: byte-level token shards of the embedded corpus (train: 60K tokens in 3 shards,
  validation: 8K), prepared once per session and only read. The tiny training config on them is
  :func:`helpers.small`. A test file may define its own ``shards`` (test_distributed.py does).
"""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["SSMKIT_EXERCISES"] = "strict"
os.environ.setdefault(
    "SSMKIT_KERNEL_CACHE",
    os.path.join(
        os.environ.get("SSMKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ssmkit"),
        "kernels",
    ),
)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    from ssmkit.data import prepare

    base = tmp_path_factory.mktemp("shards")
    prepare(
        "stdlib-docs",
        "byte",
        base / "train",
        max_tokens=60_000,
        shard_tokens=20_000,
        progress=False,
    )
    prepare(
        "stdlib-docs", "byte", base / "val", split="validation", max_tokens=8_000, progress=False
    )
    return base


@pytest.fixture
def fake_kernels(monkeypatch):
    """The fake kernel modules of tests/fake_kernels.py installed; returns the list their calls go
    to."""
    from fake_kernels import install_fake_kernels

    return install_fake_kernels(monkeypatch)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, shards):
    """:func:`helpers.small`'s run trained for 2 steps, once per session: its out_dir (a checkpoint
    at step 2 with the byte tokenizer's files, metrics.jsonl, config.yaml). Shared: read it, or copy
    it (:func:`helpers.copy_run`) to change it."""
    from helpers import small

    from ssmkit.train import Trainer

    out = tmp_path_factory.mktemp("trained")
    Trainer(config=small(out, shards, max_steps=2)).fit()
    return out / "run"


# A test that records a `screenshots` property (record_property; tests/browser) gets its folder
# named at the end of the run, with or without xdist (the workers' reports carry the property).
_screenshots: set[str] = set()


def pytest_runtest_logreport(report):
    _screenshots.update(v for k, v in report.user_properties if k == "screenshots")


def pytest_terminal_summary(terminalreporter):
    for folder in sorted(_screenshots):
        terminalreporter.write_line(f"screenshots: {folder}")
