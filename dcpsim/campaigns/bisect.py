"""``dcpsim engine bisect``: one scenario on every release of a real engine in a range.

Each release is fetched (cached, file-locked: ``dcpsim.engine.loading.fetch``) and the scenario
run under it as ``dcpsim run`` runs it (``dcpsim.api.run``), so each row is exactly the verdict
``run --engine E --E-source TREE`` gives there (``run`` returns the checker's report): ``pass``, ``fail`` (the failure kind and the first
bad position), ``refused`` (exit 2: the release cannot run the scenario, in its own words) or
``error`` (exit 3). The first release whose verdict differs from the one before it is where the
behaviour changed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from dcpsim.engine.loading.bindings import span
from dcpsim.engine.release_tables import RELEASE_TABLES
from dcpsim.errors import ConfigError, DcpsimError


@dataclass(frozen=True)
class ReleaseVerdict:
    release: str
    verdict: str
    """``pass``, ``fail``, ``refused`` (exit 2) or ``error`` (exit 3)."""
    exit_code: int
    kind: str | None = None
    """The failure kind (``fail``)."""
    where: str | None = None
    """The first bad position: ``step S, request R, position P`` (``fail``)."""
    message: str = ""
    """The failure's message, or the refusal's or error's first line."""
    seconds: float = 0.0

    def row(self) -> str:
        detail = " ".join(x for x in (f"[{self.kind}]" if self.kind else "", self.where or "", self.message) if x)
        return f"{self.release:<10} {self.verdict:<8} {detail}"


@dataclass(frozen=True)
class BisectReport:
    engine: str
    scenario: str
    rows: tuple[ReleaseVerdict, ...]

    @property
    def first_change(self) -> tuple[str, str, str] | None:
        """``(release, verdict before, verdict here)`` of the first release whose verdict
        differs from the one before it, or None when every release agrees."""
        for before, here in zip(self.rows, self.rows[1:]):
            if here.verdict != before.verdict or here.kind != before.kind:
                return (
                    here.release,
                    before.verdict + (f" [{before.kind}]" if before.kind else ""),
                    here.verdict + (f" [{here.kind}]" if here.kind else ""),
                )
        return None

    def text(self) -> str:
        label = RELEASE_TABLES[self.engine].label
        lines = [
            f"{self.scenario} under {label} {self.rows[0].release}..{self.rows[-1].release}:",
            f"{'release':<10} {'verdict':<8} detail",
        ]
        lines += [r.row() for r in self.rows]
        change = self.first_change
        if change is None:
            lines.append(f"every release: {self.rows[0].verdict}")
        else:
            lines.append(f"first change: {label} {change[0]} ({change[1]} -> {change[2]})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        change = self.first_change
        return dict(
            engine=self.engine,
            scenario=self.scenario,
            releases=[asdict(r) for r in self.rows],
            first_change=None if change is None else dict(release=change[0], before=change[1], after=change[2]),
        )


def _verdict(release: str, f) -> ReleaseVerdict:
    """A run's row: ``f`` its failure (the checker's ``Failure``), None for a pass."""
    if f is None:
        return ReleaseVerdict(release, "pass", 0)
    kind = getattr(f.kind, "value", f.kind)
    where = f"step {f.step}" + (f", request {f.request_id}" if f.request_id else "")
    if f.index is not None:
        where += f", {f.index_kind or 'position'} {f.index}"
    return ReleaseVerdict(release, "fail", 1, kind=kind, where=where, message=(f.message or "")[:300])


def release_range(engine: str, text: str) -> list[str]:
    """The known releases of ``engine`` from ``A`` to ``B`` (``A..B``, both included; ``A..`` to
    the newest, ``..B`` from the oldest); ``ConfigError`` naming an unknown release."""
    known = RELEASE_TABLES[engine].releases
    first, dots, last = text.partition("..")
    if not dots:
        raise ConfigError(f"--releases: expected A..B (e.g. {known[0]}..{known[-1]}), got {text!r}")
    first, last = first or known[0], last or known[-1]
    for r in (first, last):
        if r not in known:
            raise ConfigError(f"--releases: {r} is not a {RELEASE_TABLES[engine].label} release dcpsim knows ({', '.join(known)})")
    if known.index(first) > known.index(last):
        raise ConfigError(f"--releases: {first} comes after {last}")
    return list(span(known, first, last))


def bisect(scenario, engine: str, releases: list[str], *, options: dict, fetch, run, on_release=None) -> BisectReport:
    """Run ``scenario`` under each of ``releases``: ``fetch(requirement)`` gives a release's
    tree, ``run(scenario, **options)`` is ``dcpsim.run``; ``on_release(verdict)`` after each."""
    rows = []
    for release in releases:
        start = time.perf_counter()
        tree = fetch(f"{engine}=={release}")
        try:
            report = run(scenario, engine=engine, **{f"{engine}_source": str(tree)}, **options)
        except DcpsimError as exc:
            verdict = "refused" if exc.exit_code == 2 else "error"
            row = ReleaseVerdict(release, verdict, exc.exit_code, message=str(exc).splitlines()[0][:300])
        else:
            row = _verdict(release, report.failure)
        row = ReleaseVerdict(**{**asdict(row), "seconds": round(time.perf_counter() - start, 2)})
        rows.append(row)
        if on_release is not None:
            on_release(row)
    name = getattr(scenario, "name", None) or str(scenario)
    return BisectReport(engine, name, tuple(rows))
