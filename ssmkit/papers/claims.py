"""Claims a companion note checks: each one a record with its provenance, checked by a computation
in the note, and shown in the table the note ends with.

A note declares its claims up front (:class:`Claim`: which paper, where in it, what kind, the
statement in words, and the paper's own value where that value was checked in the paper's text),
then its cells check them one by one through a :class:`ClaimBook`, which records what was measured
(:class:`Outcome`) and renders the table::

    CLAIMS = [Claim("ssd-duality", MAMBA2, "Section 6, eq. (16)", "identity",
                    "the SSD recurrence equals its masked quadratic (attention) form")]
    book = ClaimBook(CLAIMS)
    book.identity("ssd-duality", y_recurrent, y_quadratic)     # float64, max rel. error <= 1e-8
    book.table()                                               # markdown, one row per claim
    book.verify()                  # raises if an identity failed or a claim never ran; returns the
                                   # results that did not hold ("not reproduced")

Kinds (``KINDS``):

* ``identity``: two computations of one thing agree, in float64, to a relative error of at most
  ``IDENTITY_TOL`` (max |a - b| / max |b|); or, for integers (parameter counts, layer indices),
  exactly.
* ``ordering``: on a small synthetic task, A beats B on every one of at least ``MIN_SEEDS`` seeds;
  every seed's pair of values is reported.
* ``threshold``: a measured value clears a bound on every one of at least ``MIN_SEEDS`` seeds.
* ``cited``: a number the paper reports that this machine cannot reproduce (a 7B model, a GPU
  kernel's speed): shown with its source, never as a result of ours.

Ordering and threshold claims are judged at the recipe's size, fixed before the run. A smaller run
(CI's parameters) still computes them but records ``judged=False``: its row says "not judged at this
size" instead of pass or fail, so a quick run never passes off a small result as the paper's.

Failing means two different things. An identity that fails is a bug (in the code or in our
reading of the equation): its verdict is "FAIL" and :meth:`ClaimBook.verify` stops the note. An
ordering or a threshold that does not hold on every seed of the fixed recipe is a *result*: its
verdict is "not reproduced", every seed is shown, and the note runs on. The recipe is never tuned
afterwards until the claim holds; that would turn the check into a search for the paper's answer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..io import write_json

__all__ = [
    "IDENTITY_TOL",
    "KINDS",
    "MIN_SEEDS",
    "Claim",
    "ClaimBook",
    "ClaimsFailed",
    "Outcome",
    "per_seed",
    "relative_error",
]

KINDS = ("identity", "ordering", "threshold", "cited")
IDENTITY_TOL = 1e-8  # float64 identities: relative error bound
MIN_SEEDS = 3  # ordering / threshold claims hold on at least this many seeds


class ClaimsFailed(AssertionError):
    """An identity that failed, or a claim declared and never checked."""


@dataclass(frozen=True)
class Claim:
    """One claim of a paper, declared before anything runs.

    id: short name, unique within a note ("ssd-duality").
    paper: the paper, e.g. "Mamba-2 (Dao & Gu 2024, arXiv 2405.21060)".
    where: the place in the paper: "Section 6, eq. (16)", "Table 1, p. 8", "Figure 4".
    kind: one of :data:`KINDS`.
    statement: the claim in words, as this note checks it.
    paper_value: the paper's own number, verbatim, only where it was checked in the paper's text
        (``where`` then names the table and page); None where the claim is described in words.
    """

    id: str
    paper: str
    where: str
    kind: str
    statement: str
    paper_value: str | None = None

    def __post_init__(self):
        for name in ("id", "paper", "where", "statement"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Claim.{name} must be non-empty text; got {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"claim {self.id!r}: kind {self.kind!r}; valid: {', '.join(KINDS)}")
        if self.kind == "cited" and not self.paper_value:
            raise ValueError(
                f"claim {self.id!r} is 'cited': it needs the paper's value (paper_value) and where "
                "it is printed"
            )


@dataclass(frozen=True)
class Outcome:
    """What a note measured for one claim.

    ours: the measured value, as text ("3.1e-15", "0.98 vs 0.31 (3/3 seeds)").
    passed: True / False; None for a cited claim or one not judged at this run's size.
    bound: the rule applied ("rel. err <= 1e-08", ">= 0.9", "A > B on every seed").
    per_seed: {seed: value} or {seed: [A, B]}, every seed run (empty for an identity).
    """

    claim: Claim
    ours: str
    passed: bool | None
    bound: str
    per_seed: dict = field(default_factory=dict)
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.claim.kind == "cited":
            return "cited, not reproduced"
        if self.passed is None:
            return "not judged at this size"
        if self.passed:
            return "pass"
        return "FAIL" if self.claim.kind == "identity" else "not reproduced"


def relative_error(a, b) -> float:
    """max |a - b| / max |b| over all elements (max |a - b| where b is all zero)."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def per_seed(rows: Sequence[dict], value: str = "accuracy", **match) -> dict:
    """``{row["seed"]: row[value]}`` over the ``rows`` (one dict per run) whose fields equal
    ``match``: the per-seed values an ordering or threshold claim takes.
    ``per_seed(runs, model="mamba2", d_state=128)`` -> {0: 0.41, 1: 0.38, 2: 0.44}."""
    return {r["seed"]: r[value] for r in rows if all(r[k] == v for k, v in match.items())}


def _seeds(values: Mapping, claim: Claim, judged: bool) -> dict:
    if not isinstance(values, Mapping) or not values:
        raise ValueError(f"claim {claim.id!r}: give the values per seed, as {{seed: value}}")
    if judged and len(values) < MIN_SEEDS:
        raise ValueError(
            f"claim {claim.id!r}: judged on {len(values)} seed(s); an {claim.kind} claim needs "
            f"at least {MIN_SEEDS}"
        )
    return {int(s): v for s, v in values.items()}


def _fmt(x) -> str:
    if isinstance(x, bool) or isinstance(x, int):
        return str(x)
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2e}"


class ClaimBook:
    """The claims of one note and what was measured for each (see the module docstring)."""

    def __init__(self, claims: Sequence[Claim]):
        ids = [c.id for c in claims]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"claim ids must be unique; repeated: {', '.join(dupes)}")
        self.claims = {c.id: c for c in claims}
        self.outcomes: dict[str, Outcome] = {}

    def _claim(self, claim_id: str, kind: str) -> Claim:
        if claim_id not in self.claims:
            raise KeyError(f"no claim {claim_id!r}; declared: {', '.join(self.claims)}")
        claim = self.claims[claim_id]
        if claim.kind != kind:
            raise ValueError(f"claim {claim_id!r} is declared {claim.kind!r}, checked as {kind!r}")
        return claim

    def _record(self, outcome: Outcome) -> Outcome:
        self.outcomes[outcome.claim.id] = outcome
        return outcome

    def identity(self, claim_id: str, a, b, tol: float = IDENTITY_TOL) -> Outcome:
        """Two computations of one thing: ``a`` and ``b`` (tensors or arrays of one shape) in
        float64 / complex128 with relative error <= ``tol``; integers (Python ints, integer
        tensors) must be equal."""
        claim = self._claim(claim_id, "identity")
        if isinstance(a, int) and isinstance(b, int):
            return self._record(
                Outcome(claim, f"{a:,} = {b:,}" if a == b else f"{a:,} vs {b:,}", a == b, "equal")
            )
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        if not a.is_floating_point() and not a.is_complex():
            return self._record(
                Outcome(
                    claim, "equal" if torch.equal(a, b) else "differ", torch.equal(a, b), "equal"
                )
            )
        wide = (torch.float64, torch.complex128)
        if a.dtype not in wide or b.dtype not in wide:
            raise ValueError(
                f"claim {claim_id!r}: identities are checked in float64 (or complex128); got "
                f"{a.dtype} and {b.dtype}"
            )
        if tol > IDENTITY_TOL:
            raise ValueError(
                f"claim {claim_id!r}: an identity's tolerance is at most "
                f"{IDENTITY_TOL:g}; got {tol:g}"
            )
        err = relative_error(a, b)
        return self._record(
            Outcome(claim, f"rel. err {_fmt(err)}", err <= tol, f"rel. err <= {tol:g}")
        )

    def ordering(
        self,
        claim_id: str,
        better: Mapping,
        worse: Mapping,
        *,
        higher_is_better: bool = True,
        judged: bool = True,
    ) -> Outcome:
        """``better[seed]`` beats ``worse[seed]`` on every seed (the same seeds on both sides):
        greater when ``higher_is_better`` (accuracy), smaller otherwise (loss)."""
        claim = self._claim(claim_id, "ordering")
        better, worse = _seeds(better, claim, judged), _seeds(worse, claim, judged)
        if better.keys() != worse.keys():
            raise ValueError(
                f"claim {claim_id!r}: both sides need the same seeds; got "
                f"{sorted(better)} and {sorted(worse)}"
            )
        wins = [
            (better[s] > worse[s]) if higher_is_better else (better[s] < worse[s]) for s in better
        ]
        per_seed = {s: [float(better[s]), float(worse[s])] for s in better}
        ours = "; ".join(f"{_fmt(a)} vs {_fmt(b)}" for a, b in per_seed.values())
        ours += f" ({sum(wins)}/{len(wins)} seeds)"
        rule = "A > B" if higher_is_better else "A < B"
        return self._record(
            Outcome(claim, ours, all(wins) if judged else None, f"{rule} on every seed", per_seed)
        )

    def threshold(
        self,
        claim_id: str,
        values: Mapping,
        *,
        at_least: float | None = None,
        at_most: float | None = None,
        judged: bool = True,
    ) -> Outcome:
        """Every seed's value is >= ``at_least`` and/or <= ``at_most``."""
        claim = self._claim(claim_id, "threshold")
        if at_least is None and at_most is None:
            raise ValueError(f"claim {claim_id!r}: give at_least, at_most or both")
        values = _seeds(values, claim, judged)
        ok = [
            (at_least is None or v >= at_least) and (at_most is None or v <= at_most)
            for v in values.values()
        ]
        bound = " and ".join(
            b
            for b in (
                at_least is not None and f">= {at_least:g}",
                at_most is not None and f"<= {at_most:g}",
            )
            if b
        )
        ours = ", ".join(_fmt(v) for v in values.values()) + f" ({sum(ok)}/{len(ok)} seeds)"
        return self._record(
            Outcome(
                claim,
                ours,
                all(ok) if judged else None,
                bound,
                {s: float(v) for s, v in values.items()},
            )
        )

    def cite(self, claim_id: str, note: str = "") -> Outcome:
        """A number this machine cannot reproduce: recorded with its source, never as ours.
        ``note`` says why (one line)."""
        claim = self._claim(claim_id, "cited")
        return self._record(Outcome(claim, "–", None, "–", note=note))

    def table(self) -> str:
        """The claims as a markdown table, in declaration order; a claim not checked yet says so."""
        rows = [
            "| claim | paper, where | kind | paper's value | ours | rule | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for claim in self.claims.values():
            o = self.outcomes.get(claim.id)
            cells = [
                f"**{claim.id}**: {claim.statement}",
                f"{claim.paper}, {claim.where}",
                claim.kind,
                claim.paper_value or "(in words)",
                o.ours if o else "–",
                o.bound if o else "–",
                o.verdict if o else "NOT CHECKED",
            ]
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return "\n".join(rows)

    def records(self) -> list[dict]:
        """Every claim with its outcome as plain JSON values (``outcome`` None if never checked)."""
        out = []
        for claim in self.claims.values():
            o = self.outcomes.get(claim.id)
            rec = asdict(claim)
            rec["outcome"] = (
                None
                if o is None
                else {
                    "ours": o.ours,
                    "passed": o.passed,
                    "bound": o.bound,
                    "verdict": o.verdict,
                    "per_seed": {str(k): v for k, v in o.per_seed.items()},
                    "note": o.note,
                }
            )
            out.append(rec)
        return out

    def save(self, path) -> None:
        """Write :meth:`records` as JSON (atomically)."""
        write_json(path, self.records())

    def not_reproduced(self) -> list[str]:
        """The ordering / threshold claims judged at this size that did not hold on every seed."""
        return [
            i for i, o in self.outcomes.items() if o.passed is False and o.claim.kind != "identity"
        ]

    def verify(self) -> list[str]:
        """Raise :class:`ClaimsFailed` naming every identity that failed and every claim never
        checked; otherwise return :meth:`not_reproduced` (results, not errors: the table shows each
        seed) and print one line naming them."""
        failed = [
            i for i, o in self.outcomes.items() if o.passed is False and o.claim.kind == "identity"
        ]
        missing = [i for i in self.claims if i not in self.outcomes]
        if failed or missing:
            parts = []
            if failed:
                parts.append("failed: " + ", ".join(failed))
            if missing:
                parts.append("never checked: " + ", ".join(missing))
            raise ClaimsFailed("; ".join(parts))
        missed = self.not_reproduced()
        if missed:
            print(
                "not reproduced at this recipe's size (every seed in the table): "
                + ", ".join(missed)
            )
        return missed
