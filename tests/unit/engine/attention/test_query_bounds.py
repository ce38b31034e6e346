"""The engine's per-token key bounds of a multi-token query (``Engine.query_local_bounds``),
and the fault that derives them as ``local(L) - k`` (semantics section 8, bug 3)."""

from __future__ import annotations

import numpy as np

from dcpsim.engine.faults import Fault
from dcpsim.engine.faults.metadata import MultiTokenLocalLens
from dcpsim.model.kinds import Storage
from dcpsim.model.layout import local_seq_lens
from support.helpers import builtin, geometries


def sharded_paged(W, I):
    """The reference geometry of dsv3's (sharded, paged) MLA group at ``W``, ``I``."""
    (g,) = geometries(builtin("dsv3", W, I))
    assert g.sharded and g.storage is Storage.PAGED and (g.dcp_size, g.interleave_size) == (W, I)
    return g


def test_multi_token_local_lens_fault_bounds():
    """Semantics section 8, bug 3: local(L) - k differs from per-token bounds under interleaving."""
    H, q, W, I = 100, 4, 2, 16
    g = sharded_paged(W, I)
    lens = H + 1 + np.arange(q)
    for r in range(W):
        right = local_seq_lens(lens, dcp_size=W, interleave_size=I, dcp_rank=r)
        assert np.array_equal(Fault().query_local_bounds(g, H, H + q, r), right)
        wrong = MultiTokenLocalLens().query_local_bounds(g, H, H + q, r)
        assert wrong[-1] == right[-1]
        if r == 1:  # positions 100..103 all live on rank 0: rank 1 must see 48 keys for every token
            assert list(right) == [48] * 4 and list(wrong) == [45, 46, 47, 48]


def test_query_bounds_of_records_count_emitted_records():
    # dsv41-hybrid's records group (R = 2), W = 2, I = 1: token at position p sees the records
    # emitted at positions <= p, (p + 1) // 2 of them, shared out one at a time
    sc = builtin("dsv41-hybrid", 2, 1)
    (g,) = [g for g in geometries(sc) if g.storage is Storage.RECORDS]
    assert g.sharded and g.tokens_per_state == 2
    lens = (np.arange(10, 17) + 1) // 2
    for r in range(2):
        want = local_seq_lens(lens, dcp_size=2, interleave_size=1, dcp_rank=r)
        assert np.array_equal(Fault().query_local_bounds(g, 10, 17, r), want)
