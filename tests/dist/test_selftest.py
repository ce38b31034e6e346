"""The selftest on real gloo worlds: every registered fault detected, the baselines passing,
the P/D half, and ``python -m dcpsim selftest`` end to end (the printed table, the exit code).

Until issue 29 one subprocess ran the whole selftest here: every fault on every built-in
where it applies (1,047 runs in December 2026, against 582 when it took 348 s). Its checks
are now two tests:

* ``test_every_fault_is_detected_on_real_gloo_worlds``: where each fault runs and which
  baselines run, read from the whole plan (no run), then a sample of that plan run in gloo
  worlds (``support.selftest_sample``: every case of a fault that applies on a few built-ins,
  each broad fault on one built-in, every built-in running a fault, the baselines of every
  built-in in its own config and of each fault's config) and the P/D faults; a broad fault's
  other built-ins are the in-process selftest's (``tests/unit/campaigns/test_selftest_campaign.py``,
  14 built-ins), the reference on every built-in in every config the full matrix's;
* ``test_selftest_command_prints_the_table_and_exits_0``: the command in a subprocess, on the
  PCP built-in with a fault that hangs (the one case the sample leaves to it) and a write fault.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dcpsim.campaigns.selftest import bug_class_legend, format_table
from dcpsim.campaigns.selftest_plan import BASELINE, DETECTED, PASS
from dcpsim.campaigns.selftest_run import plan_of, run_selftest
from dcpsim.cli.selftest import pd_bug_class_legend
from dcpsim.engine.faults import FAULTS, PD_FAULTS
from dcpsim.harness.world_options import WorldOptions
from dcpsim.scenarios.registry import builtin_scenario_names
from support.selftest_sample import sample_plan

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCENARIOS = ["dsv3", "dsv41-hybrid", "llama-draft"]
HANG = "pcp-gather-rank-local"
"""The fault that hangs its world (``Fault.expects == "hang"``): run by the command's test."""


def _table(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("fault ")) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip(), maxsplit=4))
    return rows


def _check_the_whole_plan(plan, pd_chosen) -> None:
    """Where each fault runs and which baselines run, in the whole selftest's plan."""
    assert [f for f, fault in FAULTS.items() if fault.expects == "hang"] == [HANG]
    assert set(pd_chosen) == set(PD_FAULTS) - {BASELINE}
    by_fault: dict[str, set] = {}
    for c in plan.cases:
        if not c.baseline:
            by_fault.setdefault(c.fault, set()).add((c.scenario, plan.resolved[(c.scenario, c.options)][2]))
    assert set(by_fault) == set(FAULTS) - {BASELINE} and not plan.rows, plan.rows  # every fault runs somewhere
    assert by_fault["merge-drops-dcp-replicated"] == {("eagle-draft-hit", "W=4 I=1"), ("llama-draft", "W=2 I=1")}
    assert {("dsv41-hybrid", "W=4 I=1"), ("llama-draft", "W=4 I=1")} <= by_fault["replicated-scaled-by-w"]
    # not llama-draft: its replicated draft keeps the hash block (the GCD) at B, where hashing per B is right
    assert {("dsv3", "W=2 I=1 B=16"), ("prefix-sharing", "W=2 I=1 B=16")} <= by_fault["prefix-hash-unit-B"]
    assert ("llama-draft", "W=2 I=1 B=16") not in by_fault["prefix-hash-unit-B"]
    assert ("compressed-prefix", "W=2 I=1") in by_fault["compressed-hit-drops-r"]
    assert {"dsv41-hybrid", "llama-draft"} <= {s for s, _ in by_fault["replicated-owner-only"]}
    assert "dsv41-hybrid" in {s for s, _ in by_fault["sliding-window-early-release"]}
    assert "dsv41-hybrid" in {s for s, _ in by_fault["ring-rejected-overwrite"]}
    assert {s for s, _ in by_fault[HANG]} == {"glm-pcp2-dcp2"}  # the command's test runs it there
    # at I = B with Bk < B; on the PCP built-in too, whose own config carries PCP=2
    kernel = {c for _, c in by_fault["kernel-virtual-block"]}
    assert "W=2 I=64 B=64 Bk=16" in kernel and all("I=64" in c and "Bk=16" in c for c in kernel), kernel
    # baselines: every scenario in every config a fault ran on it in (a config that changes nothing of
    # a scenario, such as a Mamba cache mode on a model without Mamba layers, is its baseline already)
    base = [(c.scenario, plan.resolved[(c.scenario, c.options)][2]) for c in plan.cases if c.baseline]
    assert {s for s, _ in base} == set(builtin_scenario_names())
    configs = {plan.resolved[(c.scenario, c.options)][2] for c in plan.cases if not c.baseline and c.scenario in SCENARIOS}
    here = {(s, c) for s, c in base if s in SCENARIOS}
    assert {(s, c) for s in SCENARIOS for c in configs} <= here
    used = {plan.resolved[(c.scenario, c.options)][2] for c in plan.cases if not c.baseline}
    assert {c for _, c in here} <= used, sorted({c for _, c in here} - used)
    # the legend names each fault's bug class (the command prints it for the faults asked for)
    legend = "\n".join(bug_class_legend(plan.faults) + pd_bug_class_legend(pd_chosen))
    assert all(fault.bug_class in legend for name, fault in {**FAULTS, **PD_FAULTS}.items() if name != BASELINE)


def test_every_fault_is_detected_on_real_gloo_worlds():
    """The whole plan (every fault, every built-in; dry-run in this process: about 25 s, so one
    test, not two on two xdist workers) places every fault and baseline; its sample
    (``support.selftest_sample``) and every P/D fault, in gloo worlds: each fault detected with
    its report's first line, every baseline passing."""
    plan, pd_chosen = plan_of(None, None)
    _check_the_whole_plan(plan, pd_chosen)
    sample = sample_plan(plan, exclude=(HANG,))
    assert len(sample.cases) < len(plan.cases) / 4, (len(sample.cases), len(plan.cases))
    result = run_selftest(sample, pd_chosen, world=WorldOptions(timeout=60))
    rows = result.rows
    assert result.passed, "\n".join(result.summary) + "\n" + format_table(rows)
    faults = [r for r in rows if r.fault != BASELINE]
    baselines = [r for r in rows if r.fault == BASELINE]
    assert {r.fault for r in faults} == (set(FAULTS) | set(PD_FAULTS)) - {BASELINE, HANG}
    # every built-in where some fault applies runs one; every built-in runs its baseline
    assert {r.scenario for r in faults} >= {c.scenario for c in plan.cases if not c.baseline}
    for r in faults:
        assert r.outcome == DETECTED, r
        assert re.match(r"((prefill|decode) instance: |kv transfer: )?FAIL at step \d+: ", r.report), r
    stride = [r for r in faults if r.fault == "nixl-stride-by-dcp"]  # a real run on a PCP prefill
    assert len(stride) == 1 and "PCP=2" in stride[0].config and stride[0].kind == "wrong-content", stride
    assert stride[0].report.startswith("decode instance: "), stride
    pd_baselines = [r for r in baselines if r.config.startswith(("nixl ", "resharding "))]
    assert len(pd_baselines) == 4 and all(r.outcome == PASS for r in pd_baselines), pd_baselines
    assert [r.scenario for r in pd_baselines] == ["pd-dsv3"] * 3 + ["pd-async-recycled"], pd_baselines  # PDFault.scenario's too
    # the worker's table is narrower than the metadata builder's (caught at step 0); a Mamba
    # group has no attention metadata, so there the long request overflows its row
    # (llama4-scout's long chunked-local prompt overflows its row in the step-0 writes too)
    narrow = [r for r in faults if r.fault == "replicated-scaled-by-w"]
    assert len(narrow) == len({(c.scenario, c.options) for c in plan.cases if c.fault == "replicated-scaled-by-w"}), narrow
    for r in narrow:
        kinds = ("block-table-overflow",) if r.scenario == "qwen3-next-hybrid" else ("attention-metadata", "block-table-overflow")
        assert r.kind in kinds and r.report.startswith("FAIL at step 0:"), r
    assert any(r.kind == "attention-metadata" for r in narrow), narrow
    kernel = [r for r in faults if r.fault == "kernel-virtual-block"]
    assert kernel and all("I=64" in r.config and "Bk=16" in r.config for r in kernel), kernel
    assert {r.scenario for r in baselines} == set(builtin_scenario_names())
    assert all(r.outcome == PASS for r in baselines), [r for r in baselines if r.outcome != PASS]
    # each fault's config passes without it on the same built-in
    ran = {(r.scenario, r.config) for r in baselines}
    missing = {(r.scenario, r.config) for r in faults if r.scenario != "pd-dsv3"} - ran
    # (the planner's skips, and the run's: an option set to what the engine takes anyway, lse_base=e)
    skipped = plan.skipped + sample.skipped
    skipped_same = {(s["scenario"]) for s in skipped if s["fault"] == BASELINE and s["reason"].startswith("the same run")}
    assert all(s in skipped_same for s, _ in missing), missing


def test_selftest_command_prints_the_table_and_exits_0():
    """``python -m dcpsim selftest`` in a subprocess: the hang fault (exit 3 of its world, the
    rank that skipped the collective named) and a write fault on glm-pcp2-dcp2, its baseline,
    the legend and the verdict line."""
    cmd = [sys.executable, "-m", "dcpsim", "selftest", "--timeout", "60", "--scenario", "glm-pcp2-dcp2"]
    cmd += ["--fault", HANG, "--fault", "interleave-off-by-one"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = _table(proc.stdout)
    faults = [r for r in rows if r[0] != "(baseline)"]
    baselines = [r for r in rows if r[0] == "(baseline)"]
    assert {r[0] for r in faults} == {HANG, "interleave-off-by-one"}, rows
    for r in faults:
        assert r[1] == "glm-pcp2-dcp2" and r[3] == "detected", r
        if r[0] == HANG:  # exit 3 naming the rank that skipped the collective
            assert r[4].startswith(
                "[collective-hang] RankFailureError: collective hang in a world of 2 ranks: rank 0 skipped a collective"
            ), r
        else:
            assert re.match(r"\[[a-z-]+\] FAIL at step \d+: ", r[4]), r
    assert baselines and all(r[1] == "glm-pcp2-dcp2" and r[3] == "pass" for r in baselines), baselines
    for name in (HANG, "interleave-off-by-one"):
        assert FAULTS[name].bug_class in proc.stdout
    assert "selftest PASSED" in proc.stdout.strip().splitlines()[-1]
