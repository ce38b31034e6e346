"""The sparse-attention faults (semantics section 14, bug classes 33 and 34), in one process:
each decision does what its bug class says beside the reference's, and each fault is caught
on ``dsv32-sparse`` as a ``sparse-selection`` failure naming the rank, request and position."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from support.helpers import fault_scenario as scenario
from support.helpers import run_fault as run

SPARSE_FAULTS = ("topk-tie-order", "sparse-row-masked-by-empty-shard")


def test_the_sparse_faults_are_registered_with_their_bug_classes():
    for name, number in zip(SPARSE_FAULTS, ("33", "34")):
        fault = FAULTS[name]
        assert fault.bug_class.startswith(f"{number}. ") and fault.needs == {"attention": True}
        assert fault.scenarios == ("dsv32-sparse",)


def test_tie_order_differs_from_the_total_order_on_odd_ranks_only():
    scores = np.array([[2, 5, 5, 5, 1]], dtype=np.float32)
    ref, fault = ReferenceEngine(), FAULTS["topk-tie-order"]
    counts = np.array([3])
    assert ref.select_topk(scores, 2, counts, 1).tolist() == [[1, 2]]
    assert fault.select_topk(scores, 2, counts, 0).tolist() == [[1, 2]]
    assert fault.select_topk(scores, 2, counts, 1).tolist() == [[2, 3]]


def test_row_mask_erases_the_merged_row_where_the_rank_holds_no_indexer_key():
    scores = np.array([[1, -np.inf], [1, 2]], dtype=np.float32)
    fault = FAULTS["sparse-row-masked-by-empty-shard"]
    assert fault.select_topk(scores, 2, np.array([0, 1]), 1).tolist() == [[-1, -1], [0, 1]]
    assert ReferenceEngine().select_topk(scores, 2, np.array([0, 1]), 1).tolist() == [[0, -1], [0, 1]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,options,rank",
    [
        ("topk-tie-order", {"decode_context_parallel_size": 2}, 1),
        ("sparse-row-masked-by-empty-shard", {"decode_context_parallel_size": 2}, 1),
        ("sparse-row-masked-by-empty-shard", {"decode_context_parallel_size": 4, "cp_kv_cache_interleave_size": 16}, 1),
    ],
)
def test_each_sparse_fault_is_caught_as_a_selection_disagreement(fault, options, rank):
    report = run(scenario("dsv32-sparse", **options), fault)
    assert not report.passed
    f = report.failure
    assert f.kind == "sparse-selection"
    assert f.message.startswith(f"rank {rank}'s top-k selection differs")
    assert f.request_id and f.query_position is not None and f.group.startswith("SparseMLAAttention")
    assert any(d.startswith("rank 0:") and d.endswith("agrees") for d in f.details)
