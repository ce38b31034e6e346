"""Retention faults: a sliding window released too early for the reads of the step that
releases it (bug class 44 of docs/dcp-semantics.md section 8; ``retention-at-read``)."""

from __future__ import annotations

from dcpsim.engine.faults.base import Fault
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.model.kinds import Retention


class ReleaseAtAllocationScheduler(Scheduler):
    """dcpsim's scheduler with vLLM's release timing: a running request's blocks that left its
    window (or its finished chunk) are released when the request's next step allocates
    (vLLM's ``remove_skipped_blocks`` inside ``allocate_slots``), from the tokens it has
    computed before that step, not right after the step that left them. With a right window
    the two free the same blocks (the committed length is the same); the reads of the step
    see the release."""

    def _schedule_running(self, budget, scheduled, events):
        for req in self.running:  # before the step's allocations, as vLLM's allocate_slots
            for m in self.managers:
                m.release_skipped(req.index, req.num_computed)
        return super()._schedule_running(budget, scheduled, events)

    def _settle(self, scheduled) -> None:
        """After the writes only the prefix cache registers: no release here."""
        if self.prefix_cache:
            for req, _, _ in scheduled:
                self.prefix_cache.register(req)


class SlidingWindowReleaseOneEarly(Fault):
    name = "sliding-window-release-one-early"
    bug_class = (
        "44. a sliding window released at the step's allocation one token early: the block of the oldest key "
        "the step's first query reads is freed before the step reads it"
    )
    description = (
        "the manager releases a request's out-of-window blocks when its next step allocates (as vLLM does) and "
        "starts the window one token late (positions below num_computed - sliding_window + 2, as if the step's "
        "first query were computed): that query finds the oldest key of its window in the null block, a key "
        "the next query no longer needs, so the check after the step passes"
    )

    def applies_to(self, geometries) -> bool:
        return any(g.retention is Retention.WINDOW for g in geometries)

    def make_scheduler(self, scenario, geometries, connector=None):
        return ReleaseAtAllocationScheduler(scenario, self, geometries, connector=connector)

    def first_needed_position(self, geometry, num_committed):
        if geometry.retention is Retention.WINDOW:  # the step's first query counted as computed
            return super().first_needed_position(geometry, num_committed + 1)
        return super().first_needed_position(geometry, num_committed)
