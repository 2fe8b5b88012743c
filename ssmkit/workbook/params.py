"""A notebook's parameters: checked in its first cell, and routed to it by the runner.

    p = check_params(preset=preset, data=data, max_tokens=max_tokens, device=device, out_dir=out_dir,
                     seed=seed, overrides=overrides)          # every parameter of the notebook
    cfg = train_config(p["preset"], max_tokens=p["max_tokens"], ..., **p["overrides"])

Rules, the same under ``ssmkit workbook run``, plain ``papermill`` and JupyterLab:

* every parameter is checked (:data:`CHECKS` names the known ones; an unknown name is refused, so a new
  parameter cannot slip through unchecked); the first bad value raises one :class:`WorkbookError` line;
* a relative ``out_dir`` starts at the checkout's ``notebooks/`` folder (:func:`notebooks_dir`), whatever
  the working directory of the process, so ``papermill notebooks/01_....ipynb out.ipynb`` run from the
  repository root writes where JupyterLab does;
* ``overrides`` holds more :class:`~ssmkit.train.TrainConfig` keys for a notebook that trains (a recipe's
  ``micro_batch``, ``lr``, ...), checked against TrainConfig's fields (:func:`check_overrides`);
* under plain papermill, a name papermill injected that the notebook does not declare stops the run
  (papermill only warns "Passed unknown parameter" and goes on with the defaults), except TrainConfig
  keys, which join ``overrides`` (so ``-f params/gpu-a100.yaml`` works with papermill and with
  ``ssmkit workbook run`` alike), and parameters of the workbook's other notebooks (a workbook-wide file
  such as ``params/cpu.yaml``), which are noted as not used: :func:`injected_parameters`;
* ``ssmkit workbook run -f FILE``: :func:`route_parameters` gives each notebook the keys it declares and
  the TrainConfig keys (as ``overrides``) when it declares ``overrides``; a file key that no notebook of
  the workbook declares and that is not a TrainConfig key is an error before anything runs.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

from .. import checks
from .cells import pick_device, preset_names, unknown_preset
from .notebooks import PROJECT_ROOT, WorkbookError, declared_parameters

__all__ = ["CHECKS", "check_overrides", "check_params", "injected_parameters", "notebooks_dir",
           "resolve_out_dir", "route_parameters", "train_keys", "workbook_parameters"]

INJECTED_HEADER = "# Parameters"       # the first line of the cell papermill injects (Python kernels)
# TrainConfig keys a notebook sets itself from one of its parameters: not accepted in overrides
NOTEBOOK_SETS = {"overwrite": "out_dir", "eval_every": "evals"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


# TrainConfig keys that say WHAT a run trains from, not how: a params file's or papermill's loose key reaches
# only a notebook that declares it (notebook 04's `base`), never a pretraining notebook's overrides, where
# it would silently turn the run into a fine-tuning of another model (explicit `overrides` may still set them)
NOT_ROUTED = ("base", "lora")


def routed_keys() -> set[str]:
    """The TrainConfig keys a loose ``-f`` / papermill key may carry into a training notebook's overrides:
    :func:`train_keys` but :data:`NOT_ROUTED`."""
    return set(train_keys()) - set(NOT_ROUTED)


def train_keys() -> list[str]:
    """The fields of :class:`ssmkit.train.TrainConfig`: the keys ``overrides`` and a recipe file may set."""
    import dataclasses

    from ..train import TrainConfig

    return [f.name for f in dataclasses.fields(TrainConfig)]


def notebooks_dir() -> Path:
    """Where a relative ``out_dir`` starts: the checkout's ``notebooks/`` folder (a notebook's own folder
    in JupyterLab), or the working directory when ssmkit is installed without a checkout."""
    folder = PROJECT_ROOT / "notebooks"
    return folder if folder.is_dir() else Path.cwd()


def workbook_parameters(folders=None) -> set[str]:
    """The names the workbook's notebooks declare: every ``NN_*.ipynb`` in ``folders`` (default:
    :func:`notebooks_dir`); an unreadable notebook adds none."""
    names = set()
    for folder in folders or [notebooks_dir()]:
        for path in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb")):
            try:
                names |= set(declared_parameters(path))
            except WorkbookError:
                pass
    return names


def resolve_out_dir(value) -> Path:
    """``value`` as an absolute path: ``~`` expanded, a relative path taken from :func:`notebooks_dir`."""
    if not isinstance(value, (str, Path)) or not str(value):
        raise WorkbookError(f"out_dir must be a non-empty path; got {value!r}")
    path = Path(value).expanduser()
    return path if path.is_absolute() else (notebooks_dir() / path).resolve()


# --- one check per parameter ----------------------------------------------------------------------

def _preset(value):
    if not isinstance(value, str) or value not in preset_names():
        raise unknown_preset(value)
    return value


def _data(value):
    from ..data import REMOTE

    if not (isinstance(value, str) and (value in ("stdlib-docs", *REMOTE) or value and Path(value).exists())):
        raise WorkbookError(f"data={value!r} is not valid; valid: 'stdlib-docs', "
                            f"{', '.join(repr(n) for n in REMOTE)}, or an existing path")
    return value


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(isinstance(try_to_load_from_cache(repo_id, name), str)
                   for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    except Exception:           # not installed, or not a valid repo id
        return False


def _tokenizer(value):
    """"gpt2", "byte", "bpe-<N>" (N >= 257), an existing directory, or a hub id ``owner/name`` (accepted
    as spelled when online; offline only if the hub cache holds it). Never touches the network."""
    if isinstance(value, str):
        if value in ("gpt2", "byte") or Path(value).expanduser().is_dir():
            return value
        size = re.fullmatch(r"bpe-(\d+)", value)
        if size:
            if int(size.group(1)) >= 257:
                return value
            raise WorkbookError(f"tokenizer={value!r}: a byte-level BPE needs at least 257 tokens "
                                "(the 256 bytes + end of text), e.g. 'bpe-8192'")
        if _HUB_ID.fullmatch(value) and not Path(value).exists():
            if not _offline() or _in_hub_cache(value):
                return value
            raise WorkbookError(f"tokenizer={value!r} is a hub id, but the hub is offline (HF_HUB_OFFLINE) "
                                "and its cache does not hold it; offline, use 'gpt2', 'byte', 'bpe-<N>' or a "
                                "directory of tokenizer files")
    raise WorkbookError(f"tokenizer={value!r} is not valid; valid: 'gpt2', 'byte', 'bpe-<N>' "
                        "(e.g. 'bpe-8192'), an existing directory, or a hub id 'owner/name' (online, or in "
                        "the hub cache)")


def _integer(name: str, minimum: int):
    def check(value):
        try:        # 2e5 from YAML or -p is 200000; never True
            return checks.integer(value, name, minimum=minimum, whole_floats=True)
        except ValueError:
            raise WorkbookError(f"{name} must be an integer >= {minimum}; got {value!r}") from None
    return check


def _precision(value):
    from ..train.config import CHOICES

    return checks.choice(value, "precision", CHOICES["precision"])


def _lengths(value) -> list[int]:
    """A non-empty ascending list of distinct lengths >= 2 (``-p`` passes its text: "[1024, 4096]")."""
    parsed = checks.parse_value(value) if isinstance(value, str) else value
    try:
        if not isinstance(parsed, (list, tuple)) or not parsed:
            raise ValueError
        lengths = [checks.integer(v, "length", minimum=2, whole_floats=True) for v in parsed]
    except ValueError:
        raise WorkbookError(f"context_lengths must be a list of sequence lengths >= 2, e.g. [1024, 4096]; "
                            f"got {value!r}") from None
    if lengths != sorted(set(lengths)):
        raise WorkbookError(f"context_lengths must be ascending and distinct; got {lengths}")
    return lengths


def _out_dir(value) -> Path:
    path = resolve_out_dir(value)
    path.mkdir(parents=True, exist_ok=True)
    return path


# name -> check(value) -> the value to use; ``overrides`` is checked by check_overrides (it needs the
# notebook's other parameters). A notebook parameter needs an entry here (or check_params refuses it).
CHECKS = {
    "preset": _preset,                                      # configs/<preset>.yaml or a model preset
    "data": _data,                                          # a source name or an existing path
    "tokenizer": _tokenizer,
    "max_tokens": _integer("max_tokens", 1),
    "device": pick_device,                                  # "auto" resolved: cuda, mps or cpu
    "precision": _precision,                                # fp32 | bf16 | fp16
    "evals": _integer("evals", 1),
    "baseline": lambda value: checks.boolean(value, "baseline"),    # also "true"/"false" (papermill -p)
    "out_dir": _out_dir,                                    # an absolute Path, created
    "attn_every": _integer("attn_every", 1),                # 03: attention at layer i if i % attn_every
                                                            #     == attn_every // 2 (Jamba's rule)
    "sweep_width": _integer("sweep_width", 1),              # 03: d_model of the ratio sweep's models
    "sweep_depth": _integer("sweep_depth", 8),              # 03: their layers (8+: attn_every 8 has one)
    "sweep_steps": _integer("sweep_steps", 1),              # 03: training steps on the recall task
    "sweep_tokens": _integer("sweep_tokens", 0),            # 03: language-model tokens each (0: none)
    "context_lengths": _lengths,                            # 03: ascending sequence lengths
    "seed": _integer("seed", 0),
    "overrides": None,
}


def check_overrides(value, parameters) -> dict:
    """``overrides`` checked: a mapping (or its YAML text, as ``papermill -p`` passes it) of TrainConfig keys,
    none of them one of the notebook's ``parameters`` (set those directly) or a key the notebook sets
    itself (:data:`NOTEBOOK_SETS`). The values are checked when the TrainConfig is built."""
    if isinstance(value, str):
        value = checks.parse_value(value)
    if value is None:
        value = {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise WorkbookError("overrides must be a mapping of TrainConfig keys to values, e.g. "
                            f"{{micro_batch: 4, lr: 1.0e-3}}; got {value!r}")
    valid = train_keys()
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise WorkbookError(f"overrides: unknown TrainConfig key(s) {', '.join(unknown)}; "
                            f"valid: {', '.join(valid)}")
    for key in value:
        if key in parameters:
            raise WorkbookError(f"overrides: {key} is a parameter of this notebook: set it directly "
                                f"(-p {key} VALUE), not in overrides")
        if NOTEBOOK_SETS.get(key) in parameters:
            raise WorkbookError(f"overrides: this notebook sets {key} from its parameter "
                                f"{NOTEBOOK_SETS[key]}: set {NOTEBOOK_SETS[key]} instead")
    return dict(value)


def check_params(**params) -> dict:
    """Check every parameter of a notebook (pass them all: the check also compares them with what papermill
    injected); returns the values to use. The first bad value raises :class:`WorkbookError` naming it and
    what is valid; a name without a check in :data:`CHECKS` is refused.

    ``preset`` (:func:`~ssmkit.workbook.preset_names`), ``data`` (a source name or an existing path),
    ``tokenizer`` ("gpt2", "byte", "bpe-<N>", a directory, or a hub id ``owner/name``: offline only if
    cached), ``max_tokens`` (int >= 1; 2e5 is 200000), ``device`` (resolved by
    :func:`~ssmkit.workbook.pick_device`), ``precision`` (fp32, bf16, fp16), ``evals`` (int >= 1),
    ``baseline`` (true/false), ``out_dir`` (an absolute :class:`~pathlib.Path`, created; a relative path
    starts at the checkout's ``notebooks/`` folder, whatever the working directory: :func:`resolve_out_dir`),
    ``seed`` (int >= 0), ``overrides`` (:func:`check_overrides`); notebook 03's ``attn_every`` (>= 1),
    ``sweep_width`` (>= 1), ``sweep_depth`` (>= 8), ``sweep_steps`` (>= 1), ``sweep_tokens`` (>= 0) and
    ``context_lengths`` (ascending lengths >= 2, e.g. ``[1024, 4096]`` or its text).

    Under papermill (a cell injected by it, found in the kernel's input history): names it injected that
    are not among ``params`` stop the run, except TrainConfig keys, which are added to ``overrides`` (or
    noted as unused, for a notebook without ``overrides``), and the parameters of the workbook's other
    notebooks (:func:`workbook_parameters`), noted as unused; and ``SSMKIT_PROGRESS`` is set to "text" when
    unset (progress bars as text: widgets show frozen in papermill's output). Elsewhere this is a no-op.
    """
    params = _with_injected(params)
    out = {}
    for key, value in params.items():
        if key not in CHECKS:
            raise WorkbookError(f"check_params: no check for parameter {key!r} (known: {', '.join(CHECKS)}); "
                                "add one to ssmkit/workbook/params.py")
        try:
            out[key] = check_overrides(value, params) if key == "overrides" else CHECKS[key](value)
        except WorkbookError:
            raise
        except ValueError as exc:
            raise WorkbookError(str(exc)) from None
    return out


# --- what papermill injected -----------------------------------------------------------------------

def injected_parameters() -> dict | None:
    """The names and values papermill injected into this kernel's notebook: the last cell of IPython's input
    history that starts with "# Parameters" and holds only ``name = value`` lines. None outside IPython
    or when papermill injected nothing (JupyterLab, or papermill without parameters)."""
    ipython = sys.modules.get("IPython")                  # not imported: not in IPython
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
        if not all(isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                   for n in body):
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
        raise WorkbookError(f"papermill passed parameter(s) {', '.join(unknown)} that this notebook does not "
                            f"declare (papermill only warns, and the run would go on with the defaults); "
                            f"its parameters: {', '.join(params)}")
    others = {k: extra.pop(k) for k in list(extra) if k not in keys or "overrides" not in params}
    if others:
        print("not used by this notebook (parameters of other notebooks, or TrainConfig keys for those that "
              f"train): {', '.join(f'{k}={v!r}' for k, v in others.items())}")
    if not extra:
        return params
    shown = ", ".join(f"{k}={v!r}" for k, v in extra.items())
    base = params["overrides"]
    base = checks.parse_value(base) if isinstance(base, str) else base
    if base is not None and not isinstance(base, dict):
        return params                                      # check_overrides says what is wrong
    print(f"overrides from papermill's parameters: {shown}")
    return {**params, "overrides": {**(base or {}), **extra}}


# --- a run's parameters, per notebook (ssmkit workbook run) -------------------------------------------

def route_parameters(declared: dict, parameters: dict, shared: dict,
                     workbook_names: set[str] = frozenset()) -> tuple[dict, dict]:
    """The values each notebook gets, and the keys of ``shared`` it does not use.

    declared: {notebook: its declared parameters}; parameters: explicit (``-p``); shared: a params file
    (``-f``); workbook_names: the parameters of the workbook's other notebooks (a workbook-wide file may
    hold them). A notebook gets the keys it declares (explicit ones win) and, when it declares
    ``overrides``, the TrainConfig keys it does not declare, merged into ``overrides`` (the notebook's
    default, then the file's ``overrides`` and loose keys, then the explicit ones). Raises
    :class:`WorkbookError`, before anything runs, for an explicit key no notebook of the run takes, a file
    key that is neither a parameter of the workbook nor a TrainConfig key, or a bad ``overrides``.
    """
    known = set().union(*declared.values())
    train = routed_keys()
    trains = [Path(p).stem for p, names in declared.items() if "overrides" in names]
    unknown = sorted(k for k in parameters if k not in known and not (k in train and trains))
    if unknown:
        raise WorkbookError(f"parameter(s) {', '.join(unknown)} not declared by any notebook of this run; "
                            f"declared: {', '.join(sorted(known)) or 'none'}"
                            + (f" (and TrainConfig keys, for {', '.join(trains)})" if trains else ""))
    stray = sorted(k for k in shared if k not in known | set(workbook_names) and k not in train)
    if stray:
        raise WorkbookError(f"params file key(s) {', '.join(stray)}: not a parameter of any notebook "
                            f"({', '.join(sorted(known | set(workbook_names))) or 'none'}) nor a TrainConfig "
                            f"key ({', '.join(sorted(train))})")
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
                    mapping = check_overrides(source.get("overrides"), names) if "overrides" in source else {}
                    overrides.update({**mapping, **loose})
                    given = True
            if given:
                values[path]["overrides"] = check_overrides(overrides, names)
        except WorkbookError as exc:
            raise WorkbookError(f"{Path(path).name}: {exc}") from None
    return values, unused
