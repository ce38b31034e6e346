"""The attention-metadata check: the checker's own derivation (run counting, the paged
plan off the block-table row, 128-token widths, CUDA-graph padding) against worked
examples and the layout math, and the reference engine's metadata against it on every
built-in."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.layout import local_seq_lens
from dcpsim.model.plan import PAD_REQUEST, ReqWrite, StepPlan
from dcpsim.scenarios.registry import builtin_scenario_names
from dcpsim.verify.geometry import ExpectedGroup, expected_groups
from dcpsim.verify.metadata import expected_metadata, expected_width, uniform_decode_padding
from dcpsim.verify.oracle import owned_below
from support.helpers import builtin, expected_group, geometries, scheduler


def group(W=2, I=4, B=16, Bk=None, sharded=True, k=0):
    return expected_group("g", W=W, I=I, B=B, Bk=Bk, sharded=sharded, num_speculative_tokens=k)


@given(st.integers(0, 2000), st.integers(1, 8), st.sampled_from([1, 2, 4, 16, 64]), st.data())
def test_run_counting_agrees_with_the_local_length_formula(L, W, I, data):
    r = data.draw(st.integers(0, W - 1))
    got = owned_below(np.array([L]), r, group(W=W, I=I, B=64))[0]
    assert got == local_seq_lens(np.array([L]), dcp_size=W, interleave_size=I, dcp_rank=r)[0]
    assert got == sum(1 for p in range(L) if (p // I) % W == r)


def test_semantics_worked_example():
    # section 2: W = 2, I = 4, L = 1, 4, 5, 8, 9 -> [1, 0], [4, 0], [4, 1], [4, 4], [5, 4]
    g = group()
    L = np.array([1, 4, 5, 8, 9])
    assert owned_below(L, 0, g).tolist() == [1, 4, 4, 4, 5]
    assert owned_below(L, 1, g).tolist() == [0, 0, 1, 4, 4]


def _plan(writes, rows):
    return StepPlan(step=0, writes=tuple(writes), rows_before=(rows,), views=(), rows_after=(rows,))


def test_expected_paged_plan_over_the_ranks_own_kernel_pages():
    # B = 16, Bk = 8, W = 2, I = 4, row [5, 6]: kernel blocks 10, 11, 12, 13; L = 40 -> 20 keys a rank
    g = group(Bk=8)
    w = ReqWrite(req_index=0, request_id="a", start=37, contents=np.zeros(3, np.int64))
    want = expected_metadata(g, _plan([w], {0: np.array([5, 6])}), {0: np.array([5, 6])}, 0, 1000, ())
    assert want["seq_lens"].tolist() == [40]
    assert want["dcp_local_seq_lens"].tolist() == [20]
    assert want["query_start_loc"].tolist() == [0, 3]
    assert want["query_local_bounds"].tolist() == [20, 20, 20]  # positions 37..39 are rank 1's
    assert want["kv_indptr"].tolist() == [0, 3]
    assert want["kv_indices"].tolist() == [10, 11, 12]
    assert want["kv_last_page_len"].tolist() == [4]
    # at least cdiv(1000, 32) = 32 entries, 2 kernel blocks each
    assert want["block_table_width"] == 64


def test_expected_width_is_the_longest_context_in_the_groups_shards():
    assert expected_width(group(W=4, B=16), 1000) == 16  # cdiv(1000, 64)
    assert expected_width(group(W=4, B=16, sharded=False), 1000) == 63  # cdiv(1000, 16): a replica holds it all
    assert expected_width(group(W=2, B=64), 1000) == 8  # cdiv(1000, 128)


def test_uniform_decode_padding_rule():
    sizes = (1, 2, 4, 8, 16)
    assert uniform_decode_padding(group(k=0), [1, 1, 1], sizes) == 1  # 3 -> 4 tokens
    assert uniform_decode_padding(group(k=3), [4, 4, 4], sizes) == 1  # 12 -> 16 (a multiple of 4)
    assert uniform_decode_padding(group(k=0), [1, 5], sizes) == 0  # a mixed step runs eagerly
    assert uniform_decode_padding(group(k=0), [1] * 17, sizes) == 0  # above every captured size
    assert uniform_decode_padding(group(k=0), [1, 1], ()) == 0  # no CUDA graphs


def test_reference_metadata_pads_with_dummy_requests_that_write_nothing():
    s = builtin("many-short", 4, max_cudagraph_capture_size=64)
    geos = geometries(s)
    engine = ReferenceEngine()
    g = next(x for x in geos if x.sharded)
    # many-short decodes with 1 draft: 3 requests x 2 tokens = 6 -> the captured size 8
    writes = [ReqWrite(req_index=i, request_id=f"r{i}", start=100, contents=np.zeros(2, np.int64), num_drafts=1) for i in range(3)]
    meta = engine.build_attention_metadata(g, writes, [np.array([1, 2])] * 3, dcp_rank=1)
    assert meta.num_dummy_requests == 1 and meta.request_ids[-1] == PAD_REQUEST
    assert meta.seq_lens[-1] == 4  # W * I
    assert meta.dcp_local_seq_lens[-1] == 1
    assert meta.query_start_loc.tolist() == [0, 2, 4, 6, 8]
    assert (meta.padded_slot_mapping == -1).all() and len(meta.padded_slot_mapping) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", builtin_scenario_names())
@pytest.mark.parametrize("W, I, extra", [(2, 1, {}), (4, 16, {"kernel_block_size": 16}), (3, 1, {"max_cudagraph_capture_size": 32})])
def test_reference_metadata_matches_the_checker_on_every_builtin(name, W, I, extra):
    try:
        s = builtin(name, W, I, **extra)
        geos = geometries(s)
    except Exception as exc:  # a combination the scenario refuses (I > B, Bk not dividing B)
        pytest.skip(f"not a valid configuration: {exc}")
    engine, groups = ReferenceEngine(), expected_groups(s)
    sched = scheduler(s)
    engine.make_scheduler(s, geos)  # a run's engine learns its requests' prompts there (Helix places by them)
    checked = 0
    for plan in sched.plans():
        for gi, (geo, grp) in enumerate(zip(geos, groups)):
            if geo.storage not in (Storage.PAGED, Storage.RECORDS) or not plan.writes:
                continue
            rows = [plan.rows_before[gi].get(w.req_index, np.zeros(0, np.int64)) for w in plan.writes]
            for rank in range(W):
                meta = engine.build_attention_metadata(geo, list(plan.writes), rows, rank)
                want = expected_metadata(grp, plan, plan.rows_before[gi], rank, s.config.max_model_len, s.config.cudagraph_capture_sizes)
                least = want.pop("block_table_width")  # the fewest entries: the reference's rows are aligned wider
                assert least <= meta.block_table_width, (plan.step, geo.name, rank)
                for field, value in want.items():
                    have = getattr(meta, field)
                    assert np.array_equal(np.asarray(have), np.asarray(value)), (plan.step, geo.name, rank, field)
                checked += 1
        if checked > 400:
            break
    assert checked > 0


@given(st.data())
def test_expected_metadata_matches_a_request_by_request_derivation(data):
    # the judge derives a step's fields for all requests at once; here each request is
    # counted out by brute force from the definitions, rows short, empty or missing included
    W = data.draw(st.integers(1, 4))
    I = data.draw(st.sampled_from([1, 2, 4]))
    R = data.draw(st.sampled_from([1, 2]))
    B = data.draw(st.sampled_from([4, 8]))
    Bk = data.draw(st.sampled_from([None, B // 2]))
    k = data.draw(st.integers(0, 2))
    g = ExpectedGroup(
        name="g",
        layer_names=("l",),
        storage=Storage.RECORDS if R > 1 else Storage.PAGED,
        retention=Retention.FULL,
        sharded=W > 1,
        dcp_size=W,
        interleave_size=I,
        tokens_per_state=R,
        block_size=B,
        kernel_block_size=Bk,
        num_speculative_tokens=k,
    )
    rank = data.draw(st.integers(0, W - 1))
    writes, rows = [], {}
    for i in range(data.draw(st.integers(1, 4))):
        start = data.draw(st.integers(0, 60))
        n = data.draw(st.integers(1, 6))
        writes.append(ReqWrite(req_index=i, request_id=f"r{i}", start=start, contents=np.zeros(n, np.int64)))
        row = data.draw(st.one_of(st.none(), st.lists(st.integers(1, 50), max_size=8)))
        if row is not None:
            rows[i] = np.array(row, dtype=np.int64)
    captures = data.draw(st.sampled_from([(), (1, 2, 4, 8, 16), (3, 6, 12)]))
    want = expected_metadata(g, _plan(writes, rows), rows, rank, 4096, captures)

    def owned(n):  # indices < n on this rank
        return sum(1 for p in range(n) if not g.sharded or (p // I) % W == rank)

    kernel = Bk or B // R
    per_block = (B // R) // kernel
    dummies = uniform_decode_padding(g, [w.stop - w.start for w in writes], captures)
    q = 1 + k
    seq = [w.stop // R for w in writes] + [W * I] * dummies
    local = [owned(s) for s in seq]
    bounds = [owned((p + 1) // R) for w in writes for p in range(w.start, w.stop)] + [local[-1]] * (q * dummies)
    indices = []
    for i, n in enumerate(local):
        row = rows.get(i, np.zeros(0, np.int64)) if i < len(writes) else np.zeros(0, np.int64)
        pages = -(-n // kernel)
        for t in range(pages):
            if not len(row):
                indices.append(0)
            elif t // per_block < len(row):
                indices.append(int(row[t // per_block]) * per_block + t % per_block)
            else:
                indices.append(-1)
    assert want["num_dummy_requests"] == dummies
    assert want["seq_lens"].tolist() == seq
    assert want["dcp_local_seq_lens"].tolist() == local
    assert want["query_local_bounds"].tolist() == bounds
    assert want["kv_indices"].tolist() == indices
    assert want["kv_indptr"].tolist() == np.concatenate([[0], np.cumsum([-(-n // kernel) for n in local])]).tolist()
    assert want["query_start_loc"][-1] == sum(w.stop - w.start for w in writes) + q * dummies
