"""``dcpsim.run``: one run, exactly as ``python -m dcpsim run`` runs it.

The scenario with its overrides (``ScenarioOverrides``), then a ``Job`` from the run options
(``Job.from_options``), then ``dcpsim.harness.launch``: the memory estimate, the parent's dry
run, a world of gloo processes (threads with ``in_process=True``), the merged report. The
keyword arguments are the run-option keys of the option tree (docs/architecture.md): the
flat name of each flag of ``dcpsim run`` (``decode_context_parallel_size``, ``verify``,
``attention_heads``, ``vllm_source``, ``timeout``, ...); the short ones (``dcp``, ``pcp``,
``tp``, ``interleave``) are vLLM's aliases. An unknown key is a ``ConfigError`` naming it.
"""

from __future__ import annotations

from pathlib import Path

from dcpsim.api.report import Report
from dcpsim.engine.choice import EngineChoice
from dcpsim.errors import ConfigError
from dcpsim.harness.launch import JOB_KEYS, SCENARIO_KEYS, check_pd_options, launch_options, launch_pd, write_trace
from dcpsim.harness.pd_report import PDReport
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.scenario import Scenario
from dcpsim.options import from_flat, keys

ALIASES = {
    "dcp": "decode_context_parallel_size",
    "pcp": "prefill_context_parallel_size",
    "tp": "tensor_parallel_size",
    "interleave": "cp_kv_cache_interleave_size",
}
"""The short names ``dcpsim.run`` takes, as the flags' aliases (``--dcp``, ...)."""

PD_KEYS = ("inject", "timeout", "deadline", *keys(EngineChoice))
"""The run options a P/D scenario (a ``[disaggregated]`` table) takes."""


def run(
    scenario: str | Path | Scenario,
    *,
    dcp: int | None = None,
    pcp: int | None = None,
    tp: int | None = None,
    interleave: int | None = None,
    block_size: int | None = None,
    engine: str = "reference",
    attention: bool = False,
    seed: int | None = None,
    in_process: bool = False,
    force: bool = False,
    on_wait=None,
    **config,
) -> Report:
    """Run ``scenario`` (a built-in name, a ``.toml`` path, or a ``Scenario``) and verify
    every write; the ``Report``, passed or not. ``force``: run even where the estimate of
    the run's memory says it does not fit (``--force``); ``on_wait(message)``: called when a
    world keeps the caller waiting. ``ConfigError`` for a bad option or scenario (nothing
    ran), ``HarnessError`` for a broken world (a rank crashed or hung)."""
    given = dict(
        decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp, tensor_parallel_size=tp,
        cp_kv_cache_interleave_size=interleave, block_size=block_size, seed=seed,
    )  # fmt: skip
    options = _options(given, dict(engine=engine, attention=attention, in_process=in_process), config)
    notes: list[str] = []
    resolved, report, trace = launch_options(scenario, options, force=force, say=notes.append, on_wait=on_wait)
    if report is None:  # a [disaggregated] table: a P/D world
        job_options = {k: v for k, v in options.items() if k in JOB_KEYS}
        report = _run_pd(resolved, options, job_options, force=force, say=notes.append, on_wait=on_wait)
        return Report.of(report, tuple(notes))
    if trace is not None:
        write_trace(trace, report, notes.append)
    return Report.of(report, tuple(notes))


def _options(given: dict, defaults: dict, config: dict) -> dict:
    """The run options by key: the named arguments given, ``config`` (a short name taken as
    its key); a ``ConfigError`` for a key the option tree does not have or one given twice."""
    options = {k: v for k, v in given.items() if v is not None}
    options.update({k: v for k, v in defaults.items() if v not in (False, "reference")})
    known = set(SCENARIO_KEYS) | set(JOB_KEYS)
    for name, value in config.items():
        key = ALIASES.get(name, name)
        if key not in known:
            raise ConfigError(f"dcpsim.run: unknown option {name!r}; the run options are: {', '.join(sorted(known | set(ALIASES)))}")
        if key in options:
            raise ConfigError(f"dcpsim.run: option {key!r} given twice")
        options[key] = value
    return options


def _run_pd(scenario: Scenario, options: dict, job_options: dict, *, force: bool, say, on_wait) -> PDReport:
    """A scenario with a ``[disaggregated]`` table: a prefill and a decode instance in one
    gloo world, as ``dcpsim run`` runs it; only ``PD_KEYS`` apply."""
    check_pd_options(options)
    others = sorted(k for k in job_options if k not in PD_KEYS)
    if others:
        raise ConfigError(f"{scenario.source}: {', '.join(others)} not supported for P/D runs yet")
    world = from_flat(WorldOptions, {k: v for k, v in job_options.items() if k in ("timeout", "deadline")})
    engine = from_flat(EngineChoice, {k: v for k, v in job_options.items() if k in keys(EngineChoice)})
    return launch_pd(scenario, inject=options.get("inject"), world=world, force=force, say=say, on_wait=on_wait, engine=engine)
