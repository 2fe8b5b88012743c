"""ssmkit.ops.compiled: the opt-in torch.compile'd S6 chunks and SSD against the reference and the
eager path.

Chunks of 4 steps here (``CHUNK`` patched) keep inductor's compile of each graph to a few seconds;
the sequences are not multiples of 4, so the padded last chunk is always exercised. fp32 tolerance:
1e-5 of the oracle's largest magnitude (the project's fp32 bound is 1e-4).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from ssmkit import ops
from ssmkit.ops import compiled
from ssmkit.ops.backend import BackendError


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(compiled, "CHUNK", 4)
    monkeypatch.setattr(compiled, "_ENABLED", None)
    calls = []
    run = compiled.run
    monkeypatch.setattr(
        compiled, "run", lambda fn, *a, **k: calls.append(fn.__name__) or run(fn, *a, **k)
    )
    yield calls
    compiled.compile_scan(False)


def close(a, b, rel=1e-5):
    return (a - b).abs().max().item() <= rel * b.abs().max().item() + 1e-7


def s6_inputs(batch, dim, dstate, L, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    Bshape = (batch, dstate, L) if groups == 1 else (batch, groups, dstate, L)
    return dict(
        u=r(batch, dim, L),
        delta=r(batch, dim, L) * 0.5,
        A=-torch.rand(dim, dstate, generator=g) * 4,
        B=r(*Bshape),
        C=r(*Bshape),
        D=r(dim),
        z=r(batch, dim, L),
        delta_bias=r(dim) * 0.3,
        initial_state=r(batch, dim, dstate),
    )


def grads_of(fn, x, names, **kw):
    x = {k: v.clone().requires_grad_(k in names) for k, v in x.items()}
    y, h = fn(**x, delta_softplus=True, return_final_state=True, **kw)
    g = torch.Generator().manual_seed(7)
    loss = (y * torch.randn(y.shape, generator=g)).sum() + (
        h * torch.randn(h.shape, generator=g)
    ).sum()
    return [y, h, *torch.autograd.grad(loss, [x[k] for k in names])]


def test_compiled_s6_matches_the_reference_with_every_input(small_chunks):
    """Grouped B/C, D, z, Δ bias + softplus, an initial state, a final state and packed rows (a
    reset inside a chunk and one on a chunk boundary); outputs, final state and every gradient."""
    x = s6_inputs(batch=2, dim=8, dstate=4, L=11, groups=2)
    seq_idx = torch.tensor([[0] * 3 + [1] * 5 + [2] * 3, [0] * 11])
    names = list(x)
    ref = grads_of(ops.selective_scan_reference, x, names, seq_idx=seq_idx)
    ops.compile_scan(True)
    out = grads_of(ops.selective_scan_torch, x, names, seq_idx=seq_idx)
    assert small_chunks.count("chunk_forward") == 3 and small_chunks.count("chunk_backward") == 3
    for name, a, b in zip(["y", "h"] + names, out, ref):
        assert close(a, b), (name, (a - b).abs().max().item(), b.abs().max().item())


def test_compiled_s6_per_sample_states(small_chunks):
    """Per-sample states (ops.packing's initial_sample_states / return_sample_states) through the
    compiled chunks, with the first test's shapes (its graphs are reused): the chunks are cut at the
    sample starts 3 (inside a chunk) and 8 (on a boundary), each piece padded to the chunk, so four
    pieces; outputs, the samples' final states and every gradient, the initial states' included,
    as the reference."""
    x = s6_inputs(batch=2, dim=8, dstate=4, L=11, groups=2)
    x.pop("initial_state")
    seq_idx = torch.tensor([[0] * 3 + [1] * 5 + [2] * 3, [0] * 11])
    states = torch.randn(4, 8, 4, generator=torch.Generator().manual_seed(3))

    def run(fn):
        xs = {k: v.clone().requires_grad_() for k, v in x.items()}
        st = states.clone().requires_grad_()
        y, finals = fn(
            **xs,
            delta_softplus=True,
            seq_idx=seq_idx,
            initial_sample_states=st,
            return_sample_states=True,
        )
        g = torch.Generator().manual_seed(7)
        loss = sum((t * torch.randn(t.shape, generator=g)).sum() for t in (y, finals))
        return [y, finals, *torch.autograd.grad(loss, [*xs.values(), st])]

    ref = run(ops.selective_scan_reference)
    ops.compile_scan(True)
    out = run(ops.selective_scan_torch)
    assert small_chunks.count("chunk_forward") == 4 and small_chunks.count("chunk_backward") == 4
    for name, a, b in zip(["y", "finals", *x, "states"], out, ref):
        assert close(a, b), (name, (a - b).abs().max().item(), b.abs().max().item())


def test_compiled_s6_without_optional_inputs(small_chunks):
    x = s6_inputs(batch=1, dim=6, dstate=3, L=9, groups=1, seed=1)
    for k in ("D", "z", "delta_bias", "initial_state"):
        x.pop(k)
    ref = grads_of(ops.selective_scan_reference, x, list(x))
    ops.compile_scan(True)
    out = grads_of(ops.selective_scan_torch, x, list(x))
    assert small_chunks
    for a, b in zip(out, ref):
        assert close(a, b)


def test_compiled_ssd_matches_the_eager_chunked_path(small_chunks):
    """Chunks of 4 over L = 9: three chunks (the graph unrolls the state passing per chunk, so each
    one adds compile time), the last one padded, a packed-row reset inside the second."""
    g = torch.Generator().manual_seed(2)
    b, L, h, p, n = 2, 9, 4, 3, 5
    x = dict(
        x=torch.randn(b, L, h, p, generator=g),
        dt=torch.randn(b, L, h, generator=g),
        A=-torch.rand(h, generator=g),
        B=torch.randn(b, L, 2, n, generator=g),
        C=torch.randn(b, L, 2, n, generator=g),
        D=torch.randn(h, generator=g),
        initial_states=torch.randn(b, h, p, n, generator=g),
        dt_bias=torch.randn(h, generator=g),
    )
    seq_idx = torch.tensor([[0] * 6 + [1] * 3, [0] * 9])

    def run():
        t = {k: v.clone().requires_grad_() for k, v in x.items()}
        y, s = ops.ssd_scan(
            t["x"],
            t["dt"],
            t["A"],
            t["B"],
            t["C"],
            4,
            D=t["D"],
            dt_bias=t["dt_bias"],
            dt_softplus=True,
            initial_states=t["initial_states"],
            return_final_states=True,
            seq_idx=seq_idx,
            backend="torch",
        )
        loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + s.square().sum()
        return [y, s, *torch.autograd.grad(loss, list(t.values()))]

    eager = run()
    ops.compile_scan(True)
    out = run()
    assert small_chunks == ["ssd_chunked"]
    for a, e in zip(out, eager):
        assert close(a, e)


def test_a_mamba1_model_trains_the_same_compiled(small_chunks):
    """Through the mixer (channels-last views of the activations) and the whole LM: loss and
    gradients."""
    import ssmkit

    model = ssmkit.build_model(
        ssmkit.ModelConfig(d_model=16, n_layer=2, vocab_size=50, mixer="mamba1")
    )
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(3))

    def step():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    eager = step()
    ops.compile_scan(True)
    out = step()
    assert small_chunks
    for a, e in zip(out, eager):
        assert close(a, e)


def test_the_switch_reads_the_environment_and_names_bad_values(monkeypatch):
    monkeypatch.setattr(compiled, "_ENABLED", None)
    monkeypatch.setenv("SSMKIT_COMPILE_SCAN", "1")
    assert compiled.enabled()
    monkeypatch.setenv("SSMKIT_COMPILE_SCAN", "yes please")
    with pytest.raises(BackendError, match=r"SSMKIT_COMPILE_SCAN='yes please'.*0, 1, false, true"):
        compiled.enabled()
    ops.compile_scan(False)  # the call wins over the environment
    assert not compiled.enabled()
    monkeypatch.setattr(compiled, "_ENABLED", None)
    monkeypatch.delenv("SSMKIT_COMPILE_SCAN")
    assert not compiled.enabled()  # off by default


def test_no_compiler_is_a_clear_error(tmp_path):
    """Fault injected: inductor pointed at a C++ compiler that does not exist, with an empty
    cache."""
    code = (
        "import torch; from ssmkit import ops\n"
        "u = torch.randn(1, 4, 6); B = torch.randn(1, 2, 6)\n"
        "try:\n    ops.selective_scan(u, u, -torch.rand(4, 2), B, B)\n"
        "except ops.BackendError as e:\n    print('ERROR', e)\n"
    )
    env = {
        **os.environ,
        "SSMKIT_COMPILE_SCAN": "1",
        "CXX": str(tmp_path / "no-such-g++"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert "ERROR the compiled scan could not be built" in out.stdout, out.stdout + out.stderr
    assert "C++ compiler" in out.stdout and "SSMKIT_COMPILE_SCAN=0" in out.stdout


def test_the_benchmark_rows_switch_modes_and_restore_them():
    """benchmarks/train_step_cpu.py --compile-scan / --floor: each row runs in its mode, the next in
    its own; the floor rows are a bound (reported, never judged against a target)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import train_step_cpu as bench
    finally:
        sys.path.pop(0)
    scan, ssd = ops.selective_scan, ops.ssd_scan
    with bench.scan_mode("ssmkit_mamba1_compiled"):
        assert compiled.enabled() and ops.selective_scan is scan
    with bench.scan_mode("ssmkit_mamba2_noscan"):
        assert (
            not compiled.enabled()
            and ops.selective_scan is bench._no_s6
            and ops.ssd_scan is bench._no_ssd
        )
    assert (ops.selective_scan, ops.ssd_scan) == (scan, ssd) and not compiled.enabled()
    targets = bench.targets_at(2048)
    assert (
        targets["ssmkit_mamba1_compiled_vs_llama"] == 3.0
        and targets["ssmkit_mamba1_vs_llama"] == 3.0
    )
    assert targets["ssmkit_mamba1_noscan_vs_llama"] is None
    assert targets["ssmkit_mamba2_noscan_vs_llama"] is None


def test_the_profile_script_reports_a_step_and_its_top_ops():
    script = os.path.join(ROOT, "benchmarks", "profile_train_step.py")
    args = [
        "ssmkit_mamba1_noscan",
        "--seq-len",
        "64",
        "--steps",
        "1",
        "--profile-steps",
        "1",
        "--rows",
        "3",
    ]
    out = subprocess.run(
        [sys.executable, script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["model"] == "ssmkit_mamba1_noscan" and (res["batch"], res["seqlen"]) == (32, 64)
    assert res["step_ms"] > 0 and len(res["top_self_cpu_share"]) == 3
    assert "aten::mm" in out.stdout  # the projections show up in the table


@pytest.mark.parametrize("value", ["2", "yes"])
def test_a_bad_setting_is_one_line_at_startup_of_each_command(value, monkeypatch, capsys, tmp_path):
    """Fault injected: SSMKIT_COMPILE_SCAN=2 / yes (before: a traceback at the first forward pass,
    after data preparation and model loading). Checked before anything is read or written."""
    from ssmkit.cli import main

    monkeypatch.setattr(compiled, "_ENABLED", None)
    monkeypatch.setenv("SSMKIT_COMPILE_SCAN", value)
    expected = f"SSMKIT_COMPILE_SCAN={value!r}: valid values are 0, 1, false, true (or unset)"
    for command in (
        ["generate", str(tmp_path / "run"), "--prompt", "hi"],
        ["eval", "--model", str(tmp_path / "run"), "--tasks", "ssmkit_lastword"],
        ["convert", str(tmp_path / "run"), str(tmp_path / "out"), "--to", "hf"],
        ["train", "--config", str(ROOT / "configs" / "cpu-tiny.yaml"), "--set",
         f"out_dir={tmp_path / 'train'}"],
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main(command)
        err = capsys.readouterr().err
        assert exit_.value.code == 1, command
        assert err == f"ssmkit {command[0]}: {expected}\n", command
    assert not any(tmp_path.iterdir())  # nothing written


def test_no_compiler_is_one_line_at_startup(monkeypatch, tmp_path):
    """Fault injected: inductor's C++ compiler candidates replaced by one that does not exist
    (before: InductorError inside a traceback at the first forward pass)."""
    from torch._inductor import config

    from ssmkit.train.load import load_model

    monkeypatch.setattr(compiled, "_ENABLED", None)
    monkeypatch.setenv("SSMKIT_COMPILE_SCAN", "1")
    monkeypatch.setattr(config.cpp, "cxx", (None, str(tmp_path / "no-such-g++")))
    with pytest.raises(compiled.CompileScanError) as err:
        load_model(tmp_path / "run")
    message = str(err.value)
    assert message.startswith("the compiled scan is on (SSMKIT_COMPILE_SCAN / compile_scan) but")
    assert "no C++ compiler works here" in message and "SSMKIT_COMPILE_SCAN=0" in message
    assert isinstance(err.value, ValueError) and "\n" not in message
    monkeypatch.setenv("SSMKIT_COMPILE_SCAN", "0")
    with pytest.raises(ValueError, match="no such directory"):  # off: no compiler needed
        load_model(tmp_path / "run")
