"""ssmkit.papers.claims: each kind's check against hand-made cases, its refusals, and the table,
records and verify() a note ends with."""

import json

import pytest
import torch

from ssmkit.papers.claims import Claim, ClaimBook, ClaimsFailed, relative_error

P = "A paper (2024)"


def book():
    return ClaimBook(
        [
            Claim("same", P, "eq. (1)", "identity", "two ways agree"),
            Claim("count", P, "Table 2", "identity", "a parameter count"),
            Claim("better", P, "Figure 3", "ordering", "A beats B"),
            Claim("bound", P, "Section 4", "threshold", "accuracy above 0.9"),
            Claim("big", P, "Table 1, p. 7", "cited", "a 7B result", paper_value="71.2"),
        ]
    )


def test_identity_in_float64_passes_within_1e8_and_fails_beyond():
    b = book()
    a = torch.linspace(1, 2, 10, dtype=torch.float64)
    assert b.identity("same", a, a * (1 + 1e-10)).passed is True
    assert b.identity("same", a, a * (1 + 1e-6)).passed is False
    assert b.outcomes["same"].verdict == "FAIL"


def test_identity_refuses_float32_and_a_loose_tolerance():
    b = book()
    with pytest.raises(ValueError, match="float64"):
        b.identity("same", torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="at most 1e-08"):
        b.identity(
            "same", torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), tol=1e-4
        )


def test_integer_identity_is_exact():
    b = book()
    assert b.identity("count", 1_000, 1_000).passed is True
    assert b.identity("count", 1_000, 1_001).passed is False
    assert b.identity("count", torch.tensor([1, 2]), torch.tensor([1, 2])).passed is True


def test_ordering_needs_every_seed_and_three_of_them():
    b = book()
    assert b.ordering("better", {0: 0.9, 1: 0.8, 2: 0.7}, {0: 0.5, 1: 0.6, 2: 0.1}).passed
    out = b.ordering("better", {0: 0.9, 1: 0.5, 2: 0.7}, {0: 0.5, 1: 0.6, 2: 0.1})
    assert out.passed is False and "2/3 seeds" in out.ours and out.per_seed[1] == [0.5, 0.6]
    assert out.verdict == "not reproduced"  # a result, not a bug: FAIL is for identities
    assert b.ordering(
        "better", {0: 1.0, 1: 2, 2: 3}, {0: 2, 1: 3, 2: 4}, higher_is_better=False
    ).passed  # losses: smaller wins
    with pytest.raises(ValueError, match="at least 3"):
        b.ordering("better", {0: 1, 1: 1}, {0: 0, 1: 0})
    with pytest.raises(ValueError, match="same seeds"):
        b.ordering("better", {0: 1, 1: 1, 2: 1}, {0: 0, 1: 0, 3: 0})


def test_a_small_run_is_shown_but_not_judged():
    b = book()
    out = b.ordering("better", {0: 0.1}, {0: 0.9}, judged=False)  # one seed: allowed unjudged
    assert out.passed is None and out.verdict == "not judged at this size"


def test_threshold_bounds():
    b = book()
    assert b.threshold("bound", {0: 0.95, 1: 0.91, 2: 0.99}, at_least=0.9).passed
    assert not b.threshold("bound", {0: 0.95, 1: 0.85, 2: 0.99}, at_least=0.9).passed
    assert not b.threshold("bound", {0: 0.5, 1: 0.5, 2: 2.0}, at_most=1.0).passed
    with pytest.raises(ValueError, match="at_least, at_most"):
        b.threshold("bound", {0: 1, 1: 1, 2: 1})


def test_kind_mismatch_unknown_id_and_declaration_errors():
    b = book()
    with pytest.raises(ValueError, match="declared 'ordering'"):
        b.threshold("better", {0: 1, 1: 1, 2: 1}, at_least=0)
    with pytest.raises(KeyError, match="declared: same"):
        b.cite("nope")
    with pytest.raises(ValueError, match="kind 'guess'"):
        Claim("x", P, "here", "guess", "s")
    with pytest.raises(ValueError, match="needs the paper's value"):
        Claim("x", P, "here", "cited", "s")
    with pytest.raises(ValueError, match="unique"):
        ClaimBook([Claim("x", P, "h", "identity", "s")] * 2)


def test_table_records_save_and_verify(tmp_path):
    b = book()
    b.identity("same", torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    b.cite("big", note="needs 7B parameters")
    table = b.table()
    assert table.count("\n") == 6  # header, rule, five claims
    assert "NOT CHECKED" in table and "cited, not reproduced" in table and "| 71.2 |" in table
    with pytest.raises(ClaimsFailed, match="never checked: count, better, bound"):
        b.verify()
    b.identity("count", 3, 3)
    b.ordering("better", {0: 1, 1: 1, 2: 1}, {0: 0, 1: 0, 2: 2})
    b.threshold("bound", {0: 1, 1: 1, 2: 1}, at_least=0.9)
    assert b.verify() == ["better"]  # an ordering that did not hold: reported, the note runs on
    assert "| not reproduced |" in b.table()
    b.identity("same", torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ClaimsFailed, match="failed: same$"):
        b.verify()  # an identity that fails is a bug: the note stops
    b.save(tmp_path / "claims.json")
    records = json.loads((tmp_path / "claims.json").read_text())
    assert [r["id"] for r in records] == ["same", "count", "better", "bound", "big"]
    assert records[2]["outcome"]["passed"] is False
    assert records[2]["outcome"]["per_seed"]["2"] == [1.0, 2.0]


def test_relative_error():
    assert relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])) == 0.5
    assert relative_error(torch.tensor([1e-3]), torch.tensor([0.0])) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(torch.zeros(2), torch.zeros(3))


def test_per_seed_picks_the_matching_runs():
    from ssmkit.papers.claims import per_seed

    rows = [
        {"seed": s, "model": m, "n": n, "accuracy": a, "loss": -a}
        for s, m, n, a in [(0, "a", 1, 0.5), (1, "a", 1, 0.6), (0, "a", 2, 0.7), (0, "b", 1, 0.1)]
    ]
    assert per_seed(rows, model="a", n=1) == {0: 0.5, 1: 0.6}
    assert per_seed(rows, "loss", model="b") == {0: -0.1}
    assert per_seed(rows, model="c") == {}


def test_report_tables_every_claim_of_a_run_and_names_a_note_that_stopped(tmp_path):
    import subprocess
    import sys

    from ssmkit.papers import report
    from ssmkit.workbook.notebooks import WorkbookError

    b = book()
    b.identity("same", torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    b.ordering("better", {0: 1, 1: 1, 2: 1}, {0: 0, 1: 0, 2: 2})
    (tmp_path / "01_first").mkdir()
    b.save(tmp_path / "01_first" / "claims.json")
    (tmp_path / "02_stopped").mkdir()
    table = report(tmp_path)
    assert table.count("| 01_first |") == 5 and "| 02_stopped |" in table
    assert (
        "| **better**: A beats B | ordering | (in words) | 1 vs 0; 1 vs 0; 1 vs 2 (2/3 seeds) |"
        " not reproduced |" in table
    )
    assert table.endswith(
        "5 claims: 3 NOT CHECKED, 1 not reproduced, 1 pass; 1 note(s) stopped before their claims "
        "table\n"
    ), table
    with pytest.raises(WorkbookError, match="no note folders"):
        report(tmp_path / "01_first")
    done = subprocess.run(
        [sys.executable, "-m", "ssmkit.papers", "--report", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and (tmp_path / "claims.md").read_text() == table, done.stderr
