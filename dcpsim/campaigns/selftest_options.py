"""The run options of a selftest case: a fault's ``configs`` and ``needs`` (or a baseline's)
as one hashable key, applied to a built-in scenario, and named in its rows (``W=2 I=1``).

An option is a scenario override (``ScenarioOverrides``), a ``SimConfig`` field or a ``Job``
run option (``dcpsim.options``), in that order; the short names of ``OPTION_ALIASES``
(``W``, ``I``, ``B``, ``Bk``, ...) are accepted too.
"""

from __future__ import annotations

import dataclasses

from dcpsim.errors import ConfigError
from dcpsim.harness.job import RUN_OPTIONS
from dcpsim.model.config import SimConfig
from dcpsim.model.scenario import Scenario, ScenarioOverrides
from dcpsim.options import keys

OPTION_ALIASES = {
    "dcp": "decode_context_parallel_size",
    "W": "decode_context_parallel_size",
    "interleave": "cp_kv_cache_interleave_size",
    "I": "cp_kv_cache_interleave_size",
    "B": "block_size",
    "Bk": "kernel_block_size",
    "pcp": "prefill_context_parallel_size",
    "tp": "tensor_parallel_size",
}
_SHORT = {
    "prefill_context_parallel_size": "PCP",
    "tensor_parallel_size": "TP",
    "decode_context_parallel_size": "W",
    "cp_kv_cache_interleave_size": "I",
    "block_size": "B",
    "kernel_block_size": "Bk",
}


SCENARIO_KEYS = keys(ScenarioOverrides)
"""Run options that override the scenario (``Scenario.with_overrides``)."""
CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(SimConfig))
"""Run options that set a ``SimConfig`` field directly."""
JOB_KEYS = tuple(k for k in RUN_OPTIONS if k not in ("inject", "rank_failure"))
"""Run options of the ``Job`` (the attention check, the engine, the checks)."""


def canonical_options(options: dict) -> tuple[tuple[str, object], ...]:
    """Aliases resolved, sorted: a hashable key for one run config."""
    return tuple(sorted((OPTION_ALIASES.get(k, k), v) for k, v in options.items()))


class UnknownOption(ConfigError):
    """A fault asks for a run option nothing here knows (a declaration error)."""


def apply_options(base: Scenario, options) -> tuple[Scenario, dict]:
    """``base`` with the run options applied, and the ``Job`` options among them.

    An option is a scenario override (``ScenarioOverrides``), a ``SimConfig`` field or a
    ``Job`` option (in that order); anything else is a ``ConfigError``.
    """
    overrides, config, job = {}, {}, {}
    for key, value in dict(options).items():
        key = OPTION_ALIASES.get(key, key)
        if key in SCENARIO_KEYS:
            overrides[key] = value
        elif key in CONFIG_KEYS:
            config[key] = value
        elif key in JOB_KEYS:
            job[key] = value
        else:
            raise UnknownOption(
                f"unknown run option {key!r}: not a scenario override ({', '.join(SCENARIO_KEYS)}), "
                f"a SimConfig field or a Job option ({', '.join(sorted(JOB_KEYS))})"
            )
    scenario = base.with_overrides(ScenarioOverrides(**overrides)) if overrides else base
    if config:
        scenario = dataclasses.replace(scenario, config=dataclasses.replace(scenario.config, **config))
    return scenario, job


def config_text(scenario, options) -> str:
    """``W=2 I=1`` plus every other explicit option (``B=64 Bk=16 attention=True``)."""
    cfg = scenario.config
    parts = [f"W={cfg.decode_context_parallel_size}", f"I={cfg.cp_kv_cache_interleave_size}"]
    keys = {key for key, _ in options}
    if cfg.prefill_context_parallel_size > 1 and "prefill_context_parallel_size" not in keys:
        parts.append(f"PCP={cfg.prefill_context_parallel_size}")  # the scenario's own
    for key, value in options:
        if key in ("decode_context_parallel_size", "cp_kv_cache_interleave_size"):
            continue
        parts.append(f"{_SHORT.get(key, key)}={value}")
    return " ".join(parts)


def options_text(options) -> str:
    return " ".join(f"{_SHORT.get(k, k)}={v}" for k, v in options) or "(scenario's own)"
