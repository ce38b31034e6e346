"""``Fault``: the reference engine plus catalogue metadata; a fault subclass changes one decision.

The families (one module each) hold the catalogue's faults; ``dcpsim.engine.faults.registry``
maps their names to one instance each.
"""

from __future__ import annotations

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Storage


class Fault(ReferenceEngine):
    """The correct engine with catalogue metadata. A fault subclass overrides one
    ``Engine`` decision to reproduce one bug.

    Where ``selftest`` runs a fault (declarative): on every built-in scenario in
    ``scenarios`` (None: all of them), once per run config in ``configs`` with ``needs``
    merged in, wherever ``applies_to_scenario`` holds for the scenario so configured.
    Run options are ``Scenario.with_overrides`` arguments
    (``decode_context_parallel_size``, ``cp_kv_cache_interleave_size``, ``block_size``,
    ``kernel_block_size``, ...), ``SimConfig`` fields, or ``Job`` fields (e.g. ``attention``).
    """

    name = "none"
    bug_class = ""
    """The bug class of docs/dcp-semantics.md section 8 that the fault stands for."""
    description = "no fault: the correct engine"
    needs: dict = {}
    """Run options without which the bug cannot show at all, e.g.
    ``{"kernel_block_size": 16}`` or ``{"attention": True}``."""
    configs: tuple[dict, ...] = ({},)
    """Run configs (overrides of a scenario's own config) selftest runs the fault in."""
    scenarios: tuple[str, ...] | None = None
    """Built-in scenarios selftest runs the fault on; None: every one where it applies."""
    layouts: tuple[str, ...] | None = None
    """The ``kv_cache_layout``s the bug lives in (None: every one). A fault of one of vLLM's
    formulas that the Helix layout does not use (``local_seq_lens``, per-position capacity) names
    ``("vllm",)``; selftest runs it on no Helix scenario."""
    expects: str = "check"
    """How the fault shows: ``check`` (a failed check, exit 1) or ``hang`` (the ranks'
    collectives diverge and the harness reports a collective hang naming the rank, exit 3)."""

    def applies_to(self, geometries: list[GroupGeometry]) -> bool:
        """Whether the bug can show on a scenario with these (reference) group geometries."""
        return True

    def applies_to_scenario(self, scenario, geometries: list[GroupGeometry]) -> bool:
        """Whether the bug can show on this scenario (its config and workload too)."""
        return self.applies_to(geometries)


def fault_applies(fault: Fault, scenario, geometries: list[GroupGeometry]) -> bool:
    """Whether selftest runs ``fault`` on ``scenario``: its layout is one of the fault's, and
    the fault applies to the scenario so configured."""
    layout = scenario.config.kv_cache_layout
    return (fault.layouts is None or layout in fault.layouts) and fault.applies_to_scenario(scenario, geometries)


def is_replicated_paged(g: GroupGeometry) -> bool:
    """A replicated group with more than one rank that is not a ring (width 1 anyway)."""
    return g.replicated and g.dcp_size > 1 and g.storage is not Storage.RING


def has_sharded_attention(geometries) -> bool:
    return any(g.sharded and g.storage is not Storage.RING for g in geometries)
