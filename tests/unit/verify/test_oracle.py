"""The checker's oracle on its own (``dcpsim.verify.oracle``), over the checker's own
geometry (``dcpsim.verify.geometry.expected_groups``): which indices each rank must hold,
in which order, with which contents, and where each retention starts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.model.config import SimConfig
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import RequestView
from dcpsim.model.scenario import RequestSpec, Scenario
from dcpsim.model.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.oracle import expected_full, expected_on_rank, expected_owner, expected_share, owned_mask, retained_start
from support.helpers import geometries

LAYERS = {
    "mla": MLAAttentionSpec(block_size=16, head_size=64),
    "mla2": MLAAttentionSpec(block_size=32, head_size=64, tokens_per_state=2),
    "swa": SlidingWindowMLASpec(block_size=16, head_size=64, sliding_window=128, extra_retained_tokens=5, dcp_replicated=True),
    "chunk": ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, attention_chunk_size=24, dcp_replicated=True),
    "ring": CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=8, dcp_replicated=True),
}


def _groups(layers, W, I, k=3):
    """The checker's expected group of each layer (one layer per group here), by layer name."""
    cfg = SimConfig(
        max_model_len=4096,
        max_num_batched_tokens=256,
        decode_context_parallel_size=W,
        cp_kv_cache_interleave_size=I,
        num_speculative_tokens=k,
    )
    sc = Scenario(name="o", layers=layers, config=cfg, requests=(RequestSpec("r", 10, 10),))
    geometries(sc)  # the config is valid for every group (the reference engine accepts it)
    groups = expected_groups(sc)
    assert [g.layer_names for g in groups] == [(name,) for name in layers]
    return {g.layer_names[0]: g for g in groups}


def view(n, total=2000):
    fp = np.arange(total, dtype=np.int64) * 7919 + 13  # distinct per position
    return RequestView(0, "r", n, fp)


def local_len(L, r, W, I):
    """Doc section 2: local(L, r) = base + clamp(L - base*W - r*I, 0, I), base = (L // (I*W)) * I."""
    base = (L // (I * W)) * I
    return base + min(max(L - base * W - r * I, 0), I)


def test_expected_groups_describe_the_layers():
    groups = _groups(LAYERS, 2, 4)
    assert groups["mla"].sharded and groups["mla"].storage is Storage.PAGED
    assert groups["mla2"].sharded and groups["mla2"].storage is Storage.RECORDS
    assert groups["mla2"].tokens_per_state == 2 and groups["mla2"].page_states == 16
    assert groups["mla2"].index_kind == "record" and groups["ring"].index_kind == "ring row"
    assert groups["swa"].retention is Retention.WINDOW and not groups["swa"].sharded
    assert groups["chunk"].retention is Retention.CHUNK and not groups["chunk"].sharded
    assert groups["ring"].storage is Storage.RING and groups["ring"].kernel_block_size is None
    assert all(g.dcp_size == 2 and g.interleave_size == 4 for g in groups.values())
    # one rank: nothing is sharded
    assert not any(g.sharded for g in _groups(LAYERS, 1, 1).values())


@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 8), (4, 16)])
@pytest.mark.parametrize("n", [0, 1, 5, 16, 63, 64, 100, 777])
def test_expected_on_rank_partitions_expected_full(W, I, n):
    groups = _groups(LAYERS, W, I)
    v = view(n)
    for key in ("mla", "mla2"):
        group = groups[key]
        full_i, full_c = expected_full(group, v)
        if key == "mla2":  # records c < n // 2, content of position 2c + 1
            assert list(full_i) == list(range(n // 2))
            assert list(full_c) == [int(v.fingerprints[2 * c + 1]) for c in range(n // 2)]
        else:
            assert list(full_i) == list(range(n))
        parts = [expected_on_rank(group, v, r) for r in range(W)]
        allidx = np.concatenate([p[0] for p in parts])
        assert sorted(allidx.tolist()) == full_i.tolist()  # disjoint and complete
        for r, (idx, con) in enumerate(parts):
            assert list(idx) == sorted(idx)  # local (attention) order
            assert all((i // I) % W == r for i in idx.tolist())
            assert all(expected_owner(group, i) == (r if W > 1 else None) for i in idx.tolist()[:5])
            assert len(idx) == local_len(len(full_i), r, W, I)
            pos = np.searchsorted(full_i, idx)
            assert np.array_equal(con, full_c[pos])


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [0, 1, 5, 100, 777])
def test_the_ranks_shares_are_expected_full_in_order(parts, n):
    """``expected_share``'s slices, part after part, are ``expected_full`` exactly (each index
    once, whatever the layout): the sum of the ranks' digests of them is the full context's."""
    for W, I in ((2, 1), (4, 16)):
        groups = _groups(LAYERS, W, I)
        for key in ("mla", "mla2", "swa", "chunk", "ring"):
            full_i, full_c = expected_full(groups[key], view(n))
            shares = [expected_share(groups[key], view(n), part, parts) for part in range(parts)]
            assert np.array_equal(np.concatenate([i for i, _ in shares]), full_i)
            assert np.array_equal(np.concatenate([c for _, c in shares]), full_c)
            assert max(len(i) for i, _ in shares) - min(len(i) for i, _ in shares) <= 1  # equal slices


@pytest.mark.parametrize("W", [1, 2, 4])
def test_replicated_groups_expect_everything_on_every_rank(W):
    groups = _groups(LAYERS, W, 1)
    v = view(300)
    for key in ("swa", "chunk", "ring"):
        group = groups[key]
        assert not group.sharded and expected_owner(group, 7) is None
        full = expected_full(group, v)
        for r in range(W):
            got = expected_on_rank(group, v, r)
            assert np.array_equal(got[0], full[0]) and np.array_equal(got[1], full[1])


@pytest.mark.parametrize(
    "n,window,chunk,ring",
    [
        # window 128, extra 5: n - 127 - 5; chunk 24: 24 * (n // 24); ring C=8, k=3: n - (8 - 3)
        (0, 0, 0, 0),
        (3, 0, 0, 0),
        (5, 0, 0, 0),
        (6, 0, 0, 1),
        (23, 0, 0, 18),
        (24, 0, 24, 19),
        (47, 0, 24, 42),
        (48, 0, 48, 43),
        (132, 0, 120, 127),
        (133, 1, 120, 128),
        (300, 168, 288, 295),
        (1000, 868, 984, 995),
    ],
)
def test_retained_start_formulas(n, window, chunk, ring):
    groups = _groups(LAYERS, 2, 1, k=3)
    assert retained_start(groups["swa"], n) == window
    assert retained_start(groups["chunk"], n) == chunk
    assert retained_start(groups["ring"], n) == ring
    assert retained_start(groups["mla"], n) == 0
    v = view(n)
    idx, con = expected_full(groups["swa"], v)
    assert list(idx) == list(range(window, n))
    assert np.array_equal(con, v.fingerprints[window:n])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([(1, 1), (2, 1), (2, 4), (3, 2), (4, 8), (8, 16), (8, 1)]), st.integers(0, 700), st.data())
def test_a_rank_enumerates_exactly_the_indices_it_owns(WI, n, data):
    """``expected_on_rank`` lists the rank's runs of ``I``; by definition it holds index i
    iff (i // I) % W == rank: both agree (DCP shards only spans that start at 0: a sliding
    window or chunk must be dcp_replicated)."""
    W, I = WI
    rank = data.draw(st.integers(0, W - 1))
    v = view(n)
    groups = _groups(LAYERS, W, I)
    for key in ("mla", "mla2"):
        group = groups[key]
        full_i, full_c = expected_full(group, v)
        mine = owned_mask(group, full_i, rank)
        idx, con = expected_on_rank(group, v, rank)
        assert np.array_equal(idx, full_i[mine]) and np.array_equal(con, full_c[mine]), (key, W, I, n, rank)
