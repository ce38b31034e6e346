"""Disaggregated prefill/decode: the ``[disaggregated]`` table of a scenario.

```toml
[disaggregated]
kv_connector = "nixl"            # or "resharding"
# load_steps = 2                 # asynchronous loads over 2 steps (default 0: synchronous)
[disaggregated.prefill]          # the prefill instance
decode_context_parallel_size = 2
prefill_context_parallel_size = 1
# tensor_parallel_size           # default: as for a plain run (dcpsim.model.parallel)
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

PCP on the prefill instance (``instance_layout``): dcpsim's PCP runtime adds no KV shards
(docs section 12): the instance's KV lives on one DCP group of ``W`` ranks (the first DCP
group serves it; the others are replicas). As the connector's layout (``N = pcp * dcp``,
rank ``pcp_rank * dcp + dcp_rank``) that is ``pcp`` PCP ranks of ``W // pcp`` DCP ranks
each when ``W > 1`` (vLLM 0.33.0: DCP spans the PCP group, transfer rank = ``pcp_rank``),
and one shard (``N = 1``, served by rank 0) when ``W = 1`` (replicated PCP). Under NIXL
vLLM 0.33.0 accepts PCP + DCP only with ``W == pcp`` at TP 1, and never pairs replicated
PCP with a DCP-sharded peer; ``check_disaggregation`` refuses the rest.

Helix (``kv_cache_layout = "helix"`` in ``[config]``, docs section 15): the layout is the
decode instance's; the prefill instance always runs vLLM's layout (TensorRT-LLM's Helix is a
decode-side layout: prompts reach the decode ranks through the prefill-to-decode transfer).
An instance table takes no ``kv_cache_layout`` (an unknown field, exit 2), so a Helix prefill
instance cannot be asked for. Either connector carries the prompt to Helix's places
(``dcpsim.model.connector``): ``resharding`` position by position, ``nixl`` in whole blocks
(Helix's prompt layout is vLLM's with ``I = B``, which NIXL needs on both sides anyway).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.connector import InstanceLayout, check_block_matching
from dcpsim.model.parallel import default_tensor_parallel_size
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.model.specs import CircularBufferSpec, MambaSpec
from dcpsim.model.validate import is_int

KV_CONNECTORS = ("nixl", "resharding")
INSTANCE_KEYS = (
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
    "tensor_parallel_size",
    "cp_kv_cache_interleave_size",
    "block_size",
)
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Instance:
    """One instance's sizes; None: the scenario's (the interleave: see the module doc)."""

    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int | None = None
    block_size: int | None = None
    tensor_parallel_size: int | None = None
    """None: ``dcpsim.model.parallel.default_tensor_parallel_size``."""

    @property
    def world_size(self) -> int:
        """The instance's processes: ``pcp * tp``."""
        pcp, dcp = self.prefill_context_parallel_size, self.decode_context_parallel_size
        tp = self.tensor_parallel_size or default_tensor_parallel_size(pcp, dcp)
        return pcp * tp


@dataclass(frozen=True)
class Disaggregation:
    prefill: Instance
    decode: Instance
    kv_connector: str = "nixl"
    load_steps: int = 0
    """Steps the decode instance's asynchronous load of a prompt takes (``engine.async_load``);
    0: the prompt's KV is written before the step that admits the request."""

    @property
    def world_size(self) -> int:
        """Processes of a P/D run: both instances' ``pcp * tp`` ranks."""
        return self.prefill.world_size + self.decode.world_size

    def instance(self, role: str) -> Instance:
        return self.prefill if role == "prefill" else self.decode


def parse_disaggregated(table, add) -> Disaggregation | None:
    """The ``[disaggregated]`` table; ``add(path, message)`` reports each problem."""
    if not isinstance(table, dict):
        add("disaggregated", "must be a table with [disaggregated.prefill] and [disaggregated.decode]")
        return None
    before = []
    report = lambda path, msg: (before.append(1), add(path, msg))
    for key in table:
        if key not in ("kv_connector", "load_steps", *ROLES):
            report(f"disaggregated.{key}", "unknown field (known: kv_connector, load_steps, prefill, decode)")
    connector = table.get("kv_connector", "nixl")
    load_steps = table.get("load_steps", 0)
    if not is_int(load_steps) or load_steps < 0:
        report("disaggregated.load_steps", f"must be an integer >= 0, got {load_steps!r}")
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
    return Disaggregation(instances["prefill"], instances["decode"], connector, load_steps)


def smallest_block_size(layers) -> int | None:
    """The smallest block size of the attention layers (vLLM's NIXL interleave default)."""
    sizes = [s.block_size for s in layers.values() if not isinstance(s, (MambaSpec, CircularBufferSpec))]
    return min(sizes, default=None)


def instance_scenario(scenario, role: str):
    """The scenario one instance runs: its sizes applied, and for the prefill instance
    requests that end after the first output token (no draft tokens then)."""
    pd: Disaggregation = scenario.disaggregated
    inst = pd.instance(role)
    interleave = inst.cp_kv_cache_interleave_size
    if interleave is None:
        interleave = scenario.config.cp_kv_cache_interleave_size
        if pd.kv_connector == "nixl" and inst.decode_context_parallel_size > 1:
            # the instance's layers at its block size (W = 1 here: the interleave is not checked yet)
            layers = scenario.with_overrides(ScenarioOverrides(decode_context_parallel_size=1, block_size=inst.block_size)).layers
            interleave = smallest_block_size(layers) or interleave
    # every size at once: the interleave is checked against the instance's block size, not [config]'s
    out = scenario.with_overrides(
        ScenarioOverrides(
            decode_context_parallel_size=inst.decode_context_parallel_size,
            prefill_context_parallel_size=inst.prefill_context_parallel_size,
            tensor_parallel_size=inst.tensor_parallel_size,
            block_size=inst.block_size,
            cp_kv_cache_interleave_size=interleave,
            kv_cache_layout="vllm" if role == "prefill" else None,  # Helix is the decode instance's layout (module doc)
        )
    )
    out = dataclasses.replace(out, name=f"{scenario.name}[{role}]", disaggregated=None)
    if role == "prefill":
        out = dataclasses.replace(out, requests=tuple(dataclasses.replace(r, output_len=1, preempt_at_steps=()) for r in out.requests))
    return out


def instance_layout(scenario, role: str):
    """The layout of an instance's (one) sharded group, as the connector sees it
    (``model.connector.InstanceLayout``; imported here: loading a scenario needs no numpy):
    its ``W`` KV shards as ``pcp`` PCP ranks of ``W // pcp`` DCP ranks (one shard when
    ``W = 1``; see the module doc)."""
    sc = instance_scenario(scenario, role)
    inst = scenario.disaggregated.instance(role)
    w, pcp = inst.decode_context_parallel_size, inst.prefill_context_parallel_size
    if w == 1 or w % pcp:
        pcp = 1  # replicated PCP: one shard (W % pcp != 0 is refused by the size rules)
    return InstanceLayout(
        decode_context_parallel_size=w // pcp,
        cp_kv_cache_interleave_size=sc.config.cp_kv_cache_interleave_size,
        block_size=smallest_block_size(sc.layers) or 1,
        prefill_context_parallel_size=pcp,
        kv_cache_layout=sc.config.kv_cache_layout,
    )


def shard_ranks(scenario, role: str) -> list[int]:
    """The instance ranks holding the connector layout's shards, by shard rank: the first
    DCP group's members (``[0]`` when ``W = 1``)."""
    return instance_scenario(scenario, role).config.parallel_layout.dcp_groups()[0]


def check_disaggregation(scenario) -> None:
    """The connector's own rules (exit 2, naming the field): NIXL consumers have no PCP,
    a NIXL producer's PCP follows vLLM 0.33.0's rule, and NIXL matches whole blocks."""
    pd: Disaggregation = scenario.disaggregated
    if pd.kv_connector != "nixl":
        return
    if pd.decode.prefill_context_parallel_size > 1:
        raise ConfigError(
            "disaggregated.decode.prefill_context_parallel_size: the NIXL connector supports PCP on the "
            "prefill (kv_producer) instance only; the decode instance needs 1 (vLLM 0.33.0)"
        )
    check_nixl_pcp(pd)
    check_block_matching(
        instance_layout(scenario, "prefill"), instance_layout(scenario, "decode"), what="disaggregated (kv_connector = nixl)"
    )


def check_nixl_pcp(pd: Disaggregation) -> None:
    """vLLM 0.33.0's NixlConnector with a PCP producer: PCP + DCP only at TP 1 with DCP
    spanning the PCP group (``W == pcp``), and replicated PCP (``W = 1``) never paired with
    a DCP-sharded decode instance (exit 2 naming the rule)."""
    p = pd.prefill
    pcp, w = p.prefill_context_parallel_size, p.decode_context_parallel_size
    if pcp == 1:
        return
    tp = p.world_size // pcp
    if w > 1 and (tp != 1 or w != pcp):
        raise ConfigError(
            f"disaggregated.prefill: prefill_context_parallel_size {pcp} with decode_context_parallel_size {w} "
            f"and tensor_parallel_size {tp}: the NIXL connector takes PCP + DCP only at TP 1 with DCP spanning "
            "the full PCP group (decode_context_parallel_size == prefill_context_parallel_size, vLLM 0.33.0 "
            'NixlConnector); use kv_connector = "resharding" for other sizes'
        )
    if w == 1 and pd.decode.decode_context_parallel_size > 1:
        raise ConfigError(
            f"disaggregated.decode.decode_context_parallel_size {pd.decode.decode_context_parallel_size}: the "
            f"NIXL connector cannot pair replicated PCP (prefill PCP {pcp}, DCP 1) with a DCP-sharded decode "
            "instance (vLLM 0.33.0 NixlConnector); use decode_context_parallel_size = 1 or kv_connector = "
            '"resharding"'
        )
