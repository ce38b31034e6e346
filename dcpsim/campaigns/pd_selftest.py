"""The P/D half of ``dcpsim selftest``: every P/D fault of ``pd_faults.PD_FAULTS`` is caught on
the P/D built-in, and the correct connector passes.

* A fault that shows only with PCP > 1 (``needs_pcp``, the stride-by-dcp matching) cannot
  run until a PCP runtime exists; its routes are judged instead (a *route audit*): for
  every prompt of the built-in, with the prefill instance at PCP = 2, the routes must
  deliver every position to its decode owner and local index exactly once
  (``model.connector.routes_cover``, the destination layout's own formulas).
* Every other fault runs a real P/D world (``harness.disagg.run_pd``) and must fail it.
* Baselines: the built-in as declared (NIXL), and through the re-sharding connector with
  interleaves that differ between the instances; plus the route audit of the correct
  connector.
"""

from __future__ import annotations

import dataclasses
import time

from dcpsim.campaigns.selftest import BASELINE, DETECTED, ERROR, FALSE_POSITIVE, MISSED, PASS, Row

PD_SCENARIO = "pd-dsv3"
RESHARDING = {"kv_connector": "resharding", "prefill": {"cp_kv_cache_interleave_size": 1},
              "decode": {"cp_kv_cache_interleave_size": 16}}
"""The re-sharding run: prefill I = 1, decode I = 16 (the interleaves differ)."""


def pd_fault_names() -> list[str]:
    from dcpsim.campaigns.pd_faults import PD_FAULTS

    return [n for n in PD_FAULTS if n != BASELINE]


def _scenario(kind: str):
    from dcpsim.scenarios.load import load_scenario

    scenario = load_scenario(PD_SCENARIO)
    if kind != "resharding":
        return scenario
    pd = scenario.disaggregated
    pd = dataclasses.replace(pd, kv_connector="resharding",
                             prefill=dataclasses.replace(pd.prefill, **RESHARDING["prefill"]),
                             decode=dataclasses.replace(pd.decode, **RESHARDING["decode"]))
    return dataclasses.replace(scenario, disaggregated=pd)


def _config(scenario) -> str:
    from dcpsim.scenarios.disagg import instance_layout

    parts = []
    for role in ("prefill", "decode"):
        lay = instance_layout(scenario, role)
        parts.append(f"{role[0].upper()}: W={lay.decode_context_parallel_size} I={lay.cp_kv_cache_interleave_size} "
                     f"PCP={lay.prefill_context_parallel_size}")
    return f"{scenario.disaggregated.kv_connector} " + " -> ".join(parts)


def route_audit(fault_name: str) -> Row:
    """The fault's (or the correct connector's) routes of every prompt, prefill at PCP = 2."""
    from dcpsim.campaigns.pd_faults import get_pd_fault
    from dcpsim.engine.connector import CONNECTORS
    from dcpsim.model.connector import routes_cover
    from dcpsim.scenarios.disagg import instance_layout

    start = time.perf_counter()
    scenario = _scenario("nixl")
    src = dataclasses.replace(instance_layout(scenario, "prefill"), prefill_context_parallel_size=2)
    dst = instance_layout(scenario, "decode")
    connector = get_pd_fault(fault_name).connector("nixl") or CONNECTORS["nixl"]()
    bad = [r.request_id for r in scenario.requests
           if not routes_cover(connector.routes(r.prompt_len, src, dst), r.prompt_len, src, dst)]
    config = (f"route audit: P: W={src.decode_context_parallel_size} PCP=2 I={src.cp_kv_cache_interleave_size} "
              f"-> D: W={dst.decode_context_parallel_size}")
    row = Row(fault_name, PD_SCENARIO, config, PASS, seconds=time.perf_counter() - start)
    if fault_name == BASELINE:
        row.outcome = FALSE_POSITIVE if bad else PASS
    else:
        row.outcome = DETECTED if bad else MISSED
    if bad:
        row.kind = "routes"
        row.report = (f"requests {', '.join(bad)}: some position does not reach its decode owner and local index "
                      "exactly once")
    return row


def run_case(fault_name: str, kind: str, *, timeout: float = 30.0, on_wait=None) -> Row:
    from dcpsim.harness.disagg import PDJob, run_pd

    scenario = _scenario(kind)
    start = time.perf_counter()
    row = Row(fault_name, PD_SCENARIO, _config(scenario), ERROR)
    try:
        report = run_pd(PDJob(scenario, inject=None if fault_name == BASELINE else fault_name),
                        timeout=timeout, on_wait=on_wait)
    except Exception as exc:  # noqa: BLE001 - an error row
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
        which = "prefill" if report.prefill.failure else "decode"
        row.report = f"{which} instance: {failure.lines()[0]}"
    return row


def run_pd_selftest(fault_names: list[str], *, timeout: float = 30.0, progress=None, on_wait=None) -> list[Row]:
    """Rows of the chosen P/D faults, then the P/D baselines."""
    from dcpsim.campaigns.pd_faults import get_pd_fault

    rows = []

    def add(row):
        rows.append(row)
        if progress:
            progress(row)

    for name in fault_names:
        fault = get_pd_fault(name)
        add(route_audit(name) if fault.needs_pcp else run_case(name, fault.kv_connector, timeout=timeout, on_wait=on_wait))
    add(route_audit(BASELINE))
    for kind in ("nixl", "resharding"):
        add(run_case(BASELINE, kind, timeout=timeout, on_wait=on_wait))
    return rows
