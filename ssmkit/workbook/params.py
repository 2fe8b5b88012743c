"""A notebook's parameters: declared once in its chapter, checked in its first cell, routed by the
runner.

A chapter (``ssmkit/workbook/chapters/chNN_*.py``) declares its notebook's parameters once, each
with its default, its check and one line of help::

    PARAMETERS = Parameters(
        Param("max_tokens", 250_000, checks.integer, "training tokens for each model", minimum=1),
        Param("device", "auto", check_device, "'auto': cuda, else mps, else cpu; or 'cuda:1'"),
        ...)

The notebook's ``parameters`` cell is that declaration written out (:meth:`Parameters.cell`; a test
keeps the two equal, ``python -m ssmkit.workbook.chapters`` rewrites the cells), and its next cell
checks them::

    p = chapter.PARAMETERS.check(globals())  # {name: value}; a bad one stops the notebook here

Rules, the same under ``ssmkit workbook run``, plain ``papermill`` and JupyterLab:

* every parameter is checked; the first bad value raises one :class:`WorkbookError` line naming it
  and what is valid. Text given for a parameter whose default is not text (``papermill -p nproc 2``
  types it, ``-p ssd_lengths "[64, 128]"`` does not) is read with the command-line grammar
  (:func:`ssmkit.checks.parse_value`) first;
* a relative ``out_dir`` starts at the checkout's ``notebooks/`` folder (:func:`notebooks_dir`),
  whatever the working directory of the process, so ``papermill notebooks/01_....ipynb out.ipynb``
  run from the repository root writes where JupyterLab does;
* ``overrides`` holds more :class:`~ssmkit.train.TrainConfig` keys for a notebook that trains (a
  recipe's ``micro_batch``, ``lr``, ...), checked against TrainConfig's fields
  (:func:`check_overrides`);
* under plain papermill, a name papermill injected that the notebook does not declare stops the run
  (papermill only warns "Passed unknown parameter" and goes on with the defaults), except
  TrainConfig keys, which join ``overrides`` (so ``-f params/gpu-a100.yaml`` works with papermill
  and with ``ssmkit workbook run`` alike), and parameters of the workbook's other notebooks and
  paper notes (a workbook-wide file such as ``params/cpu.yaml`` or ``params/workshop.yaml``), which
  are noted as not used (:func:`injected_parameters`, :func:`workbook_folders`);
* a notebook that trains declares ``allow_cpu``: when ``device`` resolved to cpu and the training
  its values ask for would take more than :data:`CPU_HOURS` on a CPU (:func:`check_cpu_sized`), the
  check stops it (a GPU recipe on a CPU-only machine), unless ``allow_cpu`` is True;
* ``ssmkit workbook run -f FILE``: :func:`route_parameters` gives each notebook the keys it declares
  and the TrainConfig keys (as ``overrides``) when it declares ``overrides``; a file key that no
  notebook of the workbook declares and that is not a TrainConfig key is an error before anything
  runs.

The checks every notebook shares are here (:func:`check_run_config`, :func:`check_data`,
:func:`check_tokenizer`, :func:`check_device`, :func:`check_out_dir`, :func:`check_overrides`); a
chapter's own parameters use :mod:`ssmkit.checks` or a check of its own with the same signature,
``check(value, name, **limits) -> value``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import checks
from .cells import format_duration, pick_device, run_config_names, unknown_run_config
from .notebooks import PROJECT_ROOT, WorkbookError, declared_parameters

__all__ = [
    "ALLOW_CPU",
    "CPU_FLOP_S",
    "CPU_HOURS",
    "DEVICE",
    "Param",
    "Parameters",
    "check_cpu_sized",
    "check_data",
    "check_device",
    "check_out_dir",
    "check_overrides",
    "check_run_config",
    "check_tokenizer",
    "injected_parameters",
    "notebooks_dir",
    "planned_training",
    "resolve_out_dir",
    "route_parameters",
    "train_keys",
    "workbook_folders",
    "workbook_parameters",
]

INJECTED_HEADER = "# Parameters"  # the first line of the cell papermill injects (Python kernels)
# TrainConfig keys a notebook sets itself from one of its parameters: not accepted in overrides
NOTEBOOK_SETS = {"overwrite": "out_dir", "eval_every": "evals"}
# TrainConfig keys that say WHAT a run trains from, not how: a params file's or papermill's loose
# key reaches only a notebook that declares it (notebook 04's `base`), never a pretraining
# notebook's overrides, where it would silently turn the run into a fine-tuning of another model
# (explicit `overrides` may still set them)
NOT_ROUTED = ("base", "lora")
HELP_COLUMN = 35  # where a parameter's comment starts in the parameters cell
LINE = 100  # the longest line of a written parameters cell
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


# --- a declared parameter -------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One notebook parameter: its ``name``, ``default`` (a plain value: papermill's parameters cell
    holds literals), ``check(value, name, **limits) -> the value to use`` (raising ValueError naming
    ``name`` and what is valid), one line of ``help`` for the cell's comment, and the check's
    ``limits``."""

    name: str
    default: object
    check: Callable
    help: str
    limits: dict = field(default_factory=dict)

    def __init__(self, name: str, default, check: Callable, help: str, **limits):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "check", check)
        object.__setattr__(self, "help", help)
        object.__setattr__(self, "limits", limits)

    def __call__(self, value):
        """``value`` checked: text for a parameter whose default is not text is parsed first."""
        if isinstance(value, str) and not isinstance(self.default, str):
            value = checks.parse_value(value)
        return self.check(value, self.name, **self.limits)


class Parameters:
    """A notebook's parameters, in the order its parameters cell lists them."""

    def __init__(self, *params: Param):
        names = [p.name for p in params]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"parameters declared twice: {', '.join(twice)}")
        if "overrides" in names:  # the one parameter whose check needs the others' names
            at = names.index("overrides")
            given = params[at]
            params = (
                *params[:at],
                Param(
                    given.name,
                    given.default,
                    given.check,
                    given.help,
                    **{**given.limits, "parameters": tuple(names)},
                ),
                *params[at + 1 :],
            )
        self.params = {p.name: p for p in params}

    @property
    def names(self) -> list[str]:
        return list(self.params)

    def defaults(self) -> dict:
        return {name: p.default for name, p in self.params.items()}

    def check(self, namespace: dict) -> dict:
        """The declared parameters read from ``namespace`` (a notebook's ``globals()``) and checked:
        {name: the value to use}. Under papermill the names it injected are compared with the
        declared ones first (:func:`injected_parameters`). The first bad value raises
        :class:`WorkbookError`."""
        missing = [n for n in self.params if n not in namespace]
        if missing:
            raise WorkbookError(
                f"parameter(s) {', '.join(missing)} not set: run the notebook's "
                f"parameters cell first (it declares {', '.join(self.params)})"
            )
        values = _with_injected({name: namespace[name] for name in self.params})
        out = {}
        for name, value in values.items():
            try:
                out[name] = self.params[name](value)
            except WorkbookError:
                raise
            except ValueError as exc:
                raise WorkbookError(str(exc)) from None
        if ALLOW_CPU.name in out:  # a notebook that trains: no GPU-sized run on a CPU by mistake
            check_cpu_sized(out)
        return out

    def cell(self) -> str:
        """The source of the notebook's ``parameters`` cell: ``name = default`` with its help as a
        comment starting at column :data:`HELP_COLUMN`, wrapped at :data:`LINE` characters."""
        lines = []
        for p in self.params.values():
            code = f"{p.name} = {literal(p.default)}"
            pad = max(HELP_COLUMN, len(code) + 2)
            width = LINE - pad - 2
            wrapped = textwrap.wrap(
                p.help, width=width, break_on_hyphens=False, break_long_words=False
            ) or [""]
            lines.append(f"{code:<{pad}}# {wrapped[0]}")
            lines += [f"{'':<{HELP_COLUMN}}# {more}" for more in wrapped[1:]]
        return "\n".join(lines)


def literal(value) -> str:
    """``value`` as it is written in a parameters cell: text in double quotes, ``1_200_000`` for
    large integers, lists and mappings of those."""
    if isinstance(value, str):
        return json.dumps(value)
    if checks.is_integer(value):
        return f"{value:_}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


# --- the checks every notebook shares -------------------------------------------------------------


def notebooks_dir() -> Path:
    """Where a relative ``out_dir`` starts: the checkout's ``notebooks/`` folder (a notebook's own
    folder in JupyterLab), or the working directory when ssmkit is installed without a checkout."""
    folder = PROJECT_ROOT / "notebooks"
    return folder if folder.is_dir() else Path.cwd()


def resolve_out_dir(value) -> Path:
    """``value`` as an absolute path: ``~`` expanded, a relative path taken from
    :func:`notebooks_dir`."""
    if not isinstance(value, (str, Path)) or not str(value):
        raise WorkbookError(f"out_dir must be a non-empty path; got {value!r}")
    path = Path(value).expanduser()
    return path if path.is_absolute() else (notebooks_dir() / path).resolve()


def check_out_dir(value, name: str = "out_dir") -> Path:
    """An absolute directory (:func:`resolve_out_dir`), created."""
    path = resolve_out_dir(value)
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_run_config(value, name: str = "config") -> str:
    """A run config by name: ``configs/<value>.yaml``, or a model preset trained with the default
    recipe (:func:`~ssmkit.workbook.cells.run_config_names`)."""
    if not isinstance(value, str) or value not in run_config_names():
        raise unknown_run_config(value, name)
    return value


def check_data(value, name: str = "data") -> str:
    """ "stdlib-docs", a remote corpus of :data:`ssmkit.data.REMOTE`, or an existing path."""
    from ..data import REMOTE

    if not (
        isinstance(value, str)
        and (value in ("stdlib-docs", *REMOTE) or value and Path(value).exists())
    ):
        raise WorkbookError(
            f"{name}={value!r} is not valid; valid: 'stdlib-docs', "
            f"{', '.join(repr(n) for n in REMOTE)}, or an existing path"
        )
    return value


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(
            isinstance(try_to_load_from_cache(repo_id, name), str)
            for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
        )
    except Exception:  # not installed, or not a valid repo id
        return False


def check_tokenizer(value, name: str = "tokenizer") -> str:
    """ "gpt2", "byte", "bpe-<N>" (N >= 257), an existing directory, or a hub id ``owner/name``
    (accepted as spelled when online; offline only if the hub cache holds it). Never touches the
    network."""
    from ..env import offline

    if isinstance(value, str):
        if value in ("gpt2", "byte") or Path(value).expanduser().is_dir():
            return value
        size = re.fullmatch(r"bpe-(\d+)", value)
        if size:
            if int(size.group(1)) >= 257:
                return value
            raise WorkbookError(
                f"{name}={value!r}: a byte-level BPE needs at least 257 tokens "
                "(the 256 bytes + end of text), e.g. 'bpe-8192'"
            )
        if _HUB_ID.fullmatch(value) and not Path(value).exists():
            if not offline("hub") or _in_hub_cache(value):
                return value
            raise WorkbookError(
                f"{name}={value!r} is a hub id, but the hub is offline (HF_HUB_OFFLINE) "
                "and its cache does not hold it; offline, use 'gpt2', 'byte', 'bpe-<N>' or a "
                "directory of tokenizer files"
            )
    raise WorkbookError(
        f"{name}={value!r} is not valid; valid: 'gpt2', 'byte', 'bpe-<N>' "
        "(e.g. 'bpe-8192'), an existing directory, or a hub id 'owner/name' (online, or in "
        "the hub cache)"
    )


def check_device(value, name: str = "device") -> str:
    """A device that exists here, ``"auto"`` resolved
    (:func:`~ssmkit.workbook.cells.pick_device`)."""
    return pick_device(value)


# the device parameter, the same in every notebook
DEVICE = Param(
    "device", "auto", check_device,
    '"auto": cuda if visible, else mps, else cpu; or "cpu", "cuda", "cuda:1"',
)  # fmt: skip


# --- a GPU-sized run on a CPU --------------------------------------------------------------------

# The one rule that refuses a GPU-sized run when `device` resolved to cpu (check_cpu_sized): the
# training it asks for, 6 * parameters * tokens FLOP (Kaplan et al. 2020, eq. 2.1), would take more
# than CPU_HOURS at CPU_FLOP_S. CPU_FLOP_S is stated, not measured (a measurement would take longer
# than the check may): the workbook's cpu-tiny (7M parameters) trained at ~500-2,500 tokens/s on
# 1-2 cores, 2e10-1e11 FLOP/s; the low end is what a learner's kernel on a shared machine got. Every
# CPU default and params/cpu.yaml and params/ci.yaml plan under 10 minutes by this rule; the
# params/gpu-*.yaml recipes plan 44 h (gpu-a100-finetune.yaml in 04) to ~12 years (gpu-a100.yaml's
# 10B tokens of a 129M model: ~7.7e18 FLOP), so the line sits far from both.
CPU_FLOP_S = 2e10
CPU_HOURS = 12

# the override, declared by every notebook that trains
ALLOW_CPU = Param(
    "allow_cpu", False, checks.boolean,
    f"True: train on cpu even a run planned to take > {CPU_HOURS} h there",
)  # fmt: skip

SFT_WINDOW_TOKENS = 8 * 128  # notebook 04: a fine-tuning step is 8 packed windows of 128 tokens
_SIZE_IN_NAME = re.compile(r"(?<![0-9.])(\d+(?:\.\d+)?)([mb])(?![a-z0-9])", re.IGNORECASE)


def _config_params(name: str, overrides: dict) -> tuple[int, str] | None:
    """(parameters, model preset) of the run config ``name`` with ``overrides``, counted on the meta
    device (its own tokenizer's vocabulary: no tokenizer is loaded); None if it cannot be built."""
    import torch

    from ..models import MambaLM
    from .cells import train_config

    keep = {k: v for k, v in overrides.items() if k in ("model", "model_overrides")}
    try:
        run = train_config(name, max_steps=1, **keep)
        with torch.device("meta"):
            return sum(p.numel() for p in MambaLM(run.model_config()).parameters()), run.model
    except Exception:  # a bad override is named later, when the notebook builds its config
        return None


def _hub_params(base: str) -> int | None:
    """The size a pretrained model's name states ("state-spaces/mamba-130m-hf" -> 130M,
    "...mamba-2.8b-hf" -> 2.8B), or None (nothing is loaded to find out)."""
    size = _SIZE_IN_NAME.search(Path(str(base)).name)
    if not size:
        return None
    return int(float(size.group(1)) * (1e6 if size.group(2).lower() == "m" else 1e9))


def planned_training(values: dict) -> tuple[float, str]:
    """(FLOP, what) of the training a notebook's checked ``values`` ask for: 6 * parameters *
    tokens of ``config`` trained on ``max_tokens`` (notebook 04: only when ``base`` is "", plus its
    two fine-tuning runs, LoRA and full, of ``sft_steps`` x :data:`SFT_WINDOW_TOKENS` tokens of the
    base, its size read from its name). ``what`` says it in words. Comparison runs beside the main
    one (01's baseline, 03's sweep) are not counted: the main one decides."""
    flops, what = 0.0, []
    overrides = values.get("overrides") or {}
    base = values.get("base", "")
    if values.get("config") and values.get("max_tokens") and not base:
        counted = _config_params(values["config"], overrides)
        if counted:
            n, model = counted
            flops += 6 * n * values["max_tokens"]
            what.append(f"{model} ({_count(n)} parameters) on {values['max_tokens']:,} tokens")
    if base and values.get("sft_steps"):
        n = _hub_params(base)
        if n:
            tokens = values["sft_steps"] * SFT_WINDOW_TOKENS
            flops += 2 * 6 * n * tokens
            what.append(f"{base} ({_count(n)} parameters) fine-tuned twice on {tokens:,} tokens")
    return flops, " + ".join(what)


def check_cpu_sized(values: dict) -> None:
    """Raise :class:`WorkbookError` (one line) when ``device`` resolved to cpu, ``allow_cpu`` is not
    set and the training planned (:func:`planned_training`) would take more than
    :data:`CPU_HOURS` at :data:`CPU_FLOP_S`: a GPU recipe on a CPU-only machine stops in its
    notebook's check cell, before any data is prepared, instead of running for days."""
    if values.get(ALLOW_CPU.name) or str(values.get("device", "")) != "cpu":
        return
    flops, what = planned_training(values)
    seconds = flops / CPU_FLOP_S
    if seconds <= CPU_HOURS * 3600:
        return
    days = seconds / 86400
    took = (
        f"{days / 365:,.0f} years"
        if days >= 730
        else f"{days:,.0f} days"
        if days >= 2
        else format_duration(seconds)
    )
    raise WorkbookError(
        f"device resolved to cpu, and this is a GPU-sized run: {what} is "
        f"{_sci(flops)} FLOP, ~{took} at a CPU's ~{_sci(CPU_FLOP_S)} FLOP/s (the limit: "
        f"{CPU_HOURS} h); run it where cuda is visible, use a CPU params file (params/cpu.yaml), "
        "or set allow_cpu=True (-p allow_cpu true) to run it anyway"
    )


def _sci(x: float) -> str:
    return f"{x:.1e}".replace("e+", "e").replace(".0e", "e")


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:,.0f}M"


def train_keys() -> list[str]:
    """The fields of :class:`ssmkit.train.TrainConfig`: the keys ``overrides`` and a recipe file may
    set."""
    import dataclasses

    from ..train import TrainConfig

    return [f.name for f in dataclasses.fields(TrainConfig)]


def routed_keys() -> set[str]:
    """The TrainConfig keys a loose ``-f`` / papermill key may carry into a training notebook's
    overrides: :func:`train_keys` but :data:`NOT_ROUTED`."""
    return set(train_keys()) - set(NOT_ROUTED)


def check_overrides(value, name: str = "overrides", parameters=()) -> dict:
    """``overrides`` checked: a mapping (or its YAML text, as ``papermill -p`` passes it) of
    TrainConfig keys, none of them one of the notebook's ``parameters`` (set those directly) or a
    key the notebook sets itself (:data:`NOTEBOOK_SETS`). The values are checked when the
    TrainConfig is built. (A notebook's :class:`Parameters` fill in ``parameters``.)"""
    if isinstance(value, str):
        value = checks.parse_value(value)
    if value is None:
        value = {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise WorkbookError(
            "overrides must be a mapping of TrainConfig keys to values, e.g. "
            f"{{micro_batch: 4, lr: 1.0e-3}}; got {value!r}"
        )
    valid = train_keys()
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise WorkbookError(
            f"overrides: unknown TrainConfig key(s) {', '.join(unknown)}; valid: {', '.join(valid)}"
        )
    for key in value:
        if key in parameters:
            raise WorkbookError(
                f"overrides: {key} is a parameter of this notebook: set it directly "
                f"(-p {key} VALUE), not in overrides"
            )
        if NOTEBOOK_SETS.get(key) in parameters:
            raise WorkbookError(
                f"overrides: this notebook sets {key} from its parameter "
                f"{NOTEBOOK_SETS[key]}: set {NOTEBOOK_SETS[key]} instead"
            )
    return dict(value)


def workbook_folders() -> list[Path]:
    """The workbook's folders: :func:`notebooks_dir` and the checkout's ``papers/`` (the companion
    notes), so that one params file (``params/workshop.yaml``) holds the keys of both."""
    return [notebooks_dir(), PROJECT_ROOT / "papers"]


def workbook_parameters(folders=None) -> set[str]:
    """The names the workbook's notebooks declare: every ``NN_*.ipynb`` in ``folders`` (default:
    :func:`workbook_folders`); an unreadable notebook adds none."""
    names = set()
    for folder in folders or workbook_folders():
        for path in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb")):
            try:
                names |= set(declared_parameters(path))
            except WorkbookError:
                pass
    return names


# --- what papermill injected ----------------------------------------------------------------------


def injected_parameters() -> dict | None:
    """The names and values papermill injected into this kernel's notebook: the last cell of
    IPython's input history that starts with "# Parameters" and holds only ``name = value`` lines.
    None outside IPython or when papermill injected nothing (JupyterLab, or papermill without
    parameters)."""
    ipython = sys.modules.get("IPython")  # not imported: not in IPython
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return None
    for source in reversed(shell.user_ns.get("In", [])):
        if not isinstance(source, str) or source.split("\n", 1)[0].strip() != INJECTED_HEADER:
            continue
        try:
            body = ast.parse(source).body
        except SyntaxError:
            return None
        if not all(
            isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
            for n in body
        ):
            return None
        values = {}
        for node in body:
            name = node.targets[0].id
            try:
                values[name] = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError):
                values[name] = shell.user_ns.get(name)
        return values
    return None


def _with_injected(params: dict) -> dict:
    """``params`` with what papermill injected beyond them: TrainConfig keys joined to ``overrides``
    (when the notebook has it), other notebooks' parameters noted as unused, anything else an error.
    Also sets ``SSMKIT_PROGRESS=text`` under papermill (widget bars show frozen in its output)."""
    injected = injected_parameters()
    if injected is None:
        return params
    os.environ.setdefault("SSMKIT_PROGRESS", "text")
    extra = {k: v for k, v in injected.items() if k not in params}
    if not extra:
        return params
    keys = routed_keys()
    unknown = sorted(k for k in extra if k not in keys and k not in workbook_parameters())
    if unknown:
        raise WorkbookError(
            f"papermill passed parameter(s) {', '.join(unknown)} that this notebook does not "
            f"declare (papermill only warns, and the run would go on with the defaults); "
            f"its parameters: {', '.join(params)}"
        )
    others = {k: extra.pop(k) for k in list(extra) if k not in keys or "overrides" not in params}
    if others:
        print(
            "not used by this notebook (parameters of other notebooks, or TrainConfig keys for "
            f"those that train): {', '.join(f'{k}={v!r}' for k, v in others.items())}"
        )
    if not extra:
        return params
    shown = ", ".join(f"{k}={v!r}" for k, v in extra.items())
    base = params["overrides"]
    base = checks.parse_value(base) if isinstance(base, str) else base
    if base is not None and not isinstance(base, dict):
        return params  # check_overrides says what is wrong
    print(f"overrides from papermill's parameters: {shown}")
    return {**params, "overrides": {**(base or {}), **extra}}


# --- a run's parameters, per notebook (ssmkit workbook run) ---------------------------------------


def route_parameters(
    declared: dict, parameters: dict, shared: dict, workbook_names: set[str] = frozenset()
) -> tuple[dict, dict]:
    """The values each notebook gets, and the keys of ``shared`` it does not use.

    declared: {notebook: its declared parameters}; parameters: explicit (``-p``); shared: a params
    file (``-f``); workbook_names: the parameters of the workbook's other notebooks (a workbook-wide
    file may hold them). A notebook gets the keys it declares (explicit ones win) and, when it
    declares ``overrides``, the TrainConfig keys it does not declare, merged into ``overrides`` (the
    notebook's default, then the file's ``overrides`` and loose keys, then the explicit ones).
    Raises :class:`WorkbookError`, before anything runs, for an explicit key no notebook of the run
    takes, a file key that is neither a parameter of the workbook nor a TrainConfig key, or a bad
    ``overrides``.
    """
    known = set().union(*declared.values())
    train = routed_keys()
    trains = [Path(p).stem for p, names in declared.items() if "overrides" in names]
    unknown = sorted(k for k in parameters if k not in known and not (k in train and trains))
    if unknown:
        raise WorkbookError(
            f"parameter(s) {', '.join(unknown)} not declared by any notebook of this run; "
            f"declared: {', '.join(sorted(known)) or 'none'}"
            + (f" (and TrainConfig keys, for {', '.join(trains)})" if trains else "")
        )
    stray = sorted(k for k in shared if k not in known | set(workbook_names) and k not in train)
    if stray:
        raise WorkbookError(
            f"params file key(s) {', '.join(stray)}: not a parameter of any notebook "
            f"({', '.join(sorted(known | set(workbook_names))) or 'none'}) nor a TrainConfig "
            f"key ({', '.join(sorted(train))})"
        )
    values, unused = {}, {}
    for path, names in declared.items():
        values[path] = {k: v for k, v in {**shared, **parameters}.items() if k in names}
        takes = train if "overrides" in names else set()
        unused[path] = sorted(k for k in shared if k not in names and k not in takes)
        if "overrides" not in names:
            continue
        try:
            overrides = dict(names["overrides"]) if isinstance(names["overrides"], dict) else {}
            given = False
            for source in (shared, parameters):
                loose = {k: v for k, v in source.items() if k in train and k not in names}
                if "overrides" in source or loose:
                    mapping = (
                        check_overrides(source.get("overrides"), parameters=names)
                        if "overrides" in source
                        else {}
                    )
                    overrides.update({**mapping, **loose})
                    given = True
            if given:
                values[path]["overrides"] = check_overrides(overrides, parameters=names)
        except WorkbookError as exc:
            raise WorkbookError(f"{Path(path).name}: {exc}") from None
    return values, unused
