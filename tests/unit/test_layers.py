"""The import graph of ``ssmkit/``: layers point one way, and no circles between files.

The graph is read with ``ast`` (nothing is imported): every import of every ``ssmkit/**/*.py``, at
module level, inside functions and ``if`` blocks (``if TYPE_CHECKING:`` too), absolute
(``import ssmkit.data``) and relative (``from ..io import x``, ``from . import x``), and
``importlib.import_module`` / ``__import__`` with a literal name. An edge ``a -> b`` means file
``a`` imports file ``b``. Importing ``ssmkit.a.b`` also runs ``ssmkit/__init__.py`` and
``ssmkit/a/__init__.py`` first; those implicit edges are left out (every file would otherwise depend
on the facade). An edge goes to the file that holds what is imported:
``from .models import MambaLM`` -> ``models/__init__.py``, ``from .models.lm
import MambaLM`` -> ``models/lm.py``, ``from .data import shards`` -> ``data/shards.py``, ``from ..
import checks`` -> ``checks.py``. ``import io`` (no ``ssmkit.``) is the standard library's.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "ssmkit"

# Layers, low to high. A file may import the files of its own layer (its package: in any direction,
# circles are test_no_circles' business) and files of strictly LOWER layers; two layers of one rank
# may not import each other. The first part of a file's path names its layer: models/lm.py is in
# "models", io.py in "io".
# fmt: off
LAYERS = {
    "io": 0,          # base: atomic writes, sha256, cache dir, locks; imports nothing of ssmkit
    "checks": 0,      # base: validators and the YAML grammar of values; imports nothing of ssmkit
    "data": 1,        # tokenizers, sources, synthetic tasks, shards, loader: only io, checks
    "ops": 1,         # the math of the mixers (reference, torch, cuda paths): io, checks
    "env": 2,         # the machine report: device, kernels, the backend each op takes
    "models": 3,      # configs, mixers, the LM, cache, generate, the Transformer baseline
    "hub": 4,         # from_pretrained / save_pretrained (MambaLM.save_pretrained delegates to it)
    "eval": 5,        # perplexity, task accuracy, FLOPs/MFU, throughput and memory, run summaries
    "finetune": 5,    # LoRA with peft, adapters, merged export: models, hub, io, checks, data
    "plots": 6,       # presentation only (matplotlib inside functions): io, checks, eval at most
    "train": 7,       # config, optimizer, trainer loop, checkpoints, distributed
    "workbook": 8,    # what notebook cells call; the papermill runner
    "demo": 8,        # the no-training demo (`ssmkit demo`)
    "papers": 9,      # the companion notes' claims and what each note calls (uses workbook.params)
    "exercises": 10,  # the judges of the notebooks' and notes' exercises: may use what each calls
    "cli": 11,        # `ssmkit ...`: may call every layer
    "__main__": 12,   # `python -m ssmkit` -> cli
}
# fmt: on
# ssmkit/__init__.py is the facade: the public API, re-exporting from every layer (the heavy ones
# lazily, PEP 562). It is exempt from the rule, and no file inside ssmkit may import it (that would
# make the file depend on everything): import a name from the module that defines it.
FACADE = "facade"
FACADE_RANK = max(LAYERS.values()) + 1


def _files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root`` (the package directory)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _package_of(name: str, path: Path) -> str:
    """The package a module's relative imports start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _literal_import(node: ast.Call) -> str | None:
    """The name in ``import_module("x")``, ``import_module(".x", __package__)`` or
    ``__import__("x")``."""
    func = node.func
    called = (
        func.attr
        if isinstance(func, ast.Attribute)
        else func.id
        if isinstance(func, ast.Name)
        else None
    )
    if (
        called in ("import_module", "__import__")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


def import_graph(root: Path = PACKAGE) -> dict[Path, dict[Path, int]]:
    """file -> {imported file: line of the first such import}, for the package at ``root``."""
    modules = _files(root)
    top = root.name

    def internal(
        name: str,
    ) -> str | None:  # the longest module prefix of a dotted name inside the package
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[Path, dict[Path, int]] = {}
    for name, path in modules.items():
        package = _package_of(name, path)
        edges = graph.setdefault(path, {})

        def add(target: str | None, line: int):
            if target is not None and modules[target] != path:
                edges.setdefault(modules[target], line)

        def absolute(module: str | None, level: int) -> str:
            if level == 0:
                return module or ""
            base = package.split(".")[: len(package.split(".")) - (level - 1)]
            return ".".join(base + ([module] if module else []))

        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == top or alias.name.startswith(top + "."):
                        add(internal(alias.name), node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = absolute(node.module, node.level)
                if base != top and not base.startswith(top + "."):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(sub if sub in modules else internal(base), node.lineno)
            elif isinstance(node, ast.Call) and (literal := _literal_import(node)) is not None:
                level = len(literal) - len(literal.lstrip("."))
                target = absolute(literal.lstrip(".") or None, level)
                if target == top or target.startswith(top + "."):
                    add(internal(target), node.lineno)
    return graph


def _layer(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    if parts == ("__init__.py",):
        return FACADE
    return parts[0].removesuffix(".py")


def _show(path: Path, root: Path) -> str:
    return str(path.relative_to(root.parent))


def reversed_edges(graph: dict[Path, dict[Path, int]], root: Path = PACKAGE) -> list[str]:
    """One line per import that goes against the layers (or into the facade, or from an unknown
    layer)."""
    bad = []
    unknown = sorted({_layer(p, root) for p in graph} - set(LAYERS) - {FACADE})
    for layer in unknown:
        bad.append(
            f"{root.name}/{layer}: layer {layer!r} is not in LAYERS (tests/unit/test_layers.py): "
            "place it there"
        )
    for a, targets in graph.items():
        la = _layer(a, root)
        if la == FACADE or la in unknown:
            continue
        for b, line in targets.items():
            lb = _layer(b, root)
            if lb == la or lb in unknown:
                continue
            rank_a, rank_b = LAYERS[la], FACADE_RANK if lb == FACADE else LAYERS[lb]
            if rank_b > rank_a:
                why = f"layer {la} imports higher layer {lb}"
            elif rank_b == rank_a:
                why = f"layer {la} imports layer {lb} of the same rank"
            else:
                continue
            bad.append(f"{_show(a, root)} -> {_show(b, root)} ({why}; line {line})")
    return sorted(bad)


def circles(graph: dict[Path, dict[Path, int]], root: Path = PACKAGE) -> list[str]:
    """One line per strongly connected component of more than one file, with one circle through
    it."""

    def reach(start: Path) -> set[Path]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph.get(todo.pop(), {}):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reachable = {p: reach(p) for p in graph}
    done, found = set(), []
    for p in sorted(graph):
        if p in done:
            continue
        component = {q for q in reachable[p] if p in reachable.get(q, ())}
        done |= component
        if len(component) < 2:
            continue
        # the shortest circle from p back to p inside the component
        back, queue = {p: None}, deque([p])
        while p not in graph[cur := queue.popleft()]:
            for nxt in sorted(graph[cur]):
                if nxt in component and nxt not in back:
                    back[nxt] = cur
                    queue.append(nxt)
        path = [cur]
        while back[path[-1]] is not None:
            path.append(back[path[-1]])
        path = path[::-1] + [p]
        hops = " -> ".join(f"{_show(x, root)}" for x in path)
        lines = ", ".join(str(graph[x][y]) for x, y in zip(path, path[1:]))
        members = ", ".join(_show(x, root) for x in sorted(component))
        found.append(
            f"circle: {hops} (import lines {lines}); "
            f"all {len(component)} files of this knot: {members}"
        )
    return found


# --- the tree as it is ----------------------------------------------------------------------------


def test_no_import_goes_against_the_layers():
    bad = reversed_edges(import_graph())
    if bad:
        pytest.fail(
            "imports against the layers (low -> high: "
            + ", ".join(LAYERS)
            + "):\n"
            + "\n".join(bad),
            pytrace=False,
        )


def test_no_circles_between_files():
    bad = circles(import_graph())
    if bad:
        pytest.fail(
            "files that import each other, directly or around a circle:\n" + "\n".join(bad),
            pytrace=False,
        )


def test_the_graph_sees_every_kind_of_import():
    """The reader finds module-level, function-level, relative and package imports in the real
    tree."""
    graph = import_graph()
    edges = {
        (_show(a, PACKAGE), _show(b, PACKAGE)) for a, targets in graph.items() for b in targets
    }
    assert ("ssmkit/data/loader.py", "ssmkit/data/shards.py") in edges  # from .shards import
    assert ("ssmkit/__main__.py", "ssmkit/cli.py") in edges  # from .cli import main
    assert ("ssmkit/cli.py", "ssmkit/env.py") in edges  # inside a function
    assert ("ssmkit/hub/save.py", "ssmkit/io.py") in edges  # from .. import io
    assert ("ssmkit/hub/save.py", "ssmkit/models/__init__.py") in edges  # from ..models import
    assert ("ssmkit/__init__.py", "ssmkit/data/__init__.py") in edges  # from . import data
    assert {_layer(p, PACKAGE) for p in graph} - {FACADE} <= set(LAYERS)


# --- the checks themselves, on a made-up package --------------------------------------------------


def _package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_reversed_edge_and_a_circle_are_named(tmp_path):
    root = _package(
        tmp_path / "ssmkit",
        {
            "__init__.py": "from . import data\nfrom .models import lm\n",
            "io.py": "import io\nimport json\n",  # stdlib io: no edge
            "data/__init__.py": "from .a import x\n",
            "data/a.py": "from ..io import write\nx = 1\n"
            "def f():\n    from .b import y\n",  # function-level: a -> b
            "data/b.py": "from . import a\ny = 2\n",  # b -> a: a circle inside data
            "models/__init__.py": "",
            "models/lm.py": "import torch\n"
            + "\n" * 460
            + "def save():\n    from ..hub import save\n",  # reversed, far down
            "hub.py": "from .models.lm import MambaLM\n",  # hub -> models/lm.py
            "ops/x.py": "import ssmkit.data.a\n",  # ops -> data: same rank
            "env.py": "import importlib\nimportlib.import_module('ssmkit')\n",  # env -> the facade
        },
    )
    graph = import_graph(root)
    assert reversed_edges(graph, root) == [
        "ssmkit/env.py -> ssmkit/__init__.py (layer env imports higher layer facade; line 2)",
        "ssmkit/models/lm.py -> ssmkit/hub.py (layer models imports higher layer hub; line 463)",
        "ssmkit/ops/x.py -> ssmkit/data/a.py "
        "(layer ops imports layer data of the same rank; line 1)",
    ]
    found = circles(graph, root)
    assert len(found) == 2
    assert found[0].startswith(
        "circle: ssmkit/data/a.py -> ssmkit/data/b.py -> ssmkit/data/a.py (import lines 4, 1)"
    )
    assert found[1].startswith("circle: ssmkit/hub.py -> ssmkit/models/lm.py -> ssmkit/hub.py")
    assert reversed_edges(
        import_graph(_package(tmp_path / "other" / "ssmkit", {"new.py": ""})),
        tmp_path / "other" / "ssmkit",
    ) == ["ssmkit/new: layer 'new' is not in LAYERS (tests/unit/test_layers.py): place it there"]


@pytest.mark.parametrize(
    "line",
    [
        "from .. import hub",
        "from ..hub import x",
        "import ssmkit.hub",
        "import ssmkit.hub as h",
        "from ssmkit import hub",
        "from ssmkit.hub import x",
    ],
)
def test_every_spelling_of_an_import_is_an_edge(tmp_path, line):
    root = _package(tmp_path / "ssmkit", {"models/lm.py": f"def f():\n    {line}\n", "hub.py": ""})
    assert reversed_edges(import_graph(root), root) == [
        "ssmkit/models/lm.py -> ssmkit/hub.py (layer models imports higher layer hub; line 2)"
    ]


# --- the facade: every layer is an attribute of `ssmkit`, the heavy ones imported on first use ----

HEAVY = (
    "matplotlib",
    "papermill",
    "torch.distributed.checkpoint",
    "ssmkit.train",
    "ssmkit.eval",
    "ssmkit.workbook",
    "ssmkit.plots",
    "ssmkit.cli",
    "ssmkit.demo",
)

FRESH_PROCESS = """
import json, sys, tempfile
from ssmkit.models import MambaLM        # runs ssmkit/__init__.py first, which imports the hub
method = hasattr(MambaLM, "save_pretrained")
import ssmkit

loaded = sorted(m for m in sys.modules if m.startswith(HEAVY))
before = set(sys.modules)
names = {name: type(getattr(ssmkit, name)).__name__
         for name in ("data", "hub", "models", "ops", "io", "checks", "env")}
eager_imported = sorted(set(sys.modules) - before)
found = {"train": ssmkit.train.Trainer.__name__, "eval": ssmkit.eval.summarize_run.__name__,
         "workbook": ssmkit.workbook.run_workbook.__name__, "plots": ssmkit.plots.LivePlot.__name__,
         "finetune": ssmkit.finetune.apply_lora.__name__}
lazy = {name: type(getattr(ssmkit, name)).__name__
        for name in ("train", "eval", "finetune", "workbook", "plots", "demo", "cli")}
try:
    ssmkit.no_such_layer
    missing = None
except AttributeError as exc:
    missing = str(exc)
out = tempfile.mkdtemp()
model = ssmkit.build_model(ssmkit.ModelConfig(d_model=16, n_layer=1, vocab_size=32))
saved = str(model.save_pretrained(out + "/ckpt"))
same = bool((ssmkit.from_pretrained(saved).lm_head.weight == model.lm_head.weight).all())
print(json.dumps(dict(method=method, loaded=loaded, names=names, eager_imported=eager_imported,
                      found=found, lazy=lazy, missing=missing,
                      dir=sorted(set(dir(ssmkit)) & set(lazy)), saved=saved.endswith("/ckpt"),
                      same=same)))
"""


def test_import_ssmkit_is_light_and_every_layer_is_an_attribute():
    import json
    import subprocess
    import sys

    code = f"HEAVY = {HEAVY!r}\n" + FRESH_PROCESS
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PACKAGE.parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["method"], (
        "MambaLM.save_pretrained is missing after `from ssmkit.models import MambaLM`"
    )
    assert got["loaded"] == [], f"`import ssmkit` imported heavy modules: {got['loaded']}"
    assert got["names"] == dict.fromkeys(
        ("data", "hub", "models", "ops", "io", "checks", "env"), "module"
    )
    assert got["eager_imported"] == []  # imported with ssmkit itself
    assert got["found"] == {
        "train": "Trainer",
        "eval": "summarize_run",
        "workbook": "run_workbook",
        "plots": "LivePlot",
        "finetune": "apply_lora",
    }
    assert got["lazy"] == dict.fromkeys(
        ("train", "eval", "finetune", "workbook", "plots", "demo", "cli"), "module"
    )
    assert got["missing"] == "module 'ssmkit' has no attribute 'no_such_layer'"
    assert got["dir"] == sorted(got["lazy"])
    assert got["saved"] and got["same"]  # model.save_pretrained round trip


def test_the_hub_names_are_where_they_were():
    import ssmkit
    from ssmkit import hub

    names = (
        "DTYPES",
        "FORMATS",
        "OUR_FILES",
        "SHARD_INDEXES",
        "TOKENIZER_FILES",
        "WEIGHT_FILES",
        "CheckpointError",
        "config_from_hf",
        "config_from_mamba_ssm",
        "config_to_hf",
        "config_to_mamba_ssm",
        "from_pretrained",
        "is_hub_id",
        "parse_dtype",
        "save_pretrained",
        "save_tokenizer",
    )
    assert [name for name in names if not hasattr(hub, name)] == []
    assert sorted(hub.__all__) == sorted(names)
    assert (
        ssmkit.CheckpointError is hub.CheckpointError
        and ssmkit.from_pretrained is hub.from_pretrained
    )
    method = ssmkit.MambaLM.save_pretrained  # defined in the class body
    assert method.__module__ == "ssmkit.models.lm"
    assert method.__qualname__ == "MambaLM.save_pretrained"
