"""A rank's process groups under PCP x TP x DCP: the world split into its DCP, PCP and TP
groups (``dcpsim.model.parallel`` gives the members), each a real ``Collectives``.

Every rank of a world builds the same groups in the same order (gloo ``new_group`` is
collective). A world of one DCP group and no PCP (the usual ``W = dcp`` world) needs no
subgroup: its DCP collectives are the world's.

A world that holds several instances (a P/D run, ``harness.pd``) makes every
instance's groups on every process first (``make_world_groups``): each instance then
builds its groups on its own collective, which finds them made.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.collectives import Collectives
from dcpsim.model.config import SimConfig
from dcpsim.model.parallel import ParallelLayout, RankCoords


@dataclass
class ParallelGroups:
    layout: ParallelLayout
    coords: RankCoords
    world: Collectives
    dcp: Collectives
    pcp: Collectives | None
    """None without PCP (a group of one)."""
    tp: Collectives | None = None
    """The TP group (its rows of the grid); None when it is a group of one or the DCP group."""

    @property
    def num_dcp_groups(self) -> int:
        return self.layout.world_size // self.layout.dcp

    @property
    def bytes_sent(self) -> int:
        colls = {id(c): c for c in (self.world, self.dcp, self.pcp, self.tp) if c is not None}
        return sum(c.bytes_sent for c in colls.values())


def group_kinds(layout: ParallelLayout) -> list[tuple[str, list[list[int]]]]:
    """The ``(name, groups)`` a world of ``layout`` splits into, in creation order (none for
    one DCP group without PCP)."""
    if layout.pcp == 1 and layout.dcp == layout.world_size:
        return []
    kinds = [("dcp", layout.dcp_groups())]
    if layout.pcp > 1:
        kinds.append(("pcp", layout.pcp_groups()))
    if layout.tp > 1:
        kinds.append(("tp", layout.tp_groups()))  # dcpsim runs nothing on it
    return kinds


def build_groups(config: SimConfig, world: Collectives) -> ParallelGroups:
    """The rank's groups; ``world`` must hold ``config.world_size`` ranks."""
    layout = config.parallel_layout
    if world.world_size != layout.world_size:
        raise ValueError(
            f"a world of {world.world_size} ranks for prefill_context_parallel_size "
            f"{layout.pcp} x tensor_parallel_size {layout.tp} (= {layout.world_size})"
        )
    coords = layout.coords(world.rank)
    made = {name: world.subgroup(name, groups) for name, groups in group_kinds(layout)}
    if not made:
        return ParallelGroups(layout, coords, world, world, None)
    return ParallelGroups(layout, coords, world, made["dcp"], made.get("pcp"), made.get("tp"))


def make_world_groups(world, instances: list[tuple[int, SimConfig]]) -> None:
    """On every process of the default world (``world``, a ``GlooCollectives`` of it): make
    the groups of each instance (``(first world rank, config)``), in order, with the
    instance's ranks shifted to world ranks (``groups.build_groups`` then finds them)."""
    for first, config in instances:
        for name, groups in group_kinds(config.parallel_layout):
            for members in groups:
                world.world_group(name, tuple(first + m for m in members))
