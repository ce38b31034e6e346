"""Which query tokens a rank computes (``Engine.attention_query_rows``, bug class 52).

* a token's slot in a rank's slot mapping (``engine.attention.shard.query_slots``) is the slot
  its KV went to on that rank, ``PAD`` where another rank stores it, for paged and compressed
  groups alike;
* the reference computes every token, ``PAD`` slot or not; ``non-owner-skips-query-rows`` skips
  the ``PAD`` ones;
* under ``--attention`` the reference passes ``dsv3`` at W = 2 and the fault fails it
  (``attention-mismatch``, the non-owner rank seeing no key for the token), which it can only do
  if the shard attention asks the engine.
"""

from __future__ import annotations

import numpy as np

from dcpsim.engine.attention.shard import query_slots
from dcpsim.engine.faults import get_fault
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.layout import PAD
from dcpsim.model.plan import ReqWrite, WriteRecord
from support.helpers import builtin, geometries, run


def _record(engine, geometry, write, rank):
    """What the worker logs of ``write`` on ``rank`` (``PAD`` dropped), and the raw mapping."""
    row = np.arange(1, 1 + -(-write.stop // geometry.block_size) + 1, dtype=np.int64)
    slots, index = (np.asarray(a, np.int64) for a in engine.write_slots(geometry, write, row, rank))
    mine = slots != PAD
    return WriteRecord(geometry.group_id, write.req_index, write.request_id, slots[mine], index[mine]), slots, index


def test_a_paged_tokens_slot_is_where_its_kv_went_on_the_rank_and_pad_elsewhere():
    engine = ReferenceEngine()
    g = geometries(builtin("dsv3", 2))[0]
    write = ReqWrite(0, "r0", 37, np.arange(100, 120, dtype=np.int64))
    for rank in (0, 1):
        record, slots, index = _record(engine, g, write, rank)
        got = query_slots(g, write, record)
        assert np.array_equal(index, np.arange(37, 57))  # a paged write's index is its position
        assert np.array_equal(got, slots)  # the token's own slot, PAD where the other rank stores it
        owned = (np.arange(37, 57) % 2) == rank  # W = 2, I = 1
        assert np.array_equal(got >= 0, owned)
    assert (query_slots(g, write, None) == PAD).all()  # nothing written here: every slot PAD


def test_a_compressed_tokens_slot_is_its_records_emitted_at_its_last_token():
    engine = ReferenceEngine()
    g = next(x for x in geometries(builtin("dsv41-hybrid", 2)) if x.tokens_per_state == 2)
    write = ReqWrite(0, "r0", 10, np.arange(500, 512, dtype=np.int64))  # positions 10..21: records 5..10
    for rank in (0, 1):
        record, slots, index = _record(engine, g, write, rank)
        got = query_slots(g, write, record)
        emits = {int(c) * 2 + 1 - 10: int(s) for s, c in zip(slots, index) if s != PAD}
        assert emits and all(got[t] == s for t, s in emits.items())
        assert all(got[t] == PAD for t in range(len(got)) if t not in emits)  # no record of this rank
        assert all(t % 2 == 1 for t in emits)  # emitted at a record's last token


def test_the_reference_computes_every_token_and_the_fault_skips_the_pad_ones():
    g = geometries(builtin("dsv3", 2))[0]
    slots = np.array([PAD, 64, PAD, 65, PAD, -7], dtype=np.int64)
    assert ReferenceEngine().attention_query_rows(g, slots, 1).tolist() == [True] * 6
    fault = get_fault("non-owner-skips-query-rows")
    assert fault.attention_query_rows(g, slots, 1).tolist() == [False, True, False, True, False, False]


def test_a_rank_that_skips_the_tokens_it_does_not_store_fails_the_attention_check():
    sc = builtin("dsv3", 2)
    assert run(sc, attention=True).passed
    failed = run(sc, inject="non-owner-skips-query-rows")  # --inject switches --attention on
    assert not failed.passed and failed.failure.kind == "attention-mismatch", failed.text()
    assert "0 keys visible, lse -inf" in failed.text()
