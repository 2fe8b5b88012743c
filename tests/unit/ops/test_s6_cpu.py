"""ssmkit.ops.s6_cpu: the fused C++ selective scan, the default on CPU tensors, against the
reference recurrence (outputs, final states, every gradient), its dispatch, and its build: the
fallback where no compiler works, and two processes building at once.

Oracle: :func:`ssmkit.ops.selective_scan_reference` on the inputs in float64 (the reference keeps
float64), so a difference is the kernel's own fp32 error; bound: 1e-5 of the oracle's largest
magnitude (sums over thousands of steps reach 1e3, where one fp32 ulp is 6e-5). bf16 inputs: the
official kernel suite's cases and tolerances (:mod:`ssmkit.ops.tolerances`), as
test_low_precision.py holds the torch path to.

The tests share one build: the session's kernel cache (``SSMKIT_KERNEL_CACHE``, set once by
tests/conftest.py), built at the first call, as a user's machine builds it once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ssmkit
from ssmkit import ops
from ssmkit.ops import s6_cpu
from ssmkit.ops.backend import BackendError
from ssmkit.ops.tolerances import SCAN, SCAN_DA_ATOL, SCAN_DDELTA, SCAN_DU, scaled, scan_weight

REL = 1e-5


@pytest.fixture(scope="module")
def kernel():
    """The built extension (the module); a machine without a compiler fails here, loudly: the
    fused kernel is the default CPU path, so its absence is a defect of the test machine."""
    error = s6_cpu.kernel_error()
    assert error is None, f"the fused CPU scan did not build here: {error}"
    return s6_cpu._MODULE


def inputs(batch, dim, dstate, L, groups=1, seed=0, h0=True, extras=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    Bs = (batch, dstate, L) if groups == 1 else (batch, groups, dstate, L)
    x = dict(
        u=r(batch, dim, L),
        delta=r(batch, dim, L) * 0.5,
        A=-torch.rand(dim, dstate, generator=g) * 4,
        B=r(*Bs),
        C=r(*Bs),
    )
    if extras:
        x.update(D=r(dim), z=r(batch, dim, L), delta_bias=r(dim) * 0.3)
    if h0:
        x["initial_state"] = r(batch, dim, dstate)
    return x


def outputs_and_grads(fn, x, dtype=None, **kw):
    """y, h_L and the gradient of every input of a fixed random loss of both."""
    x = {k: (v if dtype is None else v.to(dtype)).clone().requires_grad_() for k, v in x.items()}
    y, h = fn(**x, return_final_state=True, **kw)
    g = torch.Generator().manual_seed(7)  # the same weights in every dtype
    loss = (y * torch.randn(y.shape, generator=g).to(y.dtype)).sum()
    loss = loss + (h * torch.randn(h.shape, generator=g).to(h.dtype)).sum()
    return {
        "y": y,
        "h": h,
        **dict(zip(["d" + k for k in x], torch.autograd.grad(loss, [*x.values()]))),
    }


def assert_matches_reference(x, oracle=ops.selective_scan_reference, **kw):
    """Fused (fp32) against the oracle in float64; returns the largest relative difference."""
    got = outputs_and_grads(lambda **a: ops.selective_scan(**a, backend="cpu"), x, **kw)
    want = outputs_and_grads(oracle, x, dtype=torch.float64, **kw)
    worst = 0.0
    for name, w in want.items():
        a = got[name]
        assert a.dtype == (torch.float32 if name != "y" else x["u"].dtype), name
        scale = w.abs().max().item() or 1.0
        diff = (a.double() - w).abs().max().item() / scale
        assert diff <= REL, f"{name}: max diff {diff:.2e} of max |ref| {scale:.3g} > {REL}"
        worst = max(worst, diff)
    return worst


# ------------------------------------------------------------------------------------------------
# parity with the reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L", [1, 7, 257, 2049])
def test_every_output_and_gradient_matches_the_reference(kernel, L):
    """Odd lengths: one step, less than a chunk, four chunks + 1, and 32 chunks + 1. dim 40 is two
    full blocks of 16 channels and a partial one; Δ bias + softplus, D, z, initial state. At 2049
    steps the oracle is the torch backend in float64 (tested against the reference in test_ops.py;
    the step-by-step reference takes minutes there)."""
    if L < 2049:
        assert_matches_reference(inputs(2, 40, 16, L), delta_softplus=True)
    else:
        x = inputs(1, 24, 16, L)
        assert_matches_reference(x, oracle=ops.selective_scan_torch, delta_softplus=True)


@pytest.mark.parametrize("groups, dim", [(2, 48), (4, 40)])
def test_grouped_B_C(kernel, groups, dim):
    """ngroups > 1: channel d uses group d // (dim / ngroups); 24 and 10 channels per group put a
    partial block at the end of every group."""
    assert_matches_reference(inputs(2, dim, 16, 130, groups=groups, seed=1), delta_softplus=True)


@pytest.mark.parametrize("dstate", [1, 5, 64])
def test_other_state_sizes(kernel, dstate):
    assert_matches_reference(inputs(1, 20, dstate, 70, seed=2), delta_softplus=True)


def test_without_the_optional_inputs_and_without_softplus(kernel):
    """No D, z, Δ bias or initial state; Δ used as given (positive, or the state would grow)."""
    x = inputs(2, 17, 16, 100, seed=3, h0=False, extras=False)
    x["delta"] = x["delta"].abs()
    assert_matches_reference(x)


def test_packed_rows_with_seq_idx(kernel):
    """Resets inside a chunk, exactly on a chunk boundary (t = 64, 128), at t = 0 of a row that does
    not start with sample 0 (the initial state does not reach it), and a row of one sample."""
    L = 140
    seq_idx = torch.zeros(3, L, dtype=torch.int32)
    seq_idx[0, 30:] = 1
    seq_idx[0, 64:] = 2
    seq_idx[0, 128:] = 3
    seq_idx[1, :] = 1
    seq_idx[1, 100:] = 2
    assert_matches_reference(inputs(3, 24, 16, L, seed=4), delta_softplus=True, seq_idx=seq_idx)


def test_a_packed_row_is_its_samples_run_one_by_one(kernel):
    """A second oracle: with seq_idx, each sample's outputs equal a separate call on that sample."""
    x = inputs(1, 16, 16, 90, seed=5, h0=False)
    seq_idx = torch.tensor([[0] * 40 + [1] * 50])
    y = ops.selective_scan(**x, delta_softplus=True, seq_idx=seq_idx, backend="cpu")
    for lo, hi in ((0, 40), (40, 90)):
        part = {k: (v[..., lo:hi] if v.dim() == 3 else v) for k, v in x.items()}
        alone = ops.selective_scan(**part, delta_softplus=True, backend="cpu")
        torch.testing.assert_close(y[..., lo:hi], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seqlen", [128, 256])
def test_bf16_inputs_at_the_kernel_suites_tolerances(kernel, seqlen, groups):
    """mamba_ssm's test_selective_scan in bf16: the op on bf16 inputs against the reference on the
    inputs upcast to fp32, output rounded to bf16, each at the suite's tolerance."""
    itype = torch.bfloat16
    rtol, atol = SCAN[itype]
    rtolw, atolw = scan_weight(itype)
    g = torch.Generator().manual_seed(0)
    batch, dim, dstate = 2, 24, 8
    bc = (batch, dstate, seqlen) if groups == 1 else (batch, groups, dstate, seqlen)
    x = dict(
        u=torch.randn(batch, dim, seqlen, generator=g).to(itype),
        delta=(0.5 * torch.rand(batch, dim, seqlen, generator=g)).to(itype),
        A=-0.5 * torch.rand(dim, dstate, generator=g),
        B=torch.randn(*bc, generator=g).to(itype),
        C=torch.randn(*bc, generator=g).to(itype),
        D=torch.randn(dim, generator=g),
        z=torch.randn(batch, dim, seqlen, generator=g).to(itype),
        delta_bias=0.5 * torch.rand(dim, generator=g),
    )
    grad = torch.randn(batch, dim, seqlen, generator=g).to(itype)

    def run(fn, x, grad):
        leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
        y, h = fn(**leaves, delta_softplus=True, return_final_state=True)
        y.backward(grad)
        return y, h, {k: v.grad for k, v in leaves.items()}

    y, h, d = run(lambda **a: ops.selective_scan(**a, backend="cpu"), x, grad)
    upcast = {k: v.float() for k, v in x.items()}
    y_ref, h_ref, d_ref = run(ops.selective_scan_reference, upcast, grad.float())

    def close(a, b, rtol, atol, what):
        bad = (a.float() - b.float()).abs() - (atol + rtol * b.float().abs())
        assert bad.max() <= 0, f"{what}: over the tolerance by {bad.max().item():.3g}"

    assert y.dtype == itype and h.dtype == torch.float32
    close(y, y_ref.to(itype), rtol, atol, "output")
    close(h, h_ref, rtol, atol, "final state")
    close(d["u"], d_ref["u"].to(itype), *scaled((rtol, atol), SCAN_DU), "du")
    close(d["delta"], d_ref["delta"].to(itype), *scaled((rtol, atol), SCAN_DDELTA), "ddelta")
    close(d["A"], d_ref["A"], rtolw, SCAN_DA_ATOL * atolw, "dA")
    for name in ("B", "C"):
        close(d[name], d_ref[name].to(itype), rtol, atol, f"d{name}")
    for name in ("D", "z", "delta_bias"):
        close(d[name], d_ref[name], rtolw, atolw, f"d{name}")


def test_inference_and_layout(kernel):
    """Without autograd (no chunk states kept) the outputs are the training forward's; y comes back
    in u's layout: contiguous for a contiguous u, a channels-last view for a channels-last u (what
    the mixer passes); z may be a strided view (the mixer's is half of in_proj's output), read in
    place, its gradient the same."""
    x = inputs(2, 40, 16, 65, seed=6)
    with torch.no_grad():
        y_inf, h_inf = ops.selective_scan(**x, delta_softplus=True, return_final_state=True)
    y, h = ops.selective_scan(
        **{k: v.clone().requires_grad_() for k, v in x.items()},
        delta_softplus=True,
        return_final_state=True,
    )
    assert torch.equal(y_inf, y.detach()) and torch.equal(h_inf, h.detach())
    assert y_inf.is_contiguous()
    u = x["u"].transpose(1, 2).contiguous().transpose(1, 2)
    y_cl = ops.selective_scan(**{**x, "u": u}, delta_softplus=True, backend="cpu")
    assert y_cl.stride(1) == 1 and torch.equal(y_cl, y_inf)
    xz = torch.cat([x["z"].transpose(1, 2), torch.randn_like(x["z"]).transpose(1, 2)], -1)
    xz.requires_grad_()
    z = xz[..., : x["z"].shape[1]].transpose(1, 2)  # (b, d, L) with time stride 2d
    y_z = ops.selective_scan(**{**x, "z": z}, delta_softplus=True, backend="cpu")
    assert torch.equal(y_z.detach(), y_inf)
    zc = x["z"].clone().requires_grad_()
    y_c = ops.selective_scan(**{**x, "z": zc}, delta_softplus=True, backend="cpu")
    g = torch.randn_like(y_c)
    (dz_strided,) = torch.autograd.grad(y_z, xz, g)
    (dz,) = torch.autograd.grad(y_c, zc, g)
    assert torch.equal(dz_strided[..., : dz.shape[1]].transpose(1, 2), dz)


# ------------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------------


def test_the_cpu_default_is_the_fused_kernel_and_torch_stays_reachable(kernel, monkeypatch):
    """Automatic on CPU tensors: the fused kernel; backend='torch' and SSMKIT_BACKEND=torch: the
    pure-PyTorch path; float64 (which the kernel would round to fp32): the torch path."""
    s6 = sys.modules["ssmkit.ops.s6"]
    calls = []
    for name in ("torch", "cpu"):
        real = s6._IMPLS[name]
        monkeypatch.setitem(
            s6._IMPLS, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k)
        )
    monkeypatch.delenv("SSMKIT_BACKEND", raising=False)
    x = inputs(1, 8, 4, 5, h0=False)
    ops.selective_scan(**x)
    ops.selective_scan(**x, backend="torch")
    ops.selective_scan(**{k: v.double() for k, v in x.items()})
    monkeypatch.setenv("SSMKIT_BACKEND", "torch")
    ops.selective_scan(**x)
    monkeypatch.setenv("SSMKIT_BACKEND", "cpu")
    ops.selective_scan(**x)
    assert calls == ["cpu", "torch", "torch", "torch", "cpu"]
    with pytest.raises(BackendError, match="fused CPU selective scan cannot run: float64"):
        ops.selective_scan(**{k: v.double() for k, v in x.items()})
    assert ops.backend.select("ssd_scan", x["u"]) == "torch"  # no fused CPU kernel: its torch path


def test_env_report_shows_the_cpu_backend(kernel, monkeypatch):
    monkeypatch.delenv("SSMKIT_BACKEND", raising=False)
    report = ssmkit.env_report()
    assert any(line.split()[:2] == ["selective_scan", "cpu"] for line in report.splitlines()), (
        report
    )
    assert "cpu" in ops.BACKENDS


# ------------------------------------------------------------------------------------------------
# the build: no compiler, and two processes at once
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """This process's kernel forgotten and the cache empty, as on a machine that never built it;
    restored afterwards."""
    monkeypatch.setattr(s6_cpu, "_MODULE", None)
    monkeypatch.setattr(s6_cpu, "_ERROR", None)
    monkeypatch.setenv("SSMKIT_KERNEL_CACHE", str(tmp_path / "kernels"))
    s6_cpu._compiler_id.cache_clear()
    yield tmp_path / "kernels"
    s6_cpu._compiler_id.cache_clear()


def test_no_compiler_is_one_line_and_the_torch_path(kernel, fresh_build, monkeypatch, capsys):
    """Fault injected: CXX names no compiler. One line on stderr (what failed, that the torch path
    runs, how to get the fast path), once per process; results equal to the torch path's; a forced
    cpu backend raises instead; env_report says so without building."""
    monkeypatch.setenv("CXX", str(fresh_build / "no-such-compiler"))
    monkeypatch.delenv("SSMKIT_BACKEND", raising=False)
    assert "torch (no C++ compiler" in ops.backend.describe("cpu")["selective_scan"]
    x = inputs(2, 20, 16, 33)
    y = ops.selective_scan(**x, delta_softplus=True)
    y2 = ops.selective_scan(**x, delta_softplus=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "fused CPU selective scan could not be built" in lines[0]
    assert "no C++ compiler" in lines[0] and "pure-PyTorch scan instead" in lines[0]
    assert "install a C++ compiler" in lines[0]
    want = ops.selective_scan(**x, delta_softplus=True, backend="torch")
    assert torch.equal(y, want) and torch.equal(y2, want)
    with pytest.raises(BackendError, match="'cpu' was forced for selective_scan but cannot run"):
        ops.selective_scan(**x, backend="cpu")
    assert not fresh_build.exists() or not any(fresh_build.iterdir())


def test_a_failing_build_falls_back(kernel, fresh_build, monkeypatch, capsys):
    """Fault injected: the build itself raises (a compile error, an unwritable cache, ...)."""

    def broken(*a, **k):
        raise RuntimeError("Error building extension 'ssmkit_s6_cpu': boom\nmore lines")

    monkeypatch.setattr("torch.utils.cpp_extension.load", broken)
    x = inputs(1, 8, 16, 9)
    y = ops.selective_scan(**x, delta_softplus=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Error building extension 'ssmkit_s6_cpu': boom" in err[0], err
    assert torch.equal(y, ops.selective_scan(**x, delta_softplus=True, backend="torch"))
    leftovers = [p.name for p in fresh_build.iterdir() if not p.name.startswith(".ssmkit")]
    assert leftovers == [], leftovers  # the temporary build folder is gone


RACE = r"""
import json, os, shutil, sys, time
from torch.utils import cpp_extension
from ssmkit.ops import s6_cpu

real_library, log = sys.argv[1], sys.argv[2]

def slow_build(name, sources, build_directory, **kw):
    # the compile replaced by a copy of the real library after a pause, so the two processes
    # overlap for certain; everything around it (lock, temporary folder, rename) is the real one
    with open(log, "a") as f:
        f.write(f"build {os.getpid()}\n")
    time.sleep(2)
    target = os.path.join(build_directory, os.path.basename(real_library))
    shutil.copy(real_library, target)
    return s6_cpu._import(s6_cpu.Path(target), name)

cpp_extension.load = slow_build
print(json.dumps({"error": s6_cpu.kernel_error(), "module": s6_cpu._MODULE.__name__}))
"""


def test_two_processes_building_at_once_both_succeed(kernel, tmp_path):
    """Two processes start with an empty cache at the same moment: one builds (under the lock, in a
    temporary folder renamed into place), the other waits for it and imports the result; both
    scan. No temporary folder is left behind."""
    name, target = s6_cpu._names()
    real = s6_cpu._library(target, name)
    assert real is not None
    cache = tmp_path / "kernels"
    log = tmp_path / "builds.log"
    env = {**os.environ, "SSMKIT_KERNEL_CACHE": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(real), str(log)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        res = json.loads(out.strip().splitlines()[-1])
        assert res == {"error": None, "module": name}, (res, err)
    assert log.read_text().count("build") == 1  # the second process found the first one's build
    entries = sorted(p.name for p in cache.iterdir())
    assert entries == [".ssmkit.lock", target.name], entries
    shutil.rmtree(cache)
