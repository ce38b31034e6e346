"""Every built-in exercises the forced preemptions it declares: each ``preempt_at_steps``
entry of each request fires (the request is running at that step) in the parent's dry run
of the schedule, at the scenario's own ``decode_context_parallel_size``, at W = 2, and at
W = 4 (the quick start's ``run dsv41-hybrid --decode-context-parallel-size 4``). An entry
that does not fire is what ``dcpsim run`` prints as ``dcpsim: note: ...: preempt_at_steps N
never fires``: the preemption the scenario is there for is not exercised at all.

The schedule moves with W (a sharded group's manager block is B * W tokens, so the pool's
pressure preempts and readmits at other steps), so a step chosen at one W can miss at
another; and the requests stamped from one ``count`` share their steps, so every one of
them must be running at each.

Every built-in's own W is a valid size, and so are 2 and 4, with two explicit cases:

* ``glm-pcp2-dcp2`` (TP 1 x PCP 2, DCP 2) keeps its PCP: W = 2 is its own size, and at W = 4
  the default TP is 2, so that DCP spans the TP x PCP grid; ``with_overrides`` refuses a size
  that is not valid (exit 2 in ``run``), which fails here rather than being skipped.
* ``gqa-pcp2-heads`` (TP 1 x PCP 2, DCP 2, 8 KV heads) states a head layout that is admissible only
  while DCP spans the PCP axis: at W = 4 (TP 2) its DCP group gathers the queries of two TP ranks
  over 4 KV heads each, which the head rule refuses (semantics section 12); that size alone is
  left out, and only for that reason.
* a P/D scenario (``pd-dsv3``, a ``[disaggregated]`` table): ``run`` refuses
  ``--decode-context-parallel-size`` (its instances take ``--prefill-dcp`` and
  ``--decode-dcp``) and its P/D run prints no note. Its ``[config]`` view, which ``matrix``
  and the selftest baselines run, is checked like any other; its two instances at the sizes
  the table gives them: the prefill instance drops every ``preempt_at_steps`` (its requests
  end at their first token), and the decode instance schedules with ``LoadedScheduler``
  (prompts arrive with their KV), so it is dry-run with that scheduler
  (``harness.pd_job.instance_scheduler``).
"""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.cli import main
from dcpsim.errors import ConfigError
from dcpsim.harness.dry_run import dry_run
from dcpsim.harness.pd_job import instance_scheduler
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.pd import instance_scenario
from dcpsim.scenarios.registry import builtin_scenario_names

EXTRA_SIZES = (2, 4)
"""W = 2 beside each built-in's own W, and the quick start's W = 4."""


def never_fires(scenario, where: str, role: str | None = None) -> list[str]:
    found = dry_run(scenario, scheduler_class=instance_scheduler(role)) if role else dry_run(scenario)
    return [
        f"{where}: request {rid!r}: preempt_at_steps {step} never fires (the schedule has {found.steps} steps)"
        for rid, step in found.unfired_preemptions
    ]


@pytest.mark.parametrize("name", builtin_scenario_names())
def test_every_declared_preemption_fires_at_its_own_w_at_2_and_at_4(name, capsys):
    scenario = load_scenario(name)
    own = scenario.config.decode_context_parallel_size
    sizes = sorted({own, *EXTRA_SIZES})
    problems = []
    for W in sizes:
        try:
            sized = scenario.with_overrides(ScenarioOverrides(decode_context_parallel_size=W))
        except ConfigError as exc:  # a stated head layout refused at another size (and only that)
            assert W != own and "KV heads do not follow its queries" in str(exc), exc
            continue
        assert sized.config.decode_context_parallel_size == W
        assert sized.config.prefill_context_parallel_size == scenario.config.prefill_context_parallel_size
        problems += never_fires(sized, f"W = {W}{' (its own)' if W == own else ''}")
    if scenario.disaggregated is not None:
        assert main(["run", name, "--decode-context-parallel-size", "2"]) == 2
        assert "take --prefill-dcp and --decode-dcp" in capsys.readouterr().err
        prefill = instance_scenario(scenario, "prefill")
        assert all(not r.preempt_at_steps for r in prefill.requests)
        decode = instance_scenario(scenario, "decode")
        problems += never_fires(decode, f"decode instance W = {decode.config.decode_context_parallel_size}", role="decode")
    assert not problems, "\n".join(problems)


def test_the_check_fails_for_a_step_at_which_the_request_is_not_running():
    """The check can fail: dsv3's long-doc (arriving at step 3, preempted at 12) asked to be
    preempted also at step 2, before it arrives, and at a step past the schedule's end."""
    scenario = load_scenario("dsv3")
    doc = next(r for r in scenario.requests if r.request_id == "long-doc")
    assert doc.arrival_step == 3 and doc.preempt_at_steps == (12,)
    steps = (2, 12, 1000)
    requests = tuple(dataclasses.replace(r, preempt_at_steps=steps) if r is doc else r for r in scenario.requests)
    moved = dataclasses.replace(scenario, requests=requests)
    length = dry_run(moved).steps
    assert never_fires(moved, "W = 2") == [
        f"W = 2: request 'long-doc': preempt_at_steps {step} never fires (the schedule has {length} steps)" for step in (2, 1000)
    ]
