"""Process groups of a world that holds several instances (a P/D run): an instance's
collective translates its ranks to world ranks, finds the groups the world made for it,
and refuses to make one itself (``dist.new_group`` is collective over the whole world).
``new_group`` is recorded, not run: no world is started."""

from __future__ import annotations

import pytest

from dcpsim.errors import HarnessError
from dcpsim.harness import collectives
from dcpsim.harness.collectives import GlooCollectives
from dcpsim.harness.groups import build_groups, group_kinds, make_world_groups
from dcpsim.model.config import SimConfig


@pytest.fixture
def made(monkeypatch):
    """Every ``new_group`` call, in order; each returns its member tuple as the group."""
    import torch.distributed as dist

    calls = []

    def new_group(ranks, timeout=None):
        calls.append(tuple(ranks))
        return ("pg", tuple(ranks))

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(collectives, "_world_timeout", lambda: None)
    return calls


PREFILL = SimConfig(decode_context_parallel_size=2, prefill_context_parallel_size=2, tensor_parallel_size=2)
DECODE = SimConfig(decode_context_parallel_size=3)


def test_every_world_rank_makes_both_instances_groups_in_one_order(made):
    """Prefill: ranks 0-3 (PCP 2 x TP 2, W = 2), decode: ranks 4-6 (one DCP group: no groups)."""
    orders = []
    for rank in range(7):
        made.clear()
        world = GlooCollectives(rank, 7)
        world.subgroup("pd-instance", [[0, 1, 2, 3], [4, 5, 6]])
        make_world_groups(world, [(0, PREFILL), (4, DECODE)])
        orders.append(list(made))
    assert all(o == orders[0] for o in orders)
    # DCP groups are the transposed grid's rows: (0, 2) and (1, 3); PCP the same columns; TP the rows
    assert orders[0] == [(0, 1, 2, 3), (4, 5, 6), (0, 2), (1, 3), (0, 2), (1, 3), (0, 1), (2, 3)]
    assert group_kinds(DECODE.parallel_layout) == []


def test_an_instance_collective_finds_its_groups_by_world_rank(made):
    world = GlooCollectives(3, 8)
    shifted = SimConfig(decode_context_parallel_size=2, prefill_context_parallel_size=2)  # a 2-process prefill
    decode = SimConfig(decode_context_parallel_size=2, prefill_context_parallel_size=2, tensor_parallel_size=2)
    mine = world.subgroup("pd-instance", [[0, 1], [2, 3, 4, 5]])
    assert (mine.rank, mine.world_size, mine.ranks, mine.group) == (1, 4, (2, 3, 4, 5), ("pg", (2, 3, 4, 5)))
    make_world_groups(world, [(0, shifted), (2, decode)])
    before = len(made)
    groups = build_groups(decode, mine)  # instance rank 1 = grid (0, 1): DCP group 1 = instance ranks (1, 3)
    assert len(made) == before  # nothing made from inside the instance
    assert groups.dcp.ranks == (3, 5) and groups.dcp.group == ("pg", (3, 5)) and groups.dcp.rank == 0
    assert groups.pcp.ranks == (3, 5) and groups.pcp.group is not groups.dcp.group  # its own group, same members
    assert groups.tp.ranks == (2, 3) and groups.tp.rank == 1


def test_an_instance_collective_refuses_a_group_the_world_did_not_make(made):
    world = GlooCollectives(4, 6)
    mine = world.subgroup("pd-instance", [[0, 1], [2, 3, 4, 5]])
    with pytest.raises(HarnessError, match="the dcp group of world ranks 2, 4 was not made at world start"):
        build_groups(SimConfig(decode_context_parallel_size=2, prefill_context_parallel_size=2, tensor_parallel_size=2), mine)
