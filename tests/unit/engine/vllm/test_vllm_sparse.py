"""``--engine vllm``'s sparse decision (semantics section 14): vLLM's own
``triton_filter_and_convert_dcp_index`` (sparse_utils.py) maps the global top-k ids to this
rank's local keys, through an identity block table, on the first and last tile of the last
token; it agrees with the reference's ``round_down(t // W, I) + t % I`` on rank ``(t // I) % W``,
and its output is what the engine returns."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.registry import build_engine, engine_info
from support.helpers import builtin, geometries


def sparse_geometry(W: int, I: int):
    return next(g for g in geometries(builtin("dsv32-sparse", W, I)) if type(g.spec).__name__ == "SparseMLAAttentionSpec")


@pytest.mark.parametrize("W,I", [(2, 1), (4, 16), (3, 4)])
def test_vllm_filter_agrees_with_the_reference(vllm_source, W, I):
    eng = build_engine("vllm", vllm_source=str(vllm_source))
    g = sparse_geometry(W, I)
    rng = np.random.default_rng(W * 100 + I)
    sel = np.stack([np.sort(rng.choice(3000, size=2048, replace=False)) for _ in range(2)])
    sel[1, 1900:] = -1
    for r in range(W):
        assert (eng.sparse_local_keys(g, sel, r) == ReferenceEngine().sparse_local_keys(g, sel, r)).all()
    assert "triton_filter_and_convert_dcp_index" in engine_info(eng)["decisions"]["sparse_local_keys"]
    assert engine_info(eng)["decisions"]["select_topk"].startswith("reference (")


def test_the_engine_returns_vllm_s_output(vllm_source, monkeypatch):
    """A kernel output shifted by one shows in the last row's first and last tiles only."""
    eng = build_engine("vllm", vllm_source=str(vllm_source))
    g = sparse_geometry(2, 1)
    sel = np.arange(0, 2 * 2048, 2)[None, :].repeat(2, axis=0)  # every id on rank 0
    eng.sparse_local_keys(g, sel, 0)  # loads the kernel
    real = eng._sparse_filter
    monkeypatch.setattr(eng, "_sparse_filter", lambda *a, **k: real(*a, **k) + 1)
    got = eng.sparse_local_keys(g, sel, 0)
    ref = ReferenceEngine().sparse_local_keys(g, sel, 0)
    assert (got[0] == ref[0]).all()
    assert (got[1, :128] == ref[1, :128] + 1).all() and (got[1, -128:] == ref[1, -128:] + 1).all()
    assert (got[1, 128:-128] == ref[1, 128:-128]).all()
