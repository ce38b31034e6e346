"""``model.shared_streams``: the launcher's streams, written once and mapped by each rank, are
the streams a rank would draw and hash itself; only long requests without a shared prefix are
written, and a process that attached none (or another world's) gets None."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.model import shared_streams as shared
from dcpsim.model.content import prefix_fingerprints, random_tokens, raw_prefix_hash, stable_seed
from dcpsim.model.scenario import RequestSpec


@pytest.fixture(autouse=True)
def detached():
    yield
    shared.attach(None)


def spec(request_id: str, prompt_len: int, **kw) -> RequestSpec:
    return RequestSpec(request_id=request_id, prompt_len=prompt_len, output_len=8, **kw)


def test_written_streams_are_the_ones_a_rank_derives(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "SHARE_MIN_TOKENS", 100)
    long_one = spec("long", 3000)
    assert shared.write_streams([(5, long_one), (5, long_one)], str(tmp_path)) == 1  # each request once
    shared.attach(str(tmp_path))
    got = shared.shared_streams(5, long_one)
    tokens = random_tokens(stable_seed(5, "request", "long"), 3008)  # as Request.tokens draws them
    raw = raw_prefix_hash(tokens)
    assert np.array_equal(got.tokens, tokens) and got.tokens.dtype == tokens.dtype
    assert np.array_equal(got.raw, raw) and np.array_equal(got.fingerprints, prefix_fingerprints(tokens, raw))
    assert type(got.fingerprints) is np.ndarray and not got.fingerprints.flags.writeable  # mapped read-only
    with pytest.raises(ValueError):
        got.tokens[0] = 1


def test_only_long_requests_without_a_shared_prefix_are_shared(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "SHARE_MIN_TOKENS", 100)
    short, prefixed = spec("short", 50), spec("p", 3000, prefix="sys", shared_prefix_len=10)
    assert shared.write_streams([(5, short), (5, prefixed)], str(tmp_path)) == 0
    shared.attach(str(tmp_path))
    assert shared.shared_streams(5, short) is None and shared.shared_streams(5, prefixed) is None


def test_another_seed_length_or_no_attached_world_is_not_shared(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "SHARE_MIN_TOKENS", 100)
    long_one = spec("long", 3000)
    shared.write_streams([(5, long_one)], str(tmp_path))
    assert shared.shared_streams(5, long_one) is None  # not attached yet
    shared.attach(str(tmp_path))
    assert shared.shared_streams(6, long_one) is None
    assert shared.shared_streams(5, spec("long", 3001)) is None
    assert shared.shared_streams(5, long_one) is not None
    shared.attach(None)
    assert shared.shared_streams(5, long_one) is None
