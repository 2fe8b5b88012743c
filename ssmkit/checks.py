"""Checks at the door: one validator per kind of value, and one grammar for values typed on a
command line.

Every entry point that takes a user's value (TrainConfig, ModelConfig, notebook parameters, the
CLIs, ``prepare``, ``generate``) checks it here, so a mistake gets the same one-line message
wherever it is made, and ``True`` is never taken for the integer 1. Like :mod:`ssmkit.io`, this
module imports nothing of ssmkit: every layer may use it.

    integer(5e8, "max_tokens", whole_floats=True)  -> 500000000   (YAML writes budgets as 5e8)
    integer(True, "seed", minimum=0)        -> ValueError: seed must be an integer >= 0; got True
    integers("[256, 1024]", "lengths", minimum=2, ascending=True)  -> [256, 1024]
    number("x", "lr", low=0, low_open=True) -> ValueError: lr must be a number > 0; got 'x'
    parse_value("1e3"), parse_value("none"), parse_value("[1, 2]")  -> 1000.0, None, [1, 2]
"""

from __future__ import annotations

import math
import numbers
import re

DEVICES = "auto, cpu, cuda, cuda:N, mps"


def is_integer(value) -> bool:
    """An int (numpy ints too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number (ints, floats, numpy scalars), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(
    value,
    name: str,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    whole_floats: bool = False,
    none_ok: bool = False,
) -> int | None:
    """``value`` as an int (numpy ints too; never a bool). ``whole_floats``: also a float with an
    integer value, as YAML writes token budgets (``5e8``). ``none_ok``: None passes through."""
    if value is None and none_ok:
        return None
    if (
        whole_floats
        and is_number(value)
        and not is_integer(value)
        and math.isfinite(value)
        and float(value).is_integer()
    ):
        value = int(value)
    if not (
        is_integer(value)
        and (minimum is None or value >= minimum)
        and (maximum is None or value <= maximum)
    ):
        if maximum is None:
            what = (
                "a positive integer"
                if minimum == 1
                else "an integer"
                if minimum is None
                else f"an integer >= {minimum}"
            )
        else:
            what = (
                f"an integer <= {maximum}"
                if minimum is None
                else f"an integer in [{minimum}, {maximum}]"
            )
        raise ValueError(f"{name} must be {what}{' or None' if none_ok else ''}; got {value!r}")
    return int(value)


def integers(value, name: str, minimum: int | None = None, *, ascending: bool = False) -> list[int]:
    """A non-empty list of integers (each as :func:`integer` with ``whole_floats``), or its text as
    a command line writes it (``"[16, 64]"``); ``ascending``: strictly increasing (so also
    distinct)."""
    parsed = parse_value(value) if isinstance(value, str) else value
    floor = f" >= {minimum}" if minimum is not None else ""
    try:
        if not isinstance(parsed, (list, tuple)) or not parsed:
            raise ValueError
        values = [integer(v, name, minimum=minimum, whole_floats=True) for v in parsed]
    except ValueError:
        raise ValueError(
            f"{name} must be a non-empty list of integers{floor}, e.g. [16, 64]; got {value!r}"
        ) from None
    if ascending and values != sorted(set(values)):
        raise ValueError(f"{name} must be ascending and distinct; got {values}")
    return values


def number(
    value,
    name: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
) -> float:
    """``value`` as a float within [low, high] (``low_open``/``high_open``: strict); never a bool or
    NaN."""
    ok = is_number(value) and not math.isnan(value) and (not finite or math.isfinite(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low == 0 and low_open and high is None:
            raise ValueError(f"{name} must be a positive number; got {value!r}")
        if low is not None and high is not None:
            what = f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None or high is not None:
            what = (
                f" {'>' if low_open else '>='} {low:g}"
                if low is not None
                else f" {'<' if high_open else '<='} {high:g}"
            )
        else:
            what = ""
        raise ValueError(f"{name} must be a number{what}; got {value!r}")
    return float(value)


def probability(value, name: str, zero: bool = True, one: bool = True) -> float:
    """A number in [0, 1] (``zero``/``one`` False: the end is excluded)."""
    return number(value, name, 0.0, 1.0, low_open=not zero, high_open=not one)


def boolean(value, name: str) -> bool:
    """True / False, or the words "true" / "false" in any case (what papermill and YAML hand
    over)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{name} must be true or false; got {value!r}")


def choice(value, name: str, valid) -> str:
    """One of ``valid`` (None stands for a choice spelled "none": the grammar reads ``none`` as
    null)."""
    if value is None and "none" in tuple(valid):
        return "none"
    if value not in tuple(valid):
        raise ValueError(f"{name}={value!r} is not valid; valid: {', '.join(map(str, valid))}")
    return value


def text(value, name: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string; got {value!r}")
    return value


def endpoint(value, name: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port): a host name, an IPv4 address or a bracketed IPv6 one
    (``[::1]:29500``), and a port in 1-65535 (the form of torchrun's ``--rdzv-endpoint``)."""
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", str(value))
    if not isinstance(value, str) or match is None or not 1 <= int(match[2]) <= 65535:
        raise ValueError(
            f"{name} must be HOST:PORT (a host name or address, a port in 1-65535), "
            f"e.g. node001:29500 or 127.0.0.1:29500; got {value!r}"
        )
    return match[1], int(match[2])


def device_name(value, name: str = "device") -> str:
    """A device's spelling (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``); whether it exists
    here is :func:`ssmkit.env.pick_device`'s question."""
    kind, _, index = value.partition(":") if isinstance(value, str) else ("", "", "")
    if (
        kind not in ("auto", "cpu", "cuda", "mps")
        or (index and (kind != "cuda" or not index.isdigit()))
        or (value.endswith(":") if isinstance(value, str) else True)
    ):
        raise ValueError(f"{name}={value!r} is not valid; valid: {DEVICES}")
    return value


_LOADER = None


def _loader():
    """PyYAML's SafeLoader with the grammar above: 1e3 is a float, none is null, yes/no/on/off are
    words."""
    global _LOADER
    if _LOADER is None:
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        Loader.yaml_implicit_resolvers = {
            first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
            for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
        }
        Loader.add_implicit_resolver(
            "tag:yaml.org,2002:bool",
            re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
            list("tTfF"),
        )
        Loader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+$"),
            list("-+0123456789."),
        )
        Loader.add_implicit_resolver(
            "tag:yaml.org,2002:null", re.compile(r"^(?:none|None|NONE)$"), list("nN")
        )
        _LOADER = Loader
    return _LOADER


MAX_YAML_VALUES = 100_000  # values a document may expand to through its &anchors / *aliases


def _expanded_size_exceeds(data, limit: int) -> bool:
    """Whether ``data``, with every shared (aliased) list or mapping counted once per use, holds
    more than ``limit`` values; stops counting at the limit, so a "billion laughs" document (nine
    aliases of nine aliases ...) or a self-referencing one costs ``limit`` steps, not 9**9."""
    count, stack = 0, [data]
    while stack:
        item = stack.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
    return False


def load_yaml(text_value: str):
    """A YAML document read with ssmkit's grammar (config files, params files, command-line values):
    ``1e3`` / ``3e-3`` are floats (YAML 1.1 keeps them strings), ``none`` is null, and only
    ``true``/``false`` are booleans (YAML 1.1 also reads yes/no/on/off as booleans). Raises
    yaml.YAMLError, also for a document whose aliases expand it past :data:`MAX_YAML_VALUES`
    values (anything that walked it -- a check, a repr, papermill -- would hang)."""
    import yaml

    data = yaml.load(text_value, Loader=_loader())  # noqa: S506  (a SafeLoader subclass)
    if _expanded_size_exceeds(data, MAX_YAML_VALUES):
        raise yaml.YAMLError(
            f"the document expands to more than {MAX_YAML_VALUES:,} values through its "
            "&anchors and *aliases (nested or self-referencing); write the values out instead"
        )
    return data


def parse_value(text_value: str):
    """A value typed on a command line (``--set key=VALUE``, ``-p key VALUE``), read by
    :func:`load_yaml`: ``3`` int, ``1e3`` float, ``true`` bool, ``none`` None, ``[1, 2]`` list,
    ``{a: 1}`` dict, ``"text"`` or anything that is not YAML a string; the empty string stays
    ``""``."""
    import yaml

    if text_value.strip() == "":
        return text_value
    try:
        return load_yaml(text_value)
    except yaml.YAMLError:
        return text_value  # not YAML (e.g. "a: b: c"): the text itself


def unknown_key(key: str, valid, what: str = "key") -> str:
    """The message for a ``key`` not among ``valid``: the closest valid names when there are some
    (``unknown key 'max_step'; did you mean 'max_steps'?``), else the valid names, at most 12 of
    them (a list of 40 hides the one meant)."""
    import difflib

    valid = list(valid)
    score = {v: difflib.SequenceMatcher(None, key, v).ratio() for v in valid}
    best = max(score.values(), default=0.0)
    close = sorted((v for v in valid if score[v] >= max(0.6, best - 0.05)), key=score.get)[::-1]
    if close:
        return f"unknown {what} {key!r}; did you mean {' or '.join(map(repr, close))}?"
    shown = ", ".join(valid[:12]) + (f", ... ({len(valid)} in all)" if len(valid) > 12 else "")
    return f"unknown {what} {key!r}; valid: {shown}"
