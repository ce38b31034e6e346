"""A sample of the whole selftest's plan for ``tests/dist/test_selftest.py``: every fault
on real gloo worlds without the cross product of the broad faults and every built-in.

``dcpsim selftest`` runs each fault on every built-in where it applies (1,029 runs with the
56 engine faults and 8 P/D faults of December 2026); most of them are some twenty faults
of the write path, the local lengths and the merge that apply to every built-in, each
detected the same way thirty times. The sample keeps:

* every case of a fault that applies on at most ``NARROW`` built-ins (its point is where it
  applies: a replicated group, a draft, a PCP world, a ring);
* each broad fault on one built-in, spread so that every built-in where some fault applies
  runs at least one fault (a built-in not yet covered first, in registry order);
* the baselines of every built-in in its own config, and of every (built-in, config) a kept
  fault case runs in (the same config passes without the fault).

The broad faults' other built-ins: the in-process selftest on 14 built-ins
(``tests/unit/campaigns/test_selftest_campaign.py``, which runs every case of its plan but this
sample's) and the faults' own tests; the baselines
of other configs: the full matrix (``tests/matrix/test_matrix_full.py``, gloo)."""

from __future__ import annotations

from dcpsim.campaigns.selftest_plan import Plan

NARROW = 9
"""A fault applying on at most this many built-ins keeps all its cases."""


def sample_plan(plan: Plan, *, exclude: tuple[str, ...] = ()) -> Plan:
    """The sample of ``plan`` (a whole selftest's plan), without the faults ``exclude``."""
    faults = [n for n in plan.faults if n not in exclude]
    where: dict[str, list[str]] = {}  # fault -> its built-ins, in plan order
    for c in plan.cases:
        if not c.baseline and c.fault in faults and c.scenario not in where.setdefault(c.fault, []):
            where[c.fault].append(c.scenario)
    kept: set[tuple[str, str]] = {(f, s) for f, ss in where.items() if len(ss) <= NARROW for s in ss}
    order = list(dict.fromkeys(c.scenario for c in plan.cases))  # registry order
    covered = {s for _, s in kept}
    broad = [f for f in faults if len(where.get(f, ())) > NARROW]
    for f in broad:  # each broad fault once: on a built-in no fault covers yet, else on the least busy
        s = next((s for s in order if s in where[f] and s not in covered), None)
        s = s or min(where[f], key=lambda s: sum(1 for _, t in kept if t == s))
        kept.add((f, s))
        covered.add(s)
    for k, s in enumerate(s for s in order if s not in covered):  # the rest: a broad fault each, round robin
        able = [f for f in broad if s in where[f]]
        if able:
            kept.add((able[k % len(able)], s))
            covered.add(s)
    cases = [c for c in plan.cases if not c.baseline and (c.fault, c.scenario) in kept]
    configs = {(c.scenario, c.options) for c in cases}
    cases += [c for c in plan.cases if c.baseline and (c.options == () or (c.scenario, c.options) in configs)]
    rows = [r for r in plan.rows if r.fault not in exclude]
    return Plan(cases=cases, resolved=plan.resolved, rows=rows, skipped=[], faults=faults)
