"""The launcher of ``ssmkit train`` for several machines, and what a run does differently there:
the options checked before anything starts, the torchrun command they make, data prepared machine
by machine, and an out_dir that some rank cannot see refused. The runs themselves (two "nodes" on
the loopback): tests/integration/test_multinode.py."""

from __future__ import annotations

import json

import pytest

from ssmkit.train import cli
from ssmkit.train.data import _in_turn
from ssmkit.train.distributed import Dist
from ssmkit.train.rundir import OWNER, RunDir


def test_torchrun_args_one_machine_and_several():
    assert cli.torchrun_args(4) == ["--standalone", "--nproc-per-node=4"]
    assert cli.torchrun_args(2, 3, "node001:29500", "77", 45) == [
        "--nnodes=3",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node001:29500",
        "--rdzv-id=77",
        "--rdzv-conf=join_timeout=45,read_timeout=45",
    ]
    # torchrun's own parser takes them as they are
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(
        [*cli.torchrun_args(2, 3, "node001:29500", "77", 45), "-m", "ssmkit.train"]
    )
    launch, _, _ = config_from_args(args)
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (3, 3, 2)
    assert launch.rdzv_configs["join_timeout"] == "45" and launch.run_id == "77"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "0"], "--nnodes must be >= 1 (machines in the run); got 0"),
        (["--nproc", "0"], "--nproc must be >= 1 (processes on this machine); got 0"),
        (["--nnodes", "2", "--rdzv-endpoint", "node001"], "--rdzv-endpoint must be HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "node001:70000"], "a port in 1-65535"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-timeout", "0"],
            "--rdzv-timeout must be a positive number; got 0.0",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "my job"],
            "--rdzv-id must be letters, digits",
        ),
    ],
)
def test_bad_launcher_options_are_one_line_before_anything_starts(
    tmp_path, capsys, monkeypatch, args, message
):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", str(tmp_path / "never-read.yaml"), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


class Ranks(Dist):
    """One rank of a run whose other ranks are simulated: ``others`` says whether any other rank
    failed in each collective, ``theirs`` is what the other ranks contribute to a gather."""

    def __init__(self, rank, local_rank, others=(), theirs=(), rank0_says=None):
        super().__init__(rank=rank, world_size=4, local_rank=local_rank)
        self.others, self.theirs, self.rank0_says = list(others), list(theirs), rank0_says
        self.log = []

    def any(self, flag):
        self.log.append(("any", flag))
        return flag or (self.others.pop(0) if self.others else False)

    def broadcast(self, obj):
        return obj if self.is_main else self.rank0_says

    def gather(self, obj):
        out = list(self.theirs)
        out.insert(self.rank, obj)
        return out


@pytest.mark.parametrize(
    "rank, local_rank, turn", [(0, 0, 0), (2, 0, 1), (1, 1, 2), (3, 1, 2)]
)  # 2 machines x 2 processes: ranks 0, 1 on the first, 2, 3 on the second
def test_data_is_prepared_by_rank_0_then_each_machine_s_first_process(rank, local_rank, turn):
    d = Ranks(rank, local_rank)
    calls = []
    assert _in_turn(d, lambda: calls.append(len(d.log)) or "done") == "done"
    assert calls == [turn]  # called once, after `turn` collectives: its turn
    assert len(d.log) == 3  # every rank takes part in all three turns


@pytest.mark.parametrize(
    "failed_turn, who",
    [(0, "rank 0"), (1, "the first process of another machine"), (2, "another rank")],
)
def test_a_failed_turn_stops_every_rank(failed_turn, who):
    others = [False] * failed_turn + [True]
    d = Ranks(3, 1, others=others)
    with pytest.raises(ValueError, match=f"{who} stopped while preparing the data"):
        _in_turn(d, lambda: None)
    # the failing rank itself raises its own error
    d = Ranks(0, 0)
    with pytest.raises(OSError, match="disk full"):
        _in_turn(d, lambda: (_ for _ in ()).throw(OSError("disk full")))


def test_an_out_dir_some_rank_cannot_see_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / OWNER).write_text(json.dumps({"run_id": "abc", "pid": 1}))
    # rank 1 sees the owner file rank 0 wrote: the same directory
    d = Ranks(1, 1, theirs=[(True, "a"), (True, "a"), (True, "b")], rank0_says="abc")
    RunDir(shared, d)._check_shared(wait=0.1)
    # rank 2, on another machine, with out_dir on its own disk (nothing there) or an old run's
    elsewhere = tmp_path / "elsewhere"
    for owner in (None, "an-older-run"):
        elsewhere.mkdir(exist_ok=True)
        if owner:
            (elsewhere / OWNER).write_text(json.dumps({"run_id": owner}))
        d = Ranks(2, 0, theirs=[(True, "node001"), (True, "node001"), (True, "node002")])
        d.rank0_says = "abc"
        with pytest.raises(ValueError) as err:
            RunDir(elsewhere, d)._check_shared(wait=0.1)
        assert str(err.value).startswith(
            f"out_dir {elsewhere} is not the same directory on every rank: rank 2 on "
        )
        assert "rank 0 (node001) started there" in str(err.value)
        assert "a filesystem they all share" in str(err.value)
    # one process: nothing to compare, no collective
    RunDir(elsewhere, Dist())._check_shared(wait=0.1)
