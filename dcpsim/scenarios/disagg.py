"""Disaggregated prefill/decode: the ``[disaggregated]`` table of a scenario.

```toml
[disaggregated]
kv_connector = "nixl"            # or "resharding"
[disaggregated.prefill]          # the prefill instance
decode_context_parallel_size = 2
prefill_context_parallel_size = 1
# cp_kv_cache_interleave_size    # nixl: the smallest group block size when left out
# block_size = 64                # default: the scenario's
[disaggregated.decode]
decode_context_parallel_size = 4
```

Each instance is the scenario with its own sizes (``instance_scenario``): the prefill
instance computes every prompt (its requests stop after the first output token), the
decode instance gets the prompts' KV from the connector and decodes the rest.

``nixl`` is vLLM's NixlConnector: block-level matching (``dcpsim.model.connector``), so when
an instance with ``W > 1`` leaves ``cp_kv_cache_interleave_size`` out, it is the smallest
block size of the instance's KV-cache groups (``VllmConfig.adjust_dcp_kv_cache_interleave_size``
in vLLM 0.33.0; an explicit value takes priority there and breaks the matching,
vllm#54457, so dcpsim refuses it). ``resharding`` moves every position on its own and
takes any pair of layouts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.specs import CircularBufferSpec, MambaSpec
from dcpsim.model.validate import is_int

KV_CONNECTORS = ("nixl", "resharding")
INSTANCE_KEYS = ("decode_context_parallel_size", "prefill_context_parallel_size",
                 "cp_kv_cache_interleave_size", "block_size")
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Instance:
    """One instance's sizes; None: the scenario's (the interleave: see the module doc)."""

    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class Disaggregation:
    prefill: Instance
    decode: Instance
    kv_connector: str = "nixl"

    @property
    def world_size(self) -> int:
        """Processes of a P/D run: both instances' ``pcp * dcp`` ranks."""
        return sum(i.decode_context_parallel_size * i.prefill_context_parallel_size
                   for i in (self.prefill, self.decode))

    def instance(self, role: str) -> Instance:
        return self.prefill if role == "prefill" else self.decode


def parse_disaggregated(table, add) -> Disaggregation | None:
    """The ``[disaggregated]`` table; ``add(path, message)`` reports each problem."""
    if not isinstance(table, dict):
        add("disaggregated", "must be a table with [disaggregated.prefill] and [disaggregated.decode]")
        return None
    before = []
    report = lambda path, msg: (before.append(1), add(path, msg))  # noqa: E731
    for key in table:
        if key not in ("kv_connector", *ROLES):
            report(f"disaggregated.{key}", "unknown field (known: kv_connector, prefill, decode)")
    connector = table.get("kv_connector", "nixl")
    if connector not in KV_CONNECTORS:
        report("disaggregated.kv_connector", f"must be one of {', '.join(KV_CONNECTORS)}, got {connector!r}")
    instances = {}
    for role in ROLES:
        sub = table.get(role)
        path = f"disaggregated.{role}"
        if not isinstance(sub, dict):
            report(path, f"needs a [{path}] table")
            continue
        values = {}
        for key, value in sub.items():
            if key not in INSTANCE_KEYS:
                report(f"{path}.{key}", f"unknown field (known: {', '.join(INSTANCE_KEYS)})")
            elif not is_int(value) or value < 1:
                report(f"{path}.{key}", f"must be an integer >= 1, got {value!r}")
            else:
                values[key] = value
        instances[role] = Instance(**values)
    if before:
        return None
    return Disaggregation(instances["prefill"], instances["decode"], connector)


def smallest_block_size(layers) -> int | None:
    """The smallest block size of the attention layers (vLLM's NIXL interleave default)."""
    sizes = [s.block_size for s in layers.values() if not isinstance(s, (MambaSpec, CircularBufferSpec))]
    return min(sizes, default=None)


def instance_scenario(scenario, role: str):
    """The scenario one instance runs: its sizes applied, and for the prefill instance
    requests that end after the first output token (no draft tokens then)."""
    pd: Disaggregation = scenario.disaggregated
    inst = pd.instance(role)
    sized = scenario.with_overrides(decode_context_parallel_size=inst.decode_context_parallel_size,
                                    block_size=inst.block_size)
    interleave = inst.cp_kv_cache_interleave_size
    if interleave is None:
        interleave = scenario.config.cp_kv_cache_interleave_size
        if pd.kv_connector == "nixl" and inst.decode_context_parallel_size > 1:
            interleave = smallest_block_size(sized.layers) or interleave
    out = sized.with_overrides(cp_kv_cache_interleave_size=interleave)
    out = dataclasses.replace(out, name=f"{scenario.name}[{role}]", disaggregated=None)
    if role == "prefill":
        out = dataclasses.replace(out, requests=tuple(
            dataclasses.replace(r, output_len=1, preempt_at_steps=()) for r in out.requests))
    return out


def instance_layout(scenario, role: str):
    """The layout of an instance's (one) sharded group, as the connector sees it
    (``model.connector.InstanceLayout``; imported here: loading a scenario needs no numpy)."""
    from dcpsim.model.connector import InstanceLayout

    sc = instance_scenario(scenario, role)
    inst = scenario.disaggregated.instance(role)
    return InstanceLayout(decode_context_parallel_size=inst.decode_context_parallel_size,
                          cp_kv_cache_interleave_size=sc.config.cp_kv_cache_interleave_size,
                          block_size=smallest_block_size(sc.layers) or 1,
                          prefill_context_parallel_size=inst.prefill_context_parallel_size)


def check_disaggregation(scenario) -> None:
    """The connector's own rules (exit 2, naming the field): NIXL consumers have no PCP,
    and NIXL matches whole blocks."""
    from dcpsim.model.connector import check_block_matching

    pd: Disaggregation = scenario.disaggregated
    if pd.kv_connector != "nixl":
        return
    if pd.decode.prefill_context_parallel_size > 1:
        raise ConfigError(
            "disaggregated.decode.prefill_context_parallel_size: the NIXL connector supports PCP on the "
            "prefill (kv_producer) instance only; the decode instance needs 1 (vLLM 0.33.0)")
    check_block_matching(instance_layout(scenario, "prefill"), instance_layout(scenario, "decode"),
                         what="disaggregated (kv_connector = nixl)")
