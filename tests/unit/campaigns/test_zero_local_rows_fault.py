"""Bug class 46 (issue 30): rows with no local keys dropped from a rank's per-row attention
metadata (``zero-local-rows-compacted``, ROCm/ATOM#2057, vllm-ascend#11807): the fault's
metadata against the reference's, where it applies, and the run the checker fails."""

from __future__ import annotations

import numpy as np

from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.plan import ReqWrite
from support.helpers import builtin, geometries, run

FAULT = "zero-local-rows-compacted"


def _sharded(sc):
    return next(g for g in geometries(sc) if g.sharded)


def _write(i, req, length):
    return ReqWrite(i, req, 0, np.arange(length, dtype=np.int64))


def test_an_empty_row_takes_the_next_rows_local_length_and_pages():
    g = _sharded(builtin("many-short", 4, 16))  # B = 16: rank 3 holds nothing of a request of <= 48 tokens
    fault, ref = FAULTS[FAULT], ReferenceEngine()
    writes = [_write(0, "long", 100), _write(1, "short", 40), _write(2, "mid", 55)]
    rows = [np.array([5, 6], np.int64), np.array([7], np.int64), np.array([8, 9], np.int64)]
    right = ref.build_attention_metadata(g, writes, rows, 3)
    bad = fault.build_attention_metadata(g, writes, rows, 3)
    assert right.dcp_local_seq_lens.tolist() == [16, 0, 7]
    assert bad.dcp_local_seq_lens.tolist() == [16, 7, 0]  # "short" gets "mid"'s keys, "mid" none
    assert right.kv_indptr.tolist() == [0, 1, 1, 2] and bad.kv_indptr.tolist() == [0, 1, 2, 2]
    assert right.kv_last_page_len.tolist() == [16, 0, 7] and bad.kv_last_page_len.tolist() == [16, 7, 0]
    assert bad.request_ids == right.request_ids and (bad.seq_lens == right.seq_lens).all()
    assert (bad.kv_indices == right.kv_indices).all()  # the pages themselves, in order, are the same
    # no empty row, or only empty rows at the end: compacting changes nothing
    for rank in (0, 1, 2):
        a, b = ref.build_attention_metadata(g, writes, rows, rank), fault.build_attention_metadata(g, writes, rows, rank)
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in a.ARRAYS)
    tail = [writes[0], writes[2], _write(1, "short", 40)]
    a, b = ref.build_attention_metadata(g, tail, rows, 3), fault.build_attention_metadata(g, tail, rows, 3)
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in a.ARRAYS)


def test_it_applies_where_a_short_request_precedes_a_longer_one_on_some_rank():
    fault = FAULTS[FAULT]
    assert fault.applies_to_scenario(builtin("many-short", 4, 16), geometries(builtin("many-short", 4, 16)))
    assert not fault.applies_to_scenario(builtin("many-short", 2, 1), geometries(builtin("many-short", 2, 1)))


def test_a_compacted_row_is_caught_in_the_attention_metadata():
    sc = builtin("many-short", 4, 16)
    assert run(sc).passed
    report = run(sc, inject=FAULT)
    assert not report.passed and report.failure.kind == "attention-metadata", report.text()
    assert "dcp_local_seq_lens" in report.text() and "rank 3" in report.text(), report.text()
