"""The deterministic stand-ins for activations (``dcpsim.model.vectors``)."""

from __future__ import annotations

import math

import numpy as np

from dcpsim.model.vectors import kv_vectors, query_vectors, uniform_rows


def test_vectors_are_deterministic_and_content_sensitive():
    a = kv_vectors(1, np.array([5, 6, -7]), 32)
    assert a.dtype == np.float32 and a.shape == (3, 32)
    assert np.array_equal(a, kv_vectors(1, np.array([5, 6, -7]), 32))
    assert not np.array_equal(a[0], kv_vectors(1, np.array([8]), 32)[0])  # other content
    assert not np.array_equal(a[0], kv_vectors(2, np.array([5]), 32)[0])  # other group
    assert np.abs(a).max() <= math.sqrt(3.0)
    big = uniform_rows(np.arange(20000, dtype=np.uint64), 16)
    assert abs(float(big.mean())) < 0.02 and abs(float(big.var()) - 1.0) < 0.02
    long = kv_vectors(0, np.arange(40000), 8)  # hashed in blocks: same as one at a time
    assert np.array_equal(long[[0, 17000, 39999]], kv_vectors(0, np.array([0, 17000, 39999]), 8))
    q = query_vectors(0, 3, np.array([10, 11]), np.array([5, 5]), 4, 8)
    assert q.shape == (2, 4, 8)
    assert not np.array_equal(q[0], q[1])  # position matters
    assert not np.array_equal(q, query_vectors(0, 4, np.array([10, 11]), np.array([5, 5]), 4, 8))
