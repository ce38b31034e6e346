"""The checker against two prefix-cache mistakes of the scheduler (``tests/support/scheduler_mutations.py``).

* ``register-before-written``: a hash unit made findable before the step writing its last
  position has run. ``prefix-preemption`` must fail under it.
* ``keep-key-on-reuse`` and its half-done form ``stale-index-entry``: a reallocated block
  still found under the prefix it held before. ``prefix-eviction`` must fail under both.

Each fails with ``wrong-content`` at a request that hit the prefix cache, with every rank
showing what attention would have read: nothing (never written), or a filler's KV.

The gap these two built-ins close, measured before they were added (each other built-in
under each mutation, in process, ``--dcp`` 1, 2, 3, 4 and 8, its own I and B):

* ``register-before-written``: every built-in passes at W = 2 (the default W of all of
  them). ``many-short`` fails at W = 1, 3, 4 and 8, by chance: a pool-pressure preemption
  cuts a prefill inside a unit and the request is recomputed through it; ``dsv3`` fails at
  W = 8.
* ``keep-key-on-reuse``: every built-in passes at W = 2, 3, 4 and 8; only ``llama-draft``
  fails, at W = 1.
* ``stale-index-entry``: ``many-short`` fails at W = 1, 2 and 3 (a request preempted under
  pressure asks again for its own prefix after its blocks went to others) and
  ``llama-draft`` at W = 1; every other built-in passes everywhere.

The tests below do not depend on that gap staying open.
"""

from __future__ import annotations

import pytest

from dcpsim.model.plan import EventKind
from dcpsim.verify.report import FailureKind
from support.helpers import builtin, run, scheduler
from support.scheduler_mutations import EVICTED_PREFIX_ASKED_AGAIN, PREEMPTED_INSIDE_UNIT, mutated, situations

CASES = [("register-before-written", "prefix-preemption", W) for W in (1, 2, 4)] + [
    (mutation, "prefix-eviction", W) for mutation in ("keep-key-on-reuse", "stale-index-entry") for W in (2, 4)
]

SITUATION = {"prefix-preemption": PREEMPTED_INSIDE_UNIT, "prefix-eviction": EVICTED_PREFIX_ASKED_AGAIN}


def hit_before(sc, step):
    """Requests admitted with a prefix-cache hit up to ``step`` (under the active mutation)."""
    out = set()
    for plan in scheduler(sc).plans():
        out |= {ev.request_id for ev in plan.events if ev.kind is EventKind.ADMITTED and ev.prefix_hit}
        if plan.step == step:
            return out
    raise AssertionError(f"no step {step}")


@pytest.mark.parametrize("mutation,name,W", CASES, ids=[f"{m}-{n}-W{w}" for m, n, w in CASES])
def test_the_mutation_fails_its_builtin(mutation, name, W):
    sc = builtin(name, W)
    with mutated(mutation):
        report = run(sc)
        assert not report.passed
        failure = report.failure
        assert failure.request_id in hit_before(sc, failure.step)
    assert failure.kind == FailureKind.WRONG_CONTENT, report.text()
    assert report.schedule["prefix_hit_tokens"] > 0
    assert [h.rank for h in failure.holdings] == list(range(W))
    owner = failure.holdings[0 if failure.expected_owner == "all" else failure.expected_owner]
    if name == "prefix-preemption":
        # the gap of a unit found too early: the owner's slot was never written
        assert owner.index == -1 and owner.writer is None, report.text()
    else:
        # the evicted prefix's block now holds a filler's KV
        assert owner.writer is not None and owner.writer.startswith("filler-"), report.text()
        assert owner.content != failure.expected_content


@pytest.mark.parametrize("name", ["prefix-preemption", "prefix-eviction"])
@pytest.mark.parametrize("W", [2, 4])
def test_the_reference_passes_and_meets_the_situation(name, W):
    sc = builtin(name, W)
    assert SITUATION[name] in situations(sc)
    report = run(sc)
    assert report.passed, report.text()
    assert report.schedule["finished"] == report.schedule["requests"]
    assert report.schedule["prefix_hit_tokens"] > 0


def test_the_situations_are_recognised_only_where_they_are():
    # prefix-sharing caches prefixes but never preempts inside a unit nor evicts a cached one
    assert situations(builtin("prefix-sharing", 2)) == set()
    assert situations(builtin("prefix-preemption", 2)) == {PREEMPTED_INSIDE_UNIT}
    assert situations(builtin("prefix-eviction", 2)) == {EVICTED_PREFIX_ASKED_AGAIN}


@pytest.mark.parametrize("mutation,name", [("register-before-written", "prefix-preemption"), ("keep-key-on-reuse", "prefix-eviction")])
def test_the_cli_exits_1_under_the_mutation_and_0_without(mutation, name, run_json):
    code, clean = run_json("run", name, "--dcp", "2", "--in-process")
    assert code == 0 and clean["passed"]
    with mutated(mutation):
        code, report = run_json("run", name, "--dcp", "2", "--in-process")
    assert code == 1 and not report["passed"]
    assert report["failure"]["kind"] == FailureKind.WRONG_CONTENT
