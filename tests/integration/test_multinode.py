"""Two "nodes" on the loopback: scripts/slurm/train.sbatch run as it is, with stand-ins for what
only a cluster has (srun, scontrol, nvidia-smi, conda; see FAKES), trains DDP and FSDP equal to one
process with the same global batch, checkpoints, resumes in one process, and a node that never comes
fails the other in one line within the rendezvous timeout.

The stand-in srun starts the script's command once per node, as Slurm does, so what runs is the
script's own line: ``ssmkit train --config C --resume --nnodes 2 --nproc 1 --rdzv-endpoint
127.0.0.1:PORT --rdzv-id JOB --rdzv-timeout S``, which runs torchrun's launcher in each "node"
(``torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT ...``,
asserted from the nodes' output), one process each, gloo on the CPU.

Tolerance (fp32): TOL on every step's loss, the validation loss and every parameter of the final
checkpoint's model. One process adds the two micro-batches' gradients (each loss divided by 2); two
processes take one micro-batch each and DDP / FSDP average the two gradients across the ranks: the
same numbers added in another order, a few fp32 ulps apart (~1e-7 relative), which AdamW's steps
(about lr per element) carry into the weights at about that size, far under TOL. A real difference
is far over it: a parameter given weight decay it should not have (Mamba-1's A_log under FSDP when
fully_shard drops its ``_no_weight_decay`` tag) moves by about lr x weight_decay x |A_log| a step,
~1e-3 here, while the losses still agree to ~1e-6; hence the weights are compared, not only the
losses. The oracle runs in this process; so does the resume of the FSDP checkpoint, on one "node".
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, small
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
TOL = 1e-5
JOB = "4242"
LIMIT = 150  # seconds a whole script run may take here before the test kills it

# What the sbatch script calls besides ssmkit, on one machine. srun starts the job step's command
# once per node (SLURM_NNODES), as Slurm does; FAKE_SLURM_ABSENT=i: node i never starts;
# FAKE_SLURM_LOCAL_CACHE=DIR: node i's SSMKIT_CACHE is DIR/node<i> (each node's own disk).
FAKES = {
    "srun": """#!/usr/bin/env bash
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  [ "$i" = "${FAKE_SLURM_ABSENT:-}" ] && continue
  (
    export SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0
    if [ -n "${FAKE_SLURM_LOCAL_CACHE:-}" ]; then
      export SSMKIT_CACHE=$FAKE_SLURM_LOCAL_CACHE/node$i
    fi
    exec "$@"
  ) > "$FAKE_SLURM_LOGS/node$i.log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit $status
""",
    "scontrol": "#!/bin/sh\necho 127.0.0.1\n",  # show hostnames: the loopback is every node
    "nvidia-smi": "#!/bin/sh\necho 'GPU 0: a stand-in (this test trains on the CPU)'\n",
    "conda": "#!/bin/sh\nexit 0\n",  # the environment is this interpreter's
    "ssmkit": f'#!/bin/sh\nexec {sys.executable} -m ssmkit "$@"\n',
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The stand-ins' bin/, a small text corpus (a source: each run prepares it into its cache, as
    a job does), and the cache the nodes share."""
    base = tmp_path_factory.mktemp("multinode")
    bin_dir = base / "bin"
    bin_dir.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    from pydoc_data.topics import topics

    paragraphs = [
        part.strip()
        for _, text in sorted(topics.items())
        for part in text.split("\n\n")
        if len(part.strip()) >= 200
    ]
    docs, chars = [], 0
    for part in paragraphs:  # ~40K bytes in ~110 documents (about 5% of them: validation)
        docs.append(part)
        chars += len(part)
        if chars > 40_000:
            break
    corpus = base / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return {"base": base, "bin": bin_dir, "corpus": corpus, "cache": base / "shared-cache"}


def config(site, name: str, **kw) -> Path:
    """helpers.small's run (d_model 32, 2 layers, seq_len 32, 256-token global batch: 2
    micro-batches of 4 in one process, 1 per rank in two) on the corpus, 4 steps, a checkpoint
    every 2."""
    folder = site["base"] / name
    cfg = small(
        folder,
        site["base"],
        **{
            "data": str(site["corpus"]),
            "val_data": None,
            "tokenizer": "byte",
            "device": "cpu",
            "max_steps": 4,
            "ckpt_every": 2,
            **kw,
        },
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "c.yaml").write_text(cfg.to_yaml())
    return folder / "c.yaml"


def sbatch(site, cfg: Path, nodes: int, *args, port: int, timeout: float = 30, **env) -> dict:
    """Run scripts/slurm/train.sbatch CFG ARGS on ``nodes`` stand-in nodes; returns its status,
    seconds and each node's output."""
    logs = cfg.parent / f"logs-{time.monotonic_ns()}"
    logs.mkdir()
    full = {
        **os.environ,
        "PATH": f"{site['bin']}{os.pathsep}{os.environ['PATH']}",
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_ID": JOB,
        "SLURM_JOB_NODELIST": f"node[001-00{nodes}]",
        "SLURM_SUBMIT_DIR": str(cfg.parent),
        "SLURM_CPUS_PER_TASK": "1",  # one thread per process: two "nodes" share two cores
        "SSMKIT_RDZV_PORT": str(port),
        "SSMKIT_RDZV_TIMEOUT": str(timeout),
        "SSMKIT_CACHE": str(site["cache"]),
        "FAKE_SLURM_LOGS": str(logs),
        **env,
    }
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", str(SBATCH), str(cfg), *args],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the script, srun and the launchers: one group to stop
    )
    try:
        out, _ = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the launchers stop their ranks on SIGTERM
        time.sleep(5)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    nodes_out = {p.stem: p.read_text() for p in sorted(logs.glob("node*.log"))}
    return {
        "status": proc.returncode,
        "seconds": time.monotonic() - start,
        "out": out,
        "nodes": nodes_out,
    }


def ok(run: dict) -> dict:
    assert run["status"] == 0, run["out"][-2000:] + "".join(
        f"\n--- {k}\n{v[-3000:]}" for k, v in run["nodes"].items()
    )
    return run


def records(cfg: Path, kind: str, key: str) -> list[float]:
    out = Path(small_out(cfg)) / "metrics.jsonl"
    return [r[key] for r in map(json.loads, out.read_text().splitlines()) if r["kind"] == kind]


def small_out(cfg: Path) -> Path:
    return cfg.parent / "run"


def weights(cfg: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(
        small_out(cfg) / "checkpoints" / f"step_{step:08d}" / "model" / "model.safetensors"
    )


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def train_here(site, cfg: Path, *args: str):
    """``ssmkit train --config CFG ARGS`` in this process (one process on one node: what the
    script runs on a one-node allocation, without its launcher options) on the shared cache."""
    from ssmkit.train import cli

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSMKIT_CACHE", str(site["cache"]))
        cli.main(["--config", str(cfg), *args])


@pytest.fixture(scope="module")
def single(site):
    """The oracle: one process, the same global batch."""
    cfg = config(site, "single")
    train_here(site, cfg)
    return {
        "loss": records(cfg, "train", "loss"),
        "val": records(cfg, "eval", "val_loss"),
        "weights": weights(cfg, 4),
    }


def compare(cfg: Path, single: dict, what: str) -> dict:
    got = {
        "loss": records(cfg, "train", "loss"),
        "val": records(cfg, "eval", "val_loss"),
        "weights": weights(cfg, 4),
    }
    assert len(got["loss"]) == 4
    diffs = {
        "loss": max(abs(a - b) for a, b in zip(got["loss"], single["loss"])),
        "val": max(abs(a - b) for a, b in zip(got["val"], single["val"])),
        "weights": max_diff(got["weights"], single["weights"]),
    }
    got["report"] = f"{what}: max |difference| to one process {diffs}"
    assert all(d <= TOL for d in diffs.values()), got["report"]
    return got


def test_two_nodes_ddp_train_as_one_process(site, single):
    port = free_port()
    cfg = config(site, "ddp", ckpt_every=0)  # the final checkpoint only
    run = ok(sbatch(site, cfg, 2, "--set", "strategy=ddp", port=port))  # args reach ssmkit train
    tested = (
        f"torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
        f"--rdzv-endpoint=127.0.0.1:{port} --rdzv-id={JOB} "
        f"--rdzv-conf=join_timeout=30,read_timeout=30 -m ssmkit.train --config {cfg} "
        f"--set strategy=ddp --resume"
    )
    for node in ("node0", "node1"):
        assert f"launching 1 process: {tested}" in run["nodes"][node]
    assert sum("done: 4 steps" in out for out in run["nodes"].values()) == 1  # rank 0's node
    print(f"DDP, 2 nodes: {run['seconds']:.1f} s")
    print(compare(cfg, single, "DDP, 2 nodes")["report"])


def test_two_nodes_fsdp_checkpoint_and_resume_in_one_process(site, single, capsys):
    cfg = config(site, "fsdp", strategy="fsdp")
    local = site["base"] / "node-disks"  # each node prepares the data into its own cache
    run = ok(sbatch(site, cfg, 2, port=free_port(), FAKE_SLURM_LOCAL_CACHE=str(local)))
    two = compare(cfg, single, "FSDP, 2 nodes")
    shards = [sorted((local / n / "shards").glob("*/train/index.json")) for n in ("node0", "node1")]
    assert len(shards[0]) == len(shards[1]) == 1
    assert (
        json.loads(shards[0][0].read_text())["shards"]
        == json.loads(shards[1][0].read_text())["shards"]
    )  # the same tokens, prepared on each node

    ckpts = small_out(cfg) / "checkpoints"
    state = sorted(p.name for p in (ckpts / "step_00000002" / "state").iterdir())
    assert sum(name.endswith(".distcp") for name in state) == 2  # one shard from each rank
    rng = sorted(p.name for p in (ckpts / "step_00000002" / "rng").iterdir())
    assert rng == ["rank_00000.json", "rank_00001.json"]

    (ckpts / "latest").write_text("step_00000002\n")  # back to step 2, then in one process
    train_here(site, cfg, "--resume")
    out = capsys.readouterr().out
    assert f"resumed from {ckpts / 'step_00000002'} (step 2, 512 tokens)" in out
    steps = [
        r["step"]
        for r in map(json.loads, (small_out(cfg) / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    ]
    assert steps == [1, 2, 3, 4]
    resumed = compare(cfg, single, "FSDP from 2 nodes, resumed in 1 process")
    after = {
        "loss": max(abs(a - b) for a, b in zip(resumed["loss"], two["loss"])),
        "weights": max_diff(resumed["weights"], two["weights"]),
    }
    with capsys.disabled():
        print(f"\nFSDP, 2 nodes: {run['seconds']:.1f} s\n{two['report']}\n{resumed['report']}")
        print(f"resumed in 1 process: max |difference| to the 2 nodes' own steps {after}")
    assert all(d <= TOL for d in after.values()), after


def test_a_node_that_never_comes_fails_the_other_in_one_line(site):
    cfg = config(site, "absent", strategy="ddp")
    port = free_port()
    run = sbatch(site, cfg, 2, port=port, timeout=3, FAKE_SLURM_ABSENT="1")
    print(f"rendezvous timeout: {run['seconds']:.1f} s")
    assert run["status"] == 1 and list(run["nodes"]) == ["node0"]
    assert run["seconds"] < 60
    last = run["nodes"]["node0"].strip().splitlines()[-1]
    assert last.startswith(
        f"ssmkit train: the rendezvous of 2 machines at 127.0.0.1:{port} (id {JOB}, waited up "
        "to 3 s) failed (RendezvousTimeoutError"
    ), run["nodes"]["node0"][-2000:]
    assert "Traceback" not in run["nodes"]["node0"]
    assert not small_out(cfg).exists()  # nothing trained, nothing written
