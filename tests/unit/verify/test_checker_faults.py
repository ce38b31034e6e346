"""Every fault of the registry (``dcpsim.engine.faults.FAULTS``) must fail a run of the
checker, on the built-ins and in the configs it declares, wherever it can show."""

from __future__ import annotations

import pytest

from dcpsim.campaigns.selftest_options import apply_options
from dcpsim.engine.faults import FAULTS
from dcpsim.errors import ConfigError
from dcpsim.harness.collectives import CollectiveTimeout
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names
from support.helpers import geometries, run


def _fault_names():
    return sorted(n for n in FAULTS if n != "none")


def _configured(sc, options):
    """Apply fault run options (scenario overrides, SimConfig fields, Job options), as
    selftest does; the Job options are returned."""
    return apply_options(sc, options)


def test_the_registry_holds_faults():
    assert len(_fault_names()) >= 10 and "none" in FAULTS


@pytest.mark.slow
@pytest.mark.parametrize("fault", _fault_names())
def test_every_registered_fault_is_caught(fault):
    """Each fault of the engine's registry, on the built-ins it declares (default dsv3 and
    dsv41-hybrid) in the configs it declares, wherever it can show, must fail the run."""
    f = FAULTS[fault]
    caught = 0
    declared = f.scenarios
    first = declared or ("dsv3", "dsv41-hybrid")
    # a fault that cannot show on the two reference scenarios: the first small built-in where it can
    rest = [] if declared else [n for n in builtin_scenario_names() if n not in first and "256k" not in n]
    names = list(first) + rest
    for name in names:
        if caught and name in rest:
            break
        for config in f.configs:
            options = {**config, **f.needs}
            try:
                sc, job = _configured(load_scenario(name), options)
            except ConfigError:  # the config is invalid here (selftest skips it the same way)
                continue
            if not f.applies_to_scenario(sc, geometries(sc)):
                continue
            if f.expects == "hang":  # diverging collectives: a timeout naming the ranks, no verdict
                with pytest.raises(CollectiveTimeout, match="collective timeout: rank"):
                    run_jobs([Job.from_options(sc, inject=fault, in_process=True, timeout=2.0, **job)])
                caught += 1
                continue
            rep = run(sc, inject=fault, **job)
            assert not rep.passed and rep.failure is not None, f"{fault} on {name} {options} passed"
            caught += 1
    if not caught:
        pytest.skip(f"{fault} cannot show on {names}")
