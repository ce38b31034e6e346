"""The P/D half of ``dcpsim selftest``: every P/D fault of ``dcpsim.engine.faults.PD_FAULTS`` is caught on
the P/D built-in, and the correct connector passes.

* Every fault runs a real P/D world (``harness.pd.run_pd``) and must fail it; a fault
  that shows only with PCP > 1 (``needs_pcp``, the stride-by-dcp matching) runs with the
  prefill instance at PCP = 2 (``PCP_PREFILL``: W = PCP = 2 at TP 1, the one PCP + DCP
  shape vLLM 0.33.0's NIXL connector takes), where the decode instance's checker sees the
  wrong blocks as wrong content.
* Baselines: the built-in as declared (NIXL), with the PCP prefill, and through the
  re-sharding connector with interleaves that differ between the instances.
* A fault that needs another P/D built-in names it (``PDFault.scenario``: the asynchronous loads
  into recycled blocks of ``pd-async-recycled``), whose declared run is a baseline too.
"""

from __future__ import annotations

import dataclasses
import time

from dcpsim.campaigns.selftest_plan import BASELINE, DETECTED, ERROR, FALSE_POSITIVE, MISSED, PASS, Row
from dcpsim.engine.faults import PD_FAULTS, get_pd_fault
from dcpsim.harness.pd import run_pd
from dcpsim.harness.pd_job import PDJob
from dcpsim.harness.world_options import WorldOptions
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.pd import instance_layout

PD_SCENARIO = "pd-dsv3"
RESHARDING = {"kv_connector": "resharding", "prefill": {"cp_kv_cache_interleave_size": 1}, "decode": {"cp_kv_cache_interleave_size": 16}}
"""The re-sharding run: prefill I = 1, decode I = 16 (the interleaves differ)."""
PCP_PREFILL = {"prefill_context_parallel_size": 2, "decode_context_parallel_size": 2, "tensor_parallel_size": 1}
"""The ``nixl-pcp`` run: the built-in's NIXL transfer from a PCP = 2 prefill instance."""
KINDS = ("nixl", "nixl-pcp", "resharding")
OTHER_SCENARIOS = ("pd-async-recycled",)
"""The other P/D built-ins a fault runs on (``PDFault.scenario``), each a baseline as declared."""
PD_BASELINES = len(KINDS) + len(OTHER_SCENARIOS)
"""The baseline rows of a P/D selftest."""


def pd_fault_names() -> list[str]:
    return [n for n in PD_FAULTS if n != BASELINE]


def _scenario(kind: str, name: str = PD_SCENARIO):
    scenario = load_scenario(name)
    pd = scenario.disaggregated
    if kind == "nixl-pcp":
        pd = dataclasses.replace(pd, prefill=dataclasses.replace(pd.prefill, **PCP_PREFILL))
        return dataclasses.replace(scenario, disaggregated=pd)
    if kind != "resharding":
        return scenario
    pd = dataclasses.replace(
        pd,
        kv_connector="resharding",
        prefill=dataclasses.replace(pd.prefill, **RESHARDING["prefill"]),
        decode=dataclasses.replace(pd.decode, **RESHARDING["decode"]),
    )
    return dataclasses.replace(scenario, disaggregated=pd)


def _config(scenario) -> str:
    parts = []
    for role in ("prefill", "decode"):
        lay = instance_layout(scenario, role)
        inst = scenario.disaggregated.instance(role)
        parts.append(
            f"{role[0].upper()}: W={inst.decode_context_parallel_size} I={lay.cp_kv_cache_interleave_size} "
            f"PCP={inst.prefill_context_parallel_size}"
        )
    return f"{scenario.disaggregated.kv_connector} " + " -> ".join(parts)


def run_case(fault_name: str, kind: str, *, world: WorldOptions | None = None, on_wait=None, name: str = PD_SCENARIO) -> Row:
    scenario = _scenario(kind, name)
    start = time.perf_counter()
    row = Row(fault_name, name, _config(scenario), ERROR)
    try:
        report = run_pd(
            PDJob(scenario, inject=None if fault_name == BASELINE else fault_name), world=world or WorldOptions(), on_wait=on_wait
        )
    except Exception as exc:  # an error row
        row.report = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        row.seconds = time.perf_counter() - start
        return row
    row.seconds = report.wall_time_s
    if report.passed:
        row.outcome = PASS if fault_name == BASELINE else MISSED
    else:
        row.outcome = FALSE_POSITIVE if fault_name == BASELINE else DETECTED
        failure = report.failure
        row.kind = failure.kind
        which = "prefill" if report.prefill.failure else "kv transfer" if report.transfer_failure else "decode"
        row.report = f"{which}{'' if which == 'kv transfer' else ' instance'}: {failure.lines()[0]}"
    return row


def run_pd_selftest(fault_names: list[str], *, world: WorldOptions | None = None, progress=None, on_wait=None) -> list[Row]:
    """Rows of the chosen P/D faults, then the P/D baselines."""
    rows = []

    def add(row):
        rows.append(row)
        if progress:
            progress(row)

    for name in fault_names:
        fault = get_pd_fault(name)
        kind = "nixl-pcp" if fault.needs_pcp else fault.kv_connector
        add(run_case(name, kind, world=world, on_wait=on_wait, name=fault.scenario or PD_SCENARIO))
    for kind in KINDS:
        add(run_case(BASELINE, kind, world=world, on_wait=on_wait))
    for other in OTHER_SCENARIOS:
        add(run_case(BASELINE, "nixl", world=world, on_wait=on_wait, name=other))
    return rows
