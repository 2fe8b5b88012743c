"""The memory planner (ssmkit.train.planner) against its oracles: the real model's parameter count,
the tensors autograd saves, and the measured peak memory of a CPU training step; and the stage's run
configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

import ssmkit
from ssmkit.ops import s6_cpu
from ssmkit.train import MemoryPlan, TrainConfig, memory_table, plan_memory, planner, scale_up_plans

MB = 2**20

# Small configs whose activations are tens to hundreds of MB, so the planner's terms dominate the
# noise
M1 = dict(d_model=256, n_layer=4, vocab_size=1000, mixer="mamba1")
M2 = dict(
    d_model=256, n_layer=4, vocab_size=1000, mixer="mamba2", d_state=64, headdim=32, chunk_size=64
)
HYBRID = dict(
    d_model=256,
    n_layer=4,
    vocab_size=1000,
    mixer="mamba1",
    attn_every=2,
    attn_offset=1,
    attn_cfg=dict(num_heads=4),
    d_intermediate=512,
)
M3 = dict(
    d_model=256, n_layer=4, vocab_size=1000, mixer="mamba3", d_state=64, headdim=32, chunk_size=64
)
M3_MIMO = dict(M3, is_mimo=True, mimo_rank=2)
S4D = dict(d_model=256, n_layer=4, vocab_size=1000, mixer="s4d", d_state=32)
H3 = dict(
    d_model=256,
    n_layer=4,
    vocab_size=1000,
    mixer="h3",
    h3=dict(d_state=16, head_dim=4, shift_size=4),
)
CPU_FP32 = dict(precision="fp32", strategy="single", backend="cpu")  # a CPU run's default path


def cpu_plan(cfg: dict, batch: int, seq_len: int, **kw) -> MemoryPlan:
    return plan_memory(
        ssmkit.ModelConfig(**cfg), seq_len=seq_len, micro_batch=batch, **{**CPU_FP32, **kw}
    )


# --- parameters -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        "tiny",
        "tiny-mamba2",
        "tiny-hybrid",
        "mamba-130m",
        "tiny-mamba3",
        "mamba3-130m",
        dict(M3_MIMO, mimo_rank=4, is_outproj_norm=True, ngroups=2),
        dict(M1, d_intermediate=300, tie_embeddings=False),
        dict(HYBRID, attn_cfg=dict(num_heads=4, num_heads_kv=2, rotary_emb_dim=16)),
    ],
)
def test_parameter_count_is_the_real_models(cfg):
    """Counted on the meta device, equal to the count of the model build_model makes."""
    config = ssmkit.ModelConfig.preset(cfg) if isinstance(cfg, str) else ssmkit.ModelConfig(**cfg)
    plan = plan_memory(cfg if isinstance(cfg, str) else config, seq_len=64, micro_batch=1)
    assert plan.params == ssmkit.build_model(config).num_parameters()


def test_model_state_and_sharding():
    """16 bytes per parameter (fp32 weights and gradients, AdamW's m and v); FSDP on 8 GPUs keeps
    1/8 of each, DDP all of it plus its gradient buckets; activations do not depend on the
    strategy."""
    one = plan_memory("mamba-1.4b", seq_len=2048, micro_batch=8, strategy="single")
    fsdp = plan_memory("mamba-1.4b", seq_len=2048, micro_batch=8, strategy="fsdp", n_gpus=8)
    ddp = plan_memory("mamba-1.4b", seq_len=2048, micro_batch=8, strategy="ddp", n_gpus=8)
    P = one.params
    assert (one.weights, one.grads, one.optimizer) == (4 * P, 4 * P, 8 * P)
    for name in ("weights", "grads", "optimizer"):
        assert abs(getattr(fsdp, name) - getattr(one, name) / 8) <= 1
    assert (ddp.weights, ddp.grads, ddp.optimizer) == (4 * P, 8 * P, 8 * P)
    assert fsdp.activations == one.activations == ddp.activations
    assert fsdp.total < one.total < ddp.total
    # one process: ddp and fsdp wrap nothing (ssmkit.train.distributed.wrap), so they plan as single
    assert (
        plan_memory("mamba-130m", seq_len=512, micro_batch=2, strategy="fsdp").total
        == plan_memory("mamba-130m", seq_len=512, micro_batch=2, strategy="single").total
    )


def test_terms_grow_and_shrink_as_they_should():
    base = dict(model="mamba-370m", seq_len=1024, micro_batch=4, n_gpus=8)
    plan = lambda **kw: plan_memory(**{**base, **kw})  # noqa: E731
    p = plan()
    assert (
        plan(micro_batch=8).activations > p.activations
        and plan(seq_len=2048).activations > p.activations
    )
    assert plan(micro_batch=8).total > p.total
    assert plan(activation_checkpointing=True).activations < p.activations / 4
    assert plan(loss_chunk_size=1024).activations < p.activations
    assert plan(precision="fp32").activations > p.activations
    assert plan(backend="torch").activations > p.activations  # the torch scan keeps chunk states
    assert plan_memory("mamba-1.4b", seq_len=1024, micro_batch=4).params > p.params
    # activations are linear in the tokens for the cuda kernels (but for A = -exp(A_log), one per
    # layer)
    assert plan(micro_batch=8).activations == pytest.approx(2 * p.activations, rel=1e-3)


def test_max_micro_batch_is_the_largest_that_fits():
    for kw in (
        dict(model="mamba-1.4b", n_gpus=8),
        dict(model="mamba2-1.3b", n_gpus=8, gpu_memory_gb=40),
        dict(model="mamba-130m", strategy="single", activation_checkpointing=True),
        dict(model="hybrid-130m", strategy="ddp", n_gpus=2, precision="fp32"),
    ):
        plan = plan_memory(seq_len=2048, micro_batch=1, **kw)
        best = plan.max_micro_batch
        assert best >= 1
        assert plan_memory(seq_len=2048, micro_batch=best, **kw).fits
        assert not plan_memory(seq_len=2048, micro_batch=best + 1, **kw).fits
    small = plan_memory(
        "mamba-1.4b", seq_len=2048, micro_batch=1, strategy="single", gpu_memory_gb=8
    )
    assert small.max_micro_batch == 0 and not small.fits
    assert small.usable == int(
        8 * 2**30 * (1 - planner.SAFETY_MARGIN) - planner.RESERVED_GIB * 2**30
    )


# --- activations: the formulas against what autograd saves ----------------------------------------


def saved_bytes(
    cfg: ssmkit.ModelConfig, batch: int, seq_len: int, checkpointing: bool = False
) -> int:
    """Bytes of the distinct tensors (storages) autograd saves for the backward during a forward
    with the trainer's loss, parameters left out: what the planner calls activations (fp32, on the
    backend the ops choose: SSMKIT_BACKEND or automatic)."""
    torch.manual_seed(0)
    model = ssmkit.build_model(cfg).train()
    model.backbone.gradient_checkpointing = checkpointing
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ssmkit.eval.lm_loss(model, ids, ids)
    del loss
    return sum(seen.values())


SAVED_CASES = [
    (M1, 1, 256, False),
    (M2, 1, 256, False),
    (HYBRID, 1, 256, False),
    (M1, 2, 128, True),
    (dict(M2, d_state=32, chunk_size=48, ngroups=2), 3, 100, False),  # padded last chunk
    (
        dict(HYBRID, attn_cfg=dict(num_heads=4, num_heads_kv=2, rotary_emb_dim=32)),
        1,
        128,
        False,
    ),
    (
        dict(M1, n_layer=2, layout=["mamba1", "swa"], attn_cfg=dict(num_heads=4, window_size=64)),
        1,
        256,
        False,
    ),  # blocks of 64 queries
    # Mamba-3: SISO; a padded last chunk with ngroups 2; softplus A and every pair rotated;
    # checkpointing;
    (M3, 1, 256, False),
    (dict(M3, d_state=40, chunk_size=48, headdim=16, ngroups=2), 3, 100, False),
    (dict(M3, a_activation="softplus", rope_fraction=1.0), 2, 128, False),
    (M3, 2, 128, True),
    # MIMO (the CPU chunk is 64 // rank): unpadded and padded, rank 4, rank 1, the norm before
    # out_proj
    (M3_MIMO, 1, 256, False),
    (dict(M3_MIMO, mimo_rank=3, d_state=40, chunk_size=48, headdim=16), 3, 100, False),
    (dict(M3_MIMO, mimo_rank=4, d_state=32), 1, 255, False),
    (dict(M3_MIMO, mimo_rank=1), 1, 128, False),
    (dict(M3_MIMO, is_outproj_norm=True), 1, 130, False),
    (dict(M3, is_outproj_norm=True, ngroups=2), 2, 100, False),
    # S4D and H3: their diagonal SSM's Vandermonde matrix is per sequence, the rest per token;
    # the bilinear rule, one channel per head, a hybrid, checkpointing
    (S4D, 1, 256, False),
    (dict(S4D, s4d=dict(d_state=16, disc="bilinear", expand=1)), 3, 100, False),
    (S4D, 2, 128, True),
    (H3, 1, 256, False),
    (
        dict(
            H3,
            n_layer=2,
            layout=["h3", "attn"],
            attn_cfg=dict(num_heads=4),
            d_intermediate=512,
            h3=dict(d_state=32, head_dim=1, disc="zoh"),
        ),
        2,
        128,
        False,
    ),
    # a mixture of experts on layers 1 and 3 (4 experts, top 2), dense MLPs on 0 and 2
    (dict(M1, d_intermediate=256, num_experts=4, num_experts_per_tok=2), 2, 128, False),
    # a Mamba-3 + attention hybrid with MLPs
    (
        dict(
            M3,
            n_layer=2,
            layout=["mamba3", "attn"],
            attn_cfg=dict(num_heads=4),
            d_intermediate=512,
        ),
        1,
        256,
        False,
    ),
]


def _backends(cfg: dict) -> tuple[str, ...]:
    """The CPU backends whose formulas differ for ``cfg``: both where a layer is Mamba-1 (the fused
    scan against the torch scan), else "cpu" alone (every other part is the same PyTorch code)."""
    return ("cpu", "torch") if "mamba1" in ssmkit.ModelConfig(**cfg).mixers else ("cpu",)


@pytest.mark.parametrize(
    "cfg,batch,seq_len,ckpt,backend",
    [(*case, backend) for case in SAVED_CASES for backend in _backends(case[0])],
)
def test_activation_formulas_match_the_saved_tensors(
    cfg, batch, seq_len, ckpt, backend, monkeypatch
):
    """backend "cpu": the ops' automatic choice on CPU tensors (the fused Mamba-1 scan), "torch":
    SSMKIT_BACKEND=torch (the PyTorch path everywhere)."""
    if backend == "torch":
        monkeypatch.setenv("SSMKIT_BACKEND", "torch")
    else:
        monkeypatch.delenv("SSMKIT_BACKEND", raising=False)
        # the fused kernel is the default CPU path: its absence is a defect of the machine
        assert ssmkit.ops.backend.select("selective_scan") == "cpu", s6_cpu.kernel_error()
    config = ssmkit.ModelConfig(**cfg)
    planned = cpu_plan(cfg, batch, seq_len, activation_checkpointing=ckpt, backend=backend)
    assert planned.activations == pytest.approx(saved_bytes(config, batch, seq_len, ckpt), rel=0.03)


def test_mamba2_activations_with_the_recomputing_ssd(monkeypatch):
    """Above ssmkit.ops.ssd.RECOMPUTE_FROM the SSD keeps its inputs and one state per segment
    (forced here, with short segments so that several run): the formula against the saved tensors,
    padded last chunk and segment included, and far below the autograd path's."""
    monkeypatch.setattr(sys.modules["ssmkit.ops.ssd"], "RECOMPUTE_SEGMENT", 128)
    cfg = dict(M2, d_state=32, chunk_size=48, ngroups=2)
    plain = cpu_plan(cfg, 3, 300).activations
    ssmkit.ops.ssd_recompute(True)
    try:
        planned = cpu_plan(cfg, 3, 300).activations
        assert planned == pytest.approx(saved_bytes(ssmkit.ModelConfig(**cfg), 3, 300), rel=0.03)
    finally:
        ssmkit.ops.ssd_recompute(None)
    assert planned < 0.6 * plain


def test_mamba3_plans_on_both_backends():
    """Mamba-3 is planned (it was refused before): the cuda kernels keep O(L) per layer, linear in
    the micro-batch; the torch path keeps its (Q'r)² blocks, so more; MIMO's kernel recomputes in
    the backward what the SISO kernel saves, and its rank multiplies the torch path's blocks."""
    kw = dict(seq_len=2048, micro_batch=4, n_gpus=8)
    plan = plan_memory("mamba3-130m", **kw)
    assert plan.fits and plan.max_micro_batch >= 4
    assert plan_memory("mamba3-130m", **{**kw, "micro_batch": 8}).activations == pytest.approx(
        2 * plan.activations, rel=1e-6
    )
    assert plan_memory("mamba3-130m", backend="torch", **kw).activations > 1.5 * plan.activations
    siso, mimo = (
        ssmkit.ModelConfig.preset("mamba3-130m", is_mimo=m, mimo_rank=4) for m in (False, True)
    )
    for backend, more in (("cuda", False), ("torch", True)):
        a, b = (plan_memory(c, backend=backend, **kw).activations for c in (siso, mimo))
        assert (b > a) == more, (backend, a, b)
    assert (
        planner.main(["--model", str(ROOT / "configs/cpu-tiny-mamba3.yaml"), "--backend", "cpu"])
        == 0
    )


def test_cpu_backend_differs_from_torch_in_mamba1_alone(capsys):
    """ "cpu" (a CPU run's default) plans the fused Mamba-1 scan, which keeps a state per 64 steps
    and no per-step tensors: fewer activations than the torch scan, still linear in the tokens;
    every other mixer takes the same PyTorch code on both, so plans alike. The command line takes
    it."""
    kw = dict(seq_len=4096, micro_batch=1, precision="fp32", strategy="single")
    cpu, torch_path = (plan_memory("mamba-130m", backend=b, **kw) for b in ("cpu", "torch"))
    assert cpu.activations < torch_path.activations and cpu.weights == torch_path.weights
    longer = plan_memory("mamba-130m", backend="cpu", **{**kw, "seq_len": 8192})
    assert longer.activations == pytest.approx(2 * cpu.activations, rel=2e-3)
    for preset in ("mamba2-130m", "mamba3-130m"):
        a, b = (plan_memory(preset, backend=x, **kw) for x in ("cpu", "torch"))
        assert a.total == b.total, preset
    argv = ["--model", "mamba-130m", "--seq-len", "4096", "--micro-batch", "1", "--json"]
    assert (
        planner.main([*argv, "--precision", "fp32", "--strategy", "single", "--backend", "cpu"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["activations"] == cpu.activations


# --- the whole step: planned against measured -----------------------------------------------------

MEASURE = r"""
import ctypes, gc, json, sys
import torch, ssmkit
from ssmkit.eval import lm_loss
from ssmkit.eval.long_context import fix_mmap_threshold, measure_call
from ssmkit.train import TrainConfig, build_optimizer


torch.set_num_threads(1)     # steadier on a busy machine (no spinning OpenMP threads)
assert fix_mmap_threshold()  # freed tensors go back to the OS: RSS follows the live ones
libc = ctypes.CDLL("libc.so.6")


def rss_mb():
    gc.collect()
    libc.malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def setup(cfg, batch, seq_len, ckpt):
    torch.manual_seed(0)
    model = ssmkit.build_model(ssmkit.ModelConfig(**cfg)).train()
    model.backbone.gradient_checkpointing = ckpt
    opt = build_optimizer(model, TrainConfig(max_steps=1))
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq_len))

    def step():                               # Trainer._loop's step, the gradients kept (zeroed)
        lm_loss(model, ids, ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return step


for cfg, batch, seq_len, ckpt in json.loads(sys.argv[1]):
    if "attn_cfg" in cfg:
        small = dict(cfg, d_model=64, headdim=16, attn_cfg=dict(num_heads=2))
    else:
        small = dict(cfg, d_model=64, **({"headdim": 16} if "headdim" in cfg else {}))
    step = None                               # the last config's model goes before the baseline
    setup(small, 1, 64, ckpt)()               # the kernels' code pages in, before the baseline
    before = rss_mb()
    step = setup(cfg, batch, seq_len, ckpt)
    step()                                    # AdamW's state and the gradients now exist
    state = rss_mb() - before
    peak = measure_call(step)[2]
    print(json.dumps({"state_mb": state, "step_mb": peak}), flush=True)
"""

# in three groups, each one process: the groups run side by side under pytest-xdist
MEASURED = [
    (M1, 4, 256, False),
    (M1, 8, 128, True),
    (M2, 4, 256, False),
    (M2, 8, 128, True),
    (HYBRID, 4, 256, False),
    (HYBRID, 8, 128, True),
    (M3, 4, 256, False),
    (M3, 8, 128, True),
    (M3_MIMO, 2, 256, False),
    (S4D, 4, 256, False),
    (S4D, 8, 128, True),
    (H3, 4, 256, False),
    (H3, 8, 128, True),
]
GROUPS = {"mamba1-mamba2": MEASURED[:4], "hybrid-mamba3": MEASURED[4:9], "s4d-h3": MEASURED[9:]}


@pytest.mark.slow
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RSS is read from /proc (Linux, glibc)"
)
@pytest.mark.parametrize("group", GROUPS)
def test_planner_matches_measured_peak_memory_on_cpu(group):
    """Each config's training step (lm_loss forward, backward, clip, AdamW step, as Trainer._loop)
    runs in a fresh process, so no earlier test's allocations or malloc tuning (the Trainer's
    reuse_freed_memory keeps freed memory) sit in its resident set. Memory is the RSS, with glibc's
    mmap threshold fixed at 128 KiB (ssmkit.eval.long_context.fix_mmap_threshold) so that freed
    tensors leave it. Per config:

    * model state: the RSS after one step (weights, AdamW's m and v, the gradients kept) less the
      RSS before the model was built; a smaller copy of the model ran a step first, so the kernels'
      code pages are already in the baseline;
    * step: the peak RSS during the next step above the RSS before it
      (ssmkit.eval.long_context.measure_call, one step): activations and workspace.

    The planned activations + workspace must be within 25% of the measured step, and the planned
    total within 25% of state + step."""
    measured_configs = GROUPS[group]
    runs = [[cfg, b, L, ckpt] for cfg, b, L, ckpt in measured_configs]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    measured = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(measured) == len(measured_configs)
    rows, bad = [], []
    for (cfg, batch, seq_len, ckpt), m in zip(measured_configs, measured):
        p = cpu_plan(cfg, batch, seq_len, activation_checkpointing=ckpt)
        step = (p.activations + p.workspace) / MB
        kind = (
            "hybrid" if cfg is HYBRID else f"{cfg['mixer']}{' MIMO' if cfg.get('is_mimo') else ''}"
        )
        name = f"{kind} {batch}x{seq_len}{' ckpt' if ckpt else ''}"
        ratios = step / m["step_mb"], p.total / MB / (m["state_mb"] + m["step_mb"])
        rows.append(
            f"| {name} | {step:.0f} | {m['step_mb']:.0f} | {ratios[0]:.2f} | {p.total / MB:.0f} | "
            f"{m['state_mb'] + m['step_mb']:.0f} | {ratios[1]:.2f} |"
        )
        if not all(0.75 <= r <= 1.25 for r in ratios):
            bad.append(name)
    print(
        "\n| config | step planned MB | measured | ratio | total planned MB | measured | ratio |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows)
    )
    assert not bad, f"planned vs measured off by more than 25% for {bad}:\n" + "\n".join(rows)


# --- the A100 table, the command line, bad input --------------------------------------------------


def test_scale_up_table_on_8_a100():
    plans = scale_up_plans(ways=("fsdp", "fsdp+ckpt"))
    assert list(plans) == [
        f"{n} {s}" for n in planner.SCALE_UP_PRESETS for s in ("fsdp", "fsdp+ckpt")
    ]
    table = memory_table(plans)
    assert table.count("\n") == 2 + len(planner.ROWS) + 2 - 1 and "mamba-1.4b fsdp+ckpt" in table
    big, ckpt = plans["mamba-1.4b fsdp"], plans["mamba-1.4b fsdp+ckpt"]
    assert (big.n_gpus, big.strategy, big.precision, big.seq_len) == (8, "fsdp", "bf16", 2048)
    assert big.fits and ckpt.max_micro_batch > big.max_micro_batch >= big.micro_batch == 8
    assert big.as_dict()["total"] == big.total and "max micro_batch" in big.table()


def test_scale_up_plans_cover_each_way():
    plans = scale_up_plans(["mamba-370m"])
    assert list(plans) == ["mamba-370m ddp", "mamba-370m fsdp", "mamba-370m fsdp+ckpt"]
    ddp, fsdp, ckpt = plans.values()
    assert fsdp.optimizer * 8 == pytest.approx(ddp.optimizer, rel=0.01)  # sharded over 8 GPUs
    assert ckpt.activations < fsdp.activations and ddp.n_gpus == 8
    with pytest.raises(
        ValueError, match="ways=.*valid: a non-empty list of ddp, fsdp, fsdp\\+ckpt"
    ):
        scale_up_plans(ways=("zero3",))


def test_cli(capsys):
    assert (
        planner.main(
            [
                "--model",
                "mamba-1.4b",
                "--seq-len",
                "2048",
                "--micro-batch",
                "8",
                "--gpus",
                "8",
                "--activation-checkpointing",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "mamba-1.4b: 1,372,178,432 parameters" in out and "activation checkpointing" in out
    assert (
        planner.main(["--model", str(ROOT / "configs/mamba2-1.3b.yaml"), "--gpus", "8", "--json"])
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    assert [got[k] for k in ("model", "seq_len", "micro_batch", "strategy")] == [
        "mamba2-1.3b",
        2048,
        8,
        "fsdp",
    ]
    assert (
        planner.main(
            [
                "--model",
                "mamba-130m",
                "--seq-len",
                "512",
                "--micro-batch",
                "2",
                "--precision",
                "fp8",
            ]
        )
        == 2
    )
    assert "precision='fp8' is not valid; valid: fp32, bf16, fp16" in capsys.readouterr().err
    assert planner.main(["--model", "mamba-130m", "--micro-batch", "2"]) == 2
    assert "a preset needs --seq-len (a run config has its own)" in capsys.readouterr().err
    assert (
        cli_main_exit(["plan", "--model", "mamba-130m", "--seq-len", "64", "--micro-batch", "1"])
        == 0
    )
    assert "mamba-130m" in capsys.readouterr().out


def cli_main_exit(argv) -> int:
    """``ssmkit ARGV`` in-process: its exit status (main returns on success, exits otherwise)."""
    from ssmkit.cli import main

    try:
        main(argv)
    except SystemExit as exit_:
        return exit_.code
    return 0


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(model="mamba-9b"), "model='mamba-9b' is not valid; valid: a preset (tiny,"),
        (dict(precision="fp8"), "precision='fp8' is not valid; valid: fp32, bf16, fp16"),
        (dict(strategy="zero3"), "strategy='zero3' is not valid; valid: single, ddp, fsdp"),
        (dict(backend="triton"), "backend='triton' is not valid; valid: cuda, cpu, torch"),
        (dict(optimizer="sgd"), "optimizer='sgd' is not valid; valid: adamw"),
        (dict(micro_batch=0), "micro_batch must be a positive integer; got 0"),
        (dict(seq_len="long"), "seq_len must be a positive integer; got 'long'"),
        (dict(seq_len=None), "seq_len must be a positive integer; got None"),
        (dict(n_gpus=0), "n_gpus must be a positive integer; got 0"),
        (dict(gpu_memory_gb=-1), "gpu_memory_gb must be a positive number; got -1"),
        (dict(loss_chunk_size=-5), "loss_chunk_size must be an integer >= 0; got -5"),
        (
            dict(activation_checkpointing="yes"),
            "activation_checkpointing must be true or false; got 'yes'",
        ),
        (dict(strategy="single", n_gpus=8), "n_gpus=8 needs strategy ddp or fsdp"),
        (
            dict(model="tiny-zamba2"),
            "a zamba2 config (its shared attention blocks) is not modelled",
        ),
        (dict(model="configs/missing.yaml"), "config file configs/missing.yaml does not exist"),
    ],
)
def test_bad_input_names_the_field_and_the_valid_values(kw, message):
    args = {"model": "mamba-130m", "seq_len": 512, "micro_batch": 2, **kw}
    with pytest.raises(ValueError) as err:
        plan_memory(args.pop("model"), **args)
    assert message in str(err.value)
    with pytest.raises(ValueError, match="at least one plan"):
        memory_table({})


# --- the stage's run configs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,preset,lr,tokens,strategy",
    [
        (
            "mamba-370m",
            "mamba-370m",
            1.5e-3,
            7e9,
            "ddp",
        ),  # 5 x GPT-3 Medium's 3e-4; Mamba table 12: 7B
        ("mamba2-1.3b", "mamba2-1.3b", 1e-3, 2.6e10, "fsdp"),  # 5 x GPT-3 XL's 2e-4; 26B tokens
    ],
)
def test_run_configs_load_build_and_fit(name, preset, lr, tokens, strategy):
    cfg = TrainConfig.from_yaml(ROOT / "configs" / f"{name}.yaml")
    assert (cfg.model, cfg.lr, cfg.max_tokens, cfg.strategy, cfg.precision) == (
        preset,
        lr,
        tokens,
        strategy,
        "bf16",
    )
    assert (
        cfg.seq_len,
        cfg.batch_tokens,
        cfg.betas,
        cfg.weight_decay,
        cfg.grad_clip,
        cfg.min_lr,
    ) == (2048, 524288, (0.9, 0.95), 0.1, 1.0, 1e-5)
    assert cfg.grad_accum(8) == 4 and cfg.grad_accum(1) == 32
    model_cfg = cfg.model_config()
    expected = ssmkit.ModelConfig.preset(preset, vocab_size=model_cfg.vocab_size)
    assert model_cfg == expected
    with torch.device("meta"):
        model = ssmkit.build_model(model_cfg)
    plan = plan_memory(cfg, n_gpus=8)  # the config's own settings, 8 x A100-80GB
    assert (
        plan.params == model.num_parameters()
        and plan.fits
        and plan.max_micro_batch >= cfg.micro_batch
    )
