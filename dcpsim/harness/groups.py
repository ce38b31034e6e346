"""A rank's process groups under PCP x TP x DCP: the world split into its DCP, PCP and TP
groups (``dcpsim.model.parallel`` gives the members), each a real ``Collectives``.

Every rank of a world builds the same groups in the same order (gloo ``new_group`` is
collective). A world of one DCP group and no PCP (the usual ``W = dcp`` world) needs no
subgroup: its DCP collectives are the world's.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.harness.collectives import Collectives
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


def build_groups(config: SimConfig, world: Collectives) -> ParallelGroups:
    """The rank's groups; ``world`` must hold ``config.world_size`` ranks."""
    layout = config.parallel_layout
    if world.world_size != layout.world_size:
        raise ValueError(f"a world of {world.world_size} ranks for prefill_context_parallel_size "
                         f"{layout.pcp} x tensor_parallel_size {layout.tp} (= {layout.world_size})")
    coords = layout.coords(world.rank)
    if layout.pcp == 1 and layout.dcp == layout.world_size:
        return ParallelGroups(layout, coords, world, world, None)
    dcp = world.subgroup("dcp", layout.dcp_groups())
    pcp = world.subgroup("pcp", layout.pcp_groups()) if layout.pcp > 1 else None
    tp = world.subgroup("tp", layout.tp_groups()) if layout.tp > 1 else None  # dcpsim runs nothing on it
    return ParallelGroups(layout, coords, world, dcp, pcp, tp)
