"""The ``ssmkit`` command as one table (:data:`ssmkit.cli.COMMANDS`): ``ssmkit --help`` lists
every command with its line and imports none of their modules; ``ssmkit CMD --help`` shows the
options that the command's own function declares, the same ones its module's ``python -m`` entry
point shows; a missing or unknown command is argparse's error, status 2.

Oracles: the table itself, each options function run on a fresh parser, one option per command
written out here, and the modules' own entry points.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from ssmkit.cli import COMMANDS, _load, main

# what `ssmkit --help` must not import: each command's module is loaded only when it runs
HEAVY = ("ssmkit.train", "ssmkit.workbook", "ssmkit.eval", "ssmkit.demo", "papermill", "lm_eval")
# one option each command is known for (the table must point at the right options function)
KNOWN = {
    "env": None,
    "demo": "--mixer",
    "data prepare": "--mds-seq-len",
    "train": "--nproc",
    "plan": "--gpu-memory-gb",
    "generate": "--max-new-tokens",
    "eval": "--tasks",
    "convert": "--to",
    "workbook run": "--params-file",
    "workbook strip": "notebooks",
    "workbook build": "--for",
}
WIDE = {"COLUMNS": "1000"}  # argparse wraps at the terminal's width, breaking lines at hyphens


def words(text: str) -> str:
    return " ".join(text.split())


def run_main(argv, capsys) -> tuple[int, str, str]:
    """``ssmkit ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def arguments(help_text: str) -> str:
    """A command's --help from its arguments on (past the usage and the description)."""
    first = "positional arguments:" if "positional arguments:" in help_text else "options:"
    return help_text[help_text.index(first) :]


def declared(options: str | None) -> list[str]:
    """The option strings (and positional names) the options function ``options`` declares."""
    parser = argparse.ArgumentParser(add_help=False)
    if options:
        _load(options)(parser)
    return [name for a in parser._actions for name in a.option_strings or [a.metavar or a.dest]]


def test_help_lists_every_command_with_its_line_and_imports_none_of_them():
    code = (
        "import sys\n"
        "from ssmkit.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **WIDE},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ssmkit [-h] [--debug] COMMAND ...")
    listed = words(done.stdout)
    for name, command in COMMANDS.items():
        assert f" {name} {words(command.help)} " in listed, name
    assert done.stderr.strip() == "[]"  # no command's module was imported


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_help_shows_its_own_options(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", WIDE["COLUMNS"])
    command = COMMANDS[name]
    code, out, _ = run_main([*name.split(), "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: ssmkit {name} [-h]")
    options = declared(command.options)
    assert KNOWN[name] in options if KNOWN[name] else options == [], (name, options)
    assert all(option in out for option in options), (name, options)
    assert callable(_load(command.run))


@pytest.mark.parametrize(
    "name, entry",
    [
        ("train", "ssmkit.train.cli:main"),
        ("plan", "ssmkit.train.planner:main"),
        ("demo", "ssmkit.demo:main"),
        ("workbook run", "ssmkit.workbook.cli:main"),
        ("workbook strip", "ssmkit.workbook.cli:main"),
        ("workbook build", "ssmkit.workbook.cli:main"),
    ],
)
def test_the_module_entry_points_show_the_same_options(name, entry, capsys, monkeypatch):
    """``python -m ssmkit.train`` (torchrun's), ``python -m ssmkit.demo``, ``python -m
    ssmkit.workbook`` build their parsers from the function the table names: the same options and
    help."""
    monkeypatch.setenv("COLUMNS", WIDE["COLUMNS"])
    _, ours, _ = run_main([*name.split(), "--help"], capsys)
    argv = name.split()[1:] + ["--help"]  # the workbook's: run|strip|build --help
    with pytest.raises(SystemExit) as done:
        _load(entry)(argv)
    theirs = capsys.readouterr().out
    assert done.value.code == 0 and "--help" in arguments(ours)
    assert arguments(ours) == arguments(theirs)


def test_a_missing_or_unknown_command_is_argparse_s_error(capsys):
    code, _, err = run_main([], capsys)
    assert code == 2 and "ssmkit: error: the following arguments are required: COMMAND" in err
    code, _, err = run_main(["data"], capsys)
    assert code == 2 and "ssmkit data: error: the following arguments are required: COMMAND" in err
    code, _, err = run_main(["trian"], capsys)
    assert code == 2 and "invalid choice: 'trian'" in err and "'data prepare'" in err
    code, _, err = run_main(["workbook", "go"], capsys)
    assert (
        code == 2
        and "ssmkit workbook: error" in err
        and "(choose from 'run', 'strip', 'build')" in err
    )
    code, out, _ = run_main(["data", "--help"], capsys)
    assert code == 0 and words(f"prepare {COMMANDS['data prepare'].help}") in words(out)
    code, _, err = run_main(["env", "--bogus"], capsys)
    assert code == 2 and "ssmkit env: error: unrecognized arguments: --bogus" in err
