"""ssmkit.checks: the one grammar of values typed on a command line, and the validators every layer
uses."""

from __future__ import annotations

import pytest

from ssmkit import checks


def test_parse_value():
    assert [
        checks.parse_value(v) for v in ["3", "3e-3", "2_000", "true", "False", "none", "cpu", "1.5"]
    ] == [3, 0.003, 2000, True, False, None, "cpu", 1.5]


def test_integers_reads_lists_and_their_text():
    assert checks.integers("[256, 1024]", "lengths", minimum=2, ascending=True) == [256, 1024]
    assert checks.integers([2e3, 16], "widths") == [2000, 16]
    for bad, words in (
        ([], "non-empty list of integers >= 2"),
        ("[4, 2]", "ascending and distinct"),
        ([8, 8], "ascending and distinct"),
        ([1], ">= 2"),
        ([True], "integers"),
        ("x", "e.g. \\[16, 64\\]; got 'x'"),
    ):
        with pytest.raises(ValueError, match=words):
            checks.integers(bad, "lengths", minimum=2, ascending=True)


def test_integer_refuses_bools_and_fractions():
    assert checks.integer(5e8, "max_tokens", whole_floats=True) == 500_000_000
    for bad in (True, 1.5, "3", None):
        with pytest.raises(ValueError, match="seed must be an integer >= 0"):
            checks.integer(bad, "seed", minimum=0)


def test_load_yaml_refuses_documents_that_aliases_expand_past_the_limit():
    """Fault injected: nested aliases (9**9 values when expanded) and a self-referencing one; both
    are refused in well under a second, and a document under the limit loads with its aliases."""
    import time

    import yaml

    lines, prev = ["- &a [" + ",".join(["lol"] * 9) + "]"], "a"
    for name in "bcdefghi":
        lines.append(f"- &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = name
    for text in ("\n".join(lines), "x: &a [1, *a]"):
        start = time.monotonic()
        with pytest.raises(yaml.YAMLError, match=r"expands to more than 100,000 values"):
            checks.load_yaml(text)
        assert time.monotonic() - start < 1
    assert checks.load_yaml("a: &a [1, 2]\nb: *a") == {"a": [1, 2], "b": [1, 2]}


def test_unknown_key_names_the_near_miss_or_a_short_list():
    from ssmkit.checks import unknown_key

    valid = ["max_steps", "max_bad_steps", "max_tokens", *(f"key{i}" for i in range(40))]
    assert unknown_key("max_step", valid) == "unknown key 'max_step'; did you mean 'max_steps'?"
    far = unknown_key("zzzz", valid, "TrainConfig key")
    assert far.startswith("unknown TrainConfig key 'zzzz'; valid: max_steps, max_bad_steps, ")
    assert far.endswith(", ... (43 in all)") and far.count(",") == 12
    assert unknown_key("x", ["a", "b"]) == "unknown key 'x'; valid: a, b"


def test_endpoint_is_host_and_port():
    assert checks.endpoint("node001:29500", "e") == ("node001", 29500)
    assert checks.endpoint("127.0.0.1:1", "e") == ("127.0.0.1", 1)
    assert checks.endpoint("[::1]:65535", "e") == ("[::1]", 65535)
    for bad in ("node001", "node001:", ":29500", "node001:0", "node001:65536", "a b:1", 29500):
        with pytest.raises(ValueError, match=r"^e must be HOST:PORT .* got "):
            checks.endpoint(bad, "e")
