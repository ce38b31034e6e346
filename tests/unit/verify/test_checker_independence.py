"""The checker owns its expectation: a mistake the engine makes consistently inside its own
geometry (so that its writes, its tables and its attention all agree with each other) is
still caught, because the checker derives the layout from the scenario alone."""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Storage
from support.helpers import builtin, run


class RecordInterleaveOverR(ReferenceEngine):
    """Compressed-record groups sharded I // R records at a time (a tempting "fix" that
    makes a rank's run of records cover I tokens): self-consistent inside the engine."""

    def group_geometry(self, group_id, group, config):
        g = super().group_geometry(group_id, group, config)
        if g.storage is Storage.RECORDS and g.sharded:
            g = dataclasses.replace(g, interleave_size=max(1, g.interleave_size // g.tokens_per_state))
        return g


class DoubledInterleave(ReferenceEngine):
    """Every sharded group interleaved 2 * I (the engine read the flag twice)."""

    def group_geometry(self, group_id, group, config):
        g = super().group_geometry(group_id, group, config)
        if g.sharded and 2 * g.interleave_size <= g.states_per_page:
            g = dataclasses.replace(g, interleave_size=2 * g.interleave_size)
        return g


class ShardedAsReplicated(ReferenceEngine):
    """The engine's geometry calls a sharded full-attention group replicated: every rank
    stores every position, with plain block geometry (tables and pools agree)."""

    def group_geometry(self, group_id, group, config):
        g = super().group_geometry(group_id, group, config)
        if g.sharded and g.storage is Storage.PAGED:
            g = dataclasses.replace(g, sharded=False, manager_block_size=g.block_size, block_table_width=g.block_table_width * g.dcp_size)
        return g


@pytest.mark.slow
@pytest.mark.parametrize("attention", [False, True])
@pytest.mark.parametrize("W,I", [(2, 16), (4, 8), (3, 64)])
def test_record_interleave_divided_by_r_is_caught(W, I, attention):
    sc = builtin("dsv41-hybrid", W, I)
    assert run(sc, attention=attention).passed  # the scenario itself is fine
    report = run(sc, engine=RecordInterleaveOverR(), attention=attention)
    assert not report.passed
    assert report.failure.kind == "wrong-content"
    assert report.failure.index_kind == "record"
    assert report.failure.group.startswith("MLAAttention[model.layers.2.attn.main_cache")


def test_record_interleave_variant_changes_nothing_where_it_cannot_show():
    """At I = 1 (I // R == 1 too) and W = 1 the variant is the reference: it must pass."""
    assert run(builtin("dsv41-hybrid", 2, 1), engine=RecordInterleaveOverR()).passed
    assert run(builtin("dsv41-hybrid", 1, 1), engine=RecordInterleaveOverR()).passed


@pytest.mark.parametrize("name", ["dsv3", "llama-gqa", "gpt-oss-hybrid"])
def test_doubled_interleave_is_caught(name):
    report = run(builtin(name, 2, 4), engine=DoubledInterleave())
    assert not report.passed and report.failure.kind == "wrong-content"


@pytest.mark.parametrize("name", ["llama-gqa", "gpt-oss-hybrid"])
def test_sharded_group_stored_as_replicated_is_caught(name):
    report = run(builtin(name, 2, 1), engine=ShardedAsReplicated())
    assert not report.passed and report.failure.kind == "wrong-content"
