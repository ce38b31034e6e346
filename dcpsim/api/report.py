"""``dcpsim.Report``: what ``dcpsim.run`` found, typed for a test to assert on.

A ``Report`` is read-only. ``passed``; ``failure`` (a ``Failure``: the kind, the request, the
group, the first bad index, where it was expected and what each rank holds there); ``ranks``
(a ``RankFigures`` per rank); ``text()``, the report ``dcpsim run`` prints; ``to_json()``, the
document ``dcpsim run --json`` prints (with its ``schema_version``, docs/report.schema.json);
``raise_for_failure()`` raises ``dcpsim.CheckFailed`` with the text report as its message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dcpsim.errors import CheckFailed
from dcpsim.harness.pd_report import PDReport
from dcpsim.verify.report import RunReport


@dataclass(frozen=True)
class Holding:
    """What one rank holds at the slot where the expected owner must hold the bad index."""

    rank: int
    slot: int
    index: int
    """The index the entry there claims (-1: never written)."""
    writer: str | None
    """The request whose entry it is."""
    step: int
    content: int
    found_at: tuple[int, ...] = ()
    """Slots of this rank whose entry claims the bad index for the request."""


@dataclass(frozen=True)
class Failure:
    """The first failure of a run (``dcpsim.verify.report.Failure``, typed)."""

    kind: str
    """A ``FailureKind`` value: ``wrong-content``, ``reassembly``, ``attention-mismatch``, ..."""
    step: int
    message: str
    request: str | None = None
    group: str | None = None
    index_kind: str = "position"
    """What ``first_bad_index`` counts: ``position`` (a token) or ``record`` (a compressed state)."""
    first_bad_index: int | None = None
    expected_owner: int | str | None = None
    """The rank that must hold the index, or ``"all"`` for a replicated group."""
    expected_slot: int | None = None
    holdings: tuple[Holding, ...] = ()
    further_bad: int = 0
    """Bad indices after the first."""
    instance: str | None = None
    """A P/D run: the instance (``prefill``, ``decode``) that failed; None for the transfer between
    them (a prefill block's release, a completion notice)."""


@dataclass(frozen=True)
class RankFigures:
    """One rank's figures: its memory, CPU time, KV stores and traffic."""

    rank: int
    peak_rss_mb: float
    kv_store_mb: float
    bytes_sent: int
    cpu_seconds: float | None = None
    instance: str | None = None
    """A P/D run: the instance the rank belongs to."""


@dataclass(frozen=True)
class Report:
    """A run's verdict and figures; ``to_json()`` is ``dcpsim run --json``'s document."""

    scenario: str
    passed: bool
    failure: Failure | None
    ranks: tuple[RankFigures, ...]
    steps: int
    """Scheduler steps (a P/D run: the decode instance's)."""
    verified_indices: int
    notes: tuple[str, ...] = ()
    """What ``dcpsim run`` would have said on stderr: a CPU warning, a note about the scenario."""
    source: RunReport | PDReport | None = field(default=None, repr=False, compare=False)
    """The harness's report, for every figure this class does not name."""

    @classmethod
    def of(cls, report: RunReport | PDReport, notes: tuple[str, ...] = ()) -> Report:
        if isinstance(report, PDReport):
            parts = (("prefill", report.prefill), ("decode", report.decode))
            # in the order of PDReport.failure: the transfer's (block release, notices) between the
            # instances, the page tails the decode instance's
            failures = (
                ("prefill", report.prefill.failure),
                (None, report.transfer_failure),
                ("decode", report.decode.failure),
                ("decode", report.page_tail_failure),
            )
            failed = next(((role, f) for role, f in failures if f is not None), (None, None))
            return cls(
                scenario=report.scenario,
                passed=report.passed,
                failure=_failure(*failed),
                ranks=tuple(_rank(r, role) for role, part in parts for r in part.ranks),
                steps=report.decode.steps,
                verified_indices=sum(part.verified_indices for _, part in parts),
                notes=tuple(notes),
                source=report,
            )
        return cls(
            scenario=report.scenario,
            passed=report.passed,
            failure=_failure(None, report.failure),
            ranks=tuple(_rank(r) for r in report.ranks),
            steps=report.steps,
            verified_indices=report.verified_indices,
            notes=tuple(notes),
            source=report,
        )

    def text(self) -> str:
        """The report ``dcpsim run`` prints."""
        return self.source.text()

    def to_dict(self) -> dict:
        """``to_json()`` as a dict."""
        return json.loads(self.to_json())

    def to_json(self) -> str:
        """The document ``dcpsim run --json`` prints, ``schema_version`` first."""
        return self.source.to_json()

    def raise_for_failure(self) -> Report:
        """Raise ``dcpsim.CheckFailed`` (its message the text report) unless the run passed;
        the report itself when it did."""
        if not self.passed:
            raise CheckFailed(self.text(), self)
        return self


def _failure(instance: str | None, failure) -> Failure | None:
    if failure is None:
        return None
    holdings = tuple(Holding(h.rank, h.slot, h.index, h.writer, h.step, h.content, tuple(h.found_at)) for h in failure.holdings)
    return Failure(
        kind=str(failure.kind),
        step=failure.step,
        message=failure.message,
        request=failure.request_id,
        group=failure.group,
        index_kind=failure.index_kind,
        first_bad_index=failure.index,
        expected_owner=failure.expected_owner,
        expected_slot=failure.expected_slot,
        holdings=holdings,
        further_bad=failure.further_bad,
        instance=instance,
    )


def _rank(figures: dict, instance: str | None = None) -> RankFigures:
    return RankFigures(
        rank=figures["rank"],
        peak_rss_mb=figures["peak_rss_mb"],
        kv_store_mb=figures["kv_store_mb"],
        bytes_sent=figures.get("bytes_sent", 0),
        cpu_seconds=figures.get("cpu_seconds"),
        instance=instance,
    )
