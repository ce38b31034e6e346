"""Fixtures of the scheduler tests: the invariant auditor of ``tests/support/schedule_auditor.py``
and its workloads. Session-scoped, as they hold no state (so Hypothesis tests may use
them too)."""

from __future__ import annotations

import pytest

from support.schedule_auditor import Auditor, audit, mixed, prefix_scenario, pressure


@pytest.fixture(scope="session")
def auditor():
    """The ``Auditor`` class: ``auditor(sched)``, then ``feed`` every plan and ``finish``."""
    return Auditor


@pytest.fixture(scope="session", name="audit")
def audit_fixture():
    """``audit(sc, engine=None) -> (scheduler, auditor)``: the whole schedule, audited."""
    return audit


@pytest.fixture(scope="session", name="mixed")
def mixed_fixture():
    return mixed


@pytest.fixture(scope="session", name="prefix_scenario")
def prefix_scenario_fixture():
    return prefix_scenario


@pytest.fixture(scope="session", name="pressure")
def pressure_fixture():
    return pressure
