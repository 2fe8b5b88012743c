"""ssmkit.workbook.params: a notebook's parameters declared once (Param, Parameters), checked in its
first cell, written as its parameters cell; the checks every notebook shares; what papermill
injected.

Oracles: the values papermill and YAML hand over (text, floats for integers), each bad value's
message naming it and what is valid, and the parameters cell read back by the runner's own reader
(declared_parameters) giving the declared defaults."""

from __future__ import annotations

import ast
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import ROOT, check_parameters

from ssmkit import checks, workbook
from ssmkit.workbook import Param, Parameters, WorkbookError
from ssmkit.workbook.chapters import ch01_prototype, chapter_names, chapter_of
from ssmkit.workbook.params import check_overrides, check_tokenizer


def small() -> Parameters:
    """A notebook's parameters in miniature: one that trains (overrides) and one that does not."""
    return Parameters(
        Param("seed", 0, checks.integer, "seed", minimum=0),
        Param("evals", 6, checks.integer, "validation points", minimum=1),
        Param("overrides", {}, check_overrides, "more TrainConfig keys"),
    )


def test_values_as_papermill_and_yaml_hand_them_over(tmp_path):
    # -p baseline false is the string "false", 2e5 a float, overrides its YAML text
    p = check_parameters(
        ch01_prototype,
        tmp_path,
        config="tiny",
        tokenizer="bpe-300",
        max_tokens=2e5,
        device="auto",
        precision="bf16",
        evals=3.0,
        baseline="false",
        overrides="{micro_batch: 4, lr: 1.0e-3}",
        out_dir=tmp_path / "o",
    )
    assert p["device"] in ("cpu", "cuda", "mps") and p["max_tokens"] == 200_000
    assert isinstance(p["max_tokens"], int) and p["evals"] == 3 and p["baseline"] is False
    assert p["precision"] == "bf16" and p["tokenizer"] == "bpe-300"
    assert p["overrides"] == {"micro_batch": 4, "lr": 1e-3} and p["out_dir"].is_dir()
    assert check_parameters(ch01_prototype, tmp_path, tokenizer=str(tmp_path))["tokenizer"] == str(
        tmp_path
    )
    assert list(p) == ch01_prototype.PARAMETERS.names


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("config", "nope", "config='nope' is not a run config; valid: .*mamba-130m"),
        ("device", "gpu", "device='gpu' is not valid; valid: auto, cpu, cuda"),
        ("max_tokens", 0, "max_tokens must be a positive integer; got 0"),
        ("seed", 1.5, "seed must be an integer >= 0"),
        (
            "data",
            "no/such/dir",
            "data='no/such/dir' is not valid; valid: 'stdlib-docs', .*slimpajama",
        ),
        ("out_dir", "", "out_dir must be a non-empty path"),
        ("evals", "six", "evals must be a positive integer; got 'six'"),
        ("baseline", "flase", "baseline must be true or false; got 'flase'"),
        ("precision", "fp8", "precision='fp8' is not valid; valid: fp32, bf16, fp16"),
        ("tokenizer", "gtp2", "tokenizer='gtp2' is not valid; valid: 'gpt2', 'byte', 'bpe-<N>'"),
        ("tokenizer", "bpe-100", "a byte-level BPE needs at least 257 tokens"),
        (
            "tokenizer",
            "no-such-org/no-such-tokenizer",
            "hub is offline .* its cache does not hold it",
        ),
        (
            "overrides",
            {"micro_bach": 4},
            "overrides: unknown TrainConfig key\\(s\\) micro_bach; valid: ",
        ),
        # overrides may not repeat a parameter of the notebook, nor a key the notebook derives from
        # one
        ("overrides", {"seed": 1}, "overrides: seed is a parameter of this notebook"),
        ("overrides", {"eval_every": 1}, "sets eval_every from its parameter evals"),
    ],
)
def test_each_bad_value_is_named_with_what_is_valid(tmp_path, key, value, message):
    with pytest.raises(WorkbookError, match=message):
        check_parameters(ch01_prototype, tmp_path, **{key: value})


def test_a_parameter_the_namespace_lacks_is_named():
    with pytest.raises(
        WorkbookError, match="parameter\\(s\\) evals not set: run the notebook's parameters cell"
    ):
        small().check({"seed": 1, "overrides": {}})
    with pytest.raises(ValueError, match="parameters declared twice: seed"):
        Parameters(Param("seed", 0, checks.integer, "a"), Param("seed", 1, checks.integer, "b"))


def test_the_parameters_cell_is_the_declaration_written_out():
    """The runner reads a parameters cell back (declared_parameters); it must give the defaults."""
    cell = ch01_prototype.PARAMETERS.cell()
    assert all(len(line) <= 100 for line in cell.splitlines())
    tree = ast.parse(cell)
    assigned = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body}
    assert assigned == ch01_prototype.PARAMETERS.defaults()
    assert "max_tokens = 250_000" in cell and 'tokenizer = "gpt2"' in cell and "\n# " not in cell
    assert "# training tokens for each model" in cell


@pytest.mark.parametrize("name", chapter_names())
def test_every_notebook_has_its_chapter_and_the_same_parameters_cell(name):
    notebook = next((ROOT / "notebooks").glob(f"{name[2:4]}_*.ipynb"))
    assert chapter_of(notebook).__name__.endswith(name)
    from ssmkit.workbook.chapters import parameters_cell

    have, want = parameters_cell(notebook)
    assert have == want, (
        f"{notebook.name}'s parameters cell differs from {name}.PARAMETERS: run "
        "`python -m ssmkit.workbook.chapters` to write it"
    )
    assert workbook.declared_parameters(notebook) == chapter_of(notebook).PARAMETERS.defaults()


def test_a_notebook_without_a_chapter_is_named():
    with pytest.raises(WorkbookError, match="99_new.ipynb: no chapter module .*ch00_setup"):
        chapter_of("notebooks/99_new.ipynb")


def test_relative_out_dir_starts_at_the_notebooks_folder(tmp_path, monkeypatch):
    """Whatever the working directory (papermill from the repository root, a cluster job
    elsewhere)."""
    name = f"pytest-out-dir-{os.getpid()}"
    try:
        for cwd in (ROOT, tmp_path):
            monkeypatch.chdir(cwd)
            p = check_parameters(ch01_prototype, tmp_path, out_dir=f"../runs/{name}/x")
            assert p["out_dir"] == ROOT / "runs" / name / "x" and p["out_dir"].is_dir()
        assert (
            not (tmp_path.parent / "runs" / name).exists()
            and not (ROOT.parent / "runs" / name).exists()
        )
        assert workbook.resolve_out_dir("~/r") == Path.home() / "r"
        assert workbook.resolve_out_dir(tmp_path / "abs") == tmp_path / "abs"
    finally:
        shutil.rmtree(ROOT / "runs" / name, ignore_errors=True)


def test_the_tokenizer_check_never_touches_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert (
        check_tokenizer("someone/some-tokenizer") == "someone/some-tokenizer"
    )  # online: as spelled


class FakeShell:
    """What the check reads of IPython: the input history (``In``) and the namespace."""

    def __init__(self, *sources):
        self.user_ns = {"In": ["", *sources]}


def test_what_papermill_injected_is_compared_with_the_declared(monkeypatch, capsys):
    import IPython

    monkeypatch.setenv("SSMKIT_PROGRESS", "unset below")  # restored after the test
    monkeypatch.delenv("SSMKIT_PROGRESS")
    parameters = "seed = 0\nevals = 6\noverrides = {}"
    injected = "# Parameters\nseed = 1\nmax_tokenz = 1000\nlr = 0.001\n"
    monkeypatch.setattr(
        IPython, "get_ipython", lambda: FakeShell(parameters, injected, "p = check(...)")
    )
    message = (
        r"papermill passed parameter\(s\) max_tokenz that this notebook does not declare .*: seed"
    )
    with pytest.raises(WorkbookError, match=message):
        small().check({"seed": 1, "evals": 6, "overrides": {}})
    assert os.environ["SSMKIT_PROGRESS"] == "text"  # a papermill run: text progress bars
    # TrainConfig keys (a recipe file's) join overrides
    injected = (
        "# Parameters\nseed = 1\nmicro_batch = 8\nlr = 0.003\noverrides = {'warmup_steps': 5}\n"
    )
    monkeypatch.setattr(IPython, "get_ipython", lambda: FakeShell(parameters, injected))
    p = small().check({"seed": 1, "evals": 6, "overrides": {"warmup_steps": 5}})
    assert p["overrides"] == {"warmup_steps": 5, "micro_batch": 8, "lr": 0.003}
    assert (
        "overrides from papermill's parameters: micro_batch=8, lr=0.003" in capsys.readouterr().out
    )
    # a notebook that does not train, given a workbook-wide file: TrainConfig keys and the
    # parameters of the workbook's other notebooks and paper notes (evals: 01's, s4_steps:
    # papers/01_s4's, as params/workshop.yaml holds both) are noted as not used
    seed_only = Parameters(Param("seed", 0, checks.integer, "seed", minimum=0))
    injected = "# Parameters\nseed = 1\nmicro_batch = 8\nevals = 2\ns4_steps = 9\n"
    monkeypatch.setattr(IPython, "get_ipython", lambda: FakeShell("seed = 0", injected))
    assert seed_only.check({"seed": 1}) == {"seed": 1}
    assert (
        "not used by this notebook (parameters of other notebooks, or TrainConfig keys for "
        "those that train): micro_batch=8, evals=2, s4_steps=9" in capsys.readouterr().out
    )
    # no injected cell (JupyterLab), or a cell that only looks like one: nothing to compare
    for history in [
        (parameters, "p = check(...)"),
        (parameters, "# Parameters\nprint(max_tokenz)"),
    ]:
        monkeypatch.setattr(IPython, "get_ipython", lambda h=history: FakeShell(*h))
        assert seed_only.check({"seed": 2, "other": "ignored"}) == {"seed": 2}
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)  # outside IPython
    assert seed_only.check({"seed": 3}) == {"seed": 3}


# --- a GPU-sized run on a CPU ---------------------------------------------------------------------


def recipe(chapter, params_file: str | None, **more) -> dict:
    """A notebook's namespace: its defaults, a params file's keys it declares, ``more``."""
    import yaml

    ns = chapter.PARAMETERS.defaults()
    if params_file:
        given = yaml.safe_load((ROOT / "params" / params_file).read_text())
        ns.update({k: v for k, v in given.items() if k in ns})
    return {**ns, **more}


def test_a_gpu_recipe_is_refused_when_device_resolves_to_cpu(tmp_path):
    ns = recipe(ch01_prototype, "gpu-a100.yaml", device="cpu", out_dir=str(tmp_path))
    with pytest.raises(WorkbookError) as err:
        ch01_prototype.PARAMETERS.check(ns)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("device resolved to cpu, and this is a GPU-sized run: mamba-130m")
    for part in ("10,000,000,000 tokens", "params/cpu.yaml", "allow_cpu=True", "-p allow_cpu"):
        assert part in message, message


@pytest.mark.parametrize(
    "chapter, params_file",
    [("ch02_scale_up", "gpu-8xa100.yaml"), ("ch03_hybrid", "gpu-a100.yaml"),
     ("ch04_finetune", "gpu-a100-finetune.yaml"), ("ch04_finetune", "gpu-h100-finetune-2.8b.yaml")],
)  # fmt: skip
def test_every_gpu_recipe_is_refused_by_its_notebook_on_cpu(chapter, params_file, tmp_path):
    import importlib

    module = importlib.import_module(f"ssmkit.workbook.chapters.{chapter}")
    ns = recipe(module, params_file, device="cpu", out_dir=str(tmp_path))
    if "finetune" in params_file:  # its hub tokenizer: refused first when the hub is offline
        ns["tokenizer"] = "gpt2"
    with pytest.raises(WorkbookError, match="GPU-sized run"):
        module.PARAMETERS.check(ns)


def test_a_gpu_recipe_runs_on_cpu_when_allowed_or_on_cuda(tmp_path, monkeypatch):
    ns = recipe(ch01_prototype, "gpu-a100.yaml", device="cpu", out_dir=str(tmp_path))
    assert ch01_prototype.PARAMETERS.check({**ns, "allow_cpu": "true"})["allow_cpu"] is True
    monkeypatch.setattr(workbook.params, "pick_device", lambda value: "cuda")
    assert ch01_prototype.PARAMETERS.check(ns)["device"] == "cuda"


@pytest.mark.parametrize("params_file", [None, "cpu.yaml", "ci.yaml"])
@pytest.mark.parametrize(
    "name", ["ch01_prototype", "ch02_scale_up", "ch03_hybrid", "ch04_finetune"]
)
def test_cpu_defaults_and_ci_values_are_not_refused(name, params_file, tmp_path):
    import importlib

    module = importlib.import_module(f"ssmkit.workbook.chapters.{name}")
    ns = recipe(module, params_file, device="cpu", out_dir=str(tmp_path))
    assert module.PARAMETERS.check(ns)["allow_cpu"] is False


def test_the_rule_states_its_threshold_once():
    from ssmkit.workbook import params

    flops, what = params.planned_training(
        {"config": "cpu-tiny", "max_tokens": 250_000, "overrides": {}}
    )
    assert "cpu-tiny" in what or "tiny" in what
    assert flops / params.CPU_FLOP_S < 3600  # the CPU default: well under an hour by the rule
    assert params._hub_params("state-spaces/mamba-2.8b-hf") == 2_800_000_000
    assert params._hub_params("state-spaces/mamba-130m-hf") == 130_000_000
    assert params._hub_params("/ckpt/my-run") is None


def test_the_workshop_profile_reaches_every_notebook_and_states_each_budget():
    """params/workshop.yaml routes to a run of notebooks/ alone, of papers/ alone and of both (no
    key refused), shrinks the micro-batch of every notebook that trains, and its budget table names
    every notebook of notebooks/ (papers/ as one row) with a time and a peak RSS <= 2048 MiB."""
    from ssmkit.workbook.memory import BINDER_MIB
    from ssmkit.workbook.params import route_parameters, workbook_parameters
    from ssmkit.workbook.runner import _folders  # the folders run_workbook reads the names of

    path = ROOT / "params" / "workshop.yaml"
    shared = workbook.load_params_file(path)
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    papers = sorted((ROOT / "papers").glob("[0-9][0-9]_*.ipynb"))
    for run in (notebooks, papers, notebooks + papers):
        declared = {p: workbook.declared_parameters(p) for p in run}
        values, _ = route_parameters(declared, {}, shared, workbook_parameters(_folders(run)))
        for p in run:
            if "overrides" in declared[p]:
                assert values[p]["overrides"]["micro_batch"] == shared["micro_batch"] < 8, p.name
    rows = {
        m[1]: (int(m[2]), int(m[3]))
        for m in re.finditer(r"^# \| (\S+) +\| (\d+) s +\| (\d+) MiB", path.read_text(), re.M)
    }
    assert set(rows) == {p.stem for p in notebooks}, rows
    assert all(0 < rss <= BINDER_MIB and seconds > 0 for seconds, rss in rows.values()), rows
    assert re.search(r"^# \| papers/.*\| 2048 MiB", path.read_text(), re.M)
