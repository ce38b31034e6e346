"""What went wrong in a world of ranks: each rank that did not return a result
(``RankFailure``), and the one story the parent tells of them (``RankFailureError``: the
primary failures first, a rank that skipped a collective named as such), plus the
parent's waiting message."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from dcpsim.errors import HarnessError
from dcpsim.plural import plural


@dataclass
class RankFailure:
    """One rank that did not return a result. ``exc_type`` is the exception's class
    name, or ``ProcessExit`` (died without reporting) or ``Killed`` (by the harness)."""

    rank: int
    step: int | None
    what: str
    exc_type: str
    message: str
    traceback: str
    primary: bool = False

    def where(self) -> str:
        return where_text((self.step, self.what))


class RankFailureError(HarnessError):
    """One or more ranks failed; ``.failures`` holds the details, primary ones first."""

    caller_heard = False
    """Whether the caller got anything of the world before it failed (an event or a rank's
    result): a world it heard from is never started again (``world.transient_rendezvous``)."""

    def __init__(self, message: str, failures: list[RankFailure]):
        super().__init__(message, failures)
        self.failures = failures

    def __str__(self) -> str:
        return self.args[0]


def exit_failure(rank, exitcode, progress) -> RankFailure:
    if exitcode is not None and exitcode < 0:
        how = f"killed by signal {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with code {exitcode}"
    return RankFailure(rank, *progress, "ProcessExit", f"{how} without reporting a result", "")


_COLLECTIVE = re.compile(r"gloo|connection (closed|reset)|timed? ?out|socket", re.I)


def is_collective_error(f: RankFailure) -> bool:
    """Did a collective (or the rendezvous) give up because of some other rank?"""
    return f.exc_type.startswith("Dist") or (f.exc_type == "RuntimeError" and bool(_COLLECTIVE.search(f.message)))


def _ran_ahead(failed: list[RankFailure], phase_order: tuple[str, ...]) -> list[RankFailure]:
    """Of ranks that all timed out in collectives at known phases, those furthest along
    when the others are behind them: they skipped a collective the others wait in."""
    if not phase_order or any(f.step is None or f.what not in phase_order for f in failed):
        return []
    at = {f.rank: (f.step, phase_order.index(f.what)) for f in failed}
    ahead = max(at.values())
    if all(v == ahead for v in at.values()):
        return []
    return [f for f in failed if at[f.rank] == ahead]


def failure_error(
    failed: list[RankFailure], killed: list[RankFailure], world_size: int, phase_order: tuple[str, ...] = ()
) -> RankFailureError:
    """Primary: ranks that failed on their own; if there are none, the ranks that hung
    while the others timed out in a collective; then the ranks that ran ahead past a
    collective the others timed out in (``_ran_ahead``); failing that, the first failure."""
    own = [f for f in failed if not is_collective_error(f)]
    ahead = [] if own or killed else _ran_ahead(failed, phase_order)
    primary = own or killed or ahead or failed[:1]
    for f in primary:
        f.primary = True
    secondary = [f for f in failed if not f.primary]
    killed = [f for f in killed if not f.primary]

    first = primary[0]
    rendezvous = any(f.step is None and f.what in ("", "rendezvous") for f in failed + killed)
    if ahead:
        behind = [f for f in failed if not f.primary]
        lines = [
            f"collective hang in a world of {plural(world_size, 'rank')}: "
            f"{'rank' if len(ahead) == 1 else 'ranks'} {', '.join(str(f.rank) for f in ahead)} skipped a "
            f"collective: ran ahead to {first.where()} while "
            + "; ".join(f"rank {f.rank} waited at {f.where()}" for f in behind)
            + "; every rank then timed out"
        ]
    else:
        lines = [
            f"{'rendezvous failed' if rendezvous else 'rank failure'} in a world of "
            f"{plural(world_size, 'rank')}: rank {first.rank} {first.exc_type}: "
            f"{first_line(first.message)}"
        ]
    for f in primary:
        lines.append(f"primary: rank {f.rank} at {f.where()}: {f.exc_type}: {f.message}")
        lines += ["    " + line for line in f.traceback.rstrip().splitlines()]
    for f in secondary:
        lines.append(f"secondary: rank {f.rank} at {f.where()}: {f.exc_type}: {first_line(f.message)}")
    for f in killed:
        lines.append(f"killed: rank {f.rank} at {f.where()}: {f.message}")
    return RankFailureError("\n".join(lines), primary + secondary + killed)


def where_text(progress) -> str:
    step, what = progress
    if step is None:
        return f"'{what}' (no step)" if what else "start (no progress yet)"
    return f"step {step} ({what})" if what else f"step {step}"


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def waiting_message(seconds: float, running: list[int], progress, world_size: int) -> str:
    """``waiting 5.0 s for 3 of 3 ranks: ranks 0, 1 at step 3 (verify); rank 2 at step 3 (write)``:
    how long since the last event (or the start), and where each rank still running is."""
    where: dict[str, list[int]] = {}
    for rank in running:
        where.setdefault(where_text(progress[rank]), []).append(rank)
    parts = [f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} at {at}" for at, ranks in where.items()]
    took = f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"
    return f"waiting {took} s for {len(running)} of {plural(world_size, 'rank')}: " + "; ".join(parts)
