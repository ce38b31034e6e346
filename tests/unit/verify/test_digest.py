"""The all-gather digests on their own (``dcpsim.verify.digest``)."""

from __future__ import annotations

import numpy as np

from dcpsim.verify.digest import as_int64, multiset_digest, ordered_digest


def test_multiset_digest_is_order_independent_and_additive():
    rng = np.random.default_rng(0)
    index = np.arange(100, dtype=np.int64)
    content = rng.integers(-(2**62), 2**62, size=100, dtype=np.int64)
    d = multiset_digest(index, content)
    perm = rng.permutation(100)
    assert multiset_digest(index[perm], content[perm]) == d
    # shards add up (mod 2**64) to the whole: what the checker relies on for sharded groups
    parts = [multiset_digest(index[r::3], content[r::3]) for r in range(3)]
    assert sum(parts) % 2**64 == d
    assert multiset_digest(index[:0], content[:0]) == 0
    # any changed content, moved index, lost or duplicated entry changes it
    c2 = content.copy()
    c2[17] ^= 1
    assert multiset_digest(index, c2) != d
    i2 = index.copy()
    i2[17] = 1000
    assert multiset_digest(i2, content) != d
    assert multiset_digest(index[1:], content[1:]) != d
    assert multiset_digest(np.append(index, 5), np.append(content, content[5])) != d
    # the pair is bound: swapping contents between two indices changes it
    c3 = content.copy()
    c3[[3, 4]] = c3[[4, 3]]
    assert multiset_digest(index, c3) != d


def test_ordered_digest_is_order_dependent():
    rng = np.random.default_rng(1)
    index = np.arange(50, dtype=np.int64)
    content = rng.integers(-(2**62), 2**62, size=50, dtype=np.int64)
    d = ordered_digest(index, content)
    assert ordered_digest(index.copy(), content.copy()) == d
    swapped = np.arange(50)
    swapped[[10, 11]] = [11, 10]
    assert ordered_digest(index[swapped], content[swapped]) != d
    assert ordered_digest(index[::-1], content[::-1]) != d
    assert ordered_digest(index[:-1], content[:-1]) != d
    c2 = content.copy()
    c2[0] += 1
    assert ordered_digest(index, c2) != d


def test_as_int64_keeps_the_bits():
    # the gathered rows are int64 tensors: a digest >= 2**63 must round-trip through them
    for u in (0, 1, 2**63 - 1, 2**63, 2**64 - 1):
        i = as_int64(u)
        assert -(2**63) <= i < 2**63 and i % 2**64 == u


def test_batched_digests_equal_one_digest_per_run():
    """The checker digests a step's items in one pass: each run's batched digest is
    exactly the digest of the run alone (empty runs included)."""
    from dcpsim.verify.digest import as_int64s, multiset_digests, ordered_digests, run_digests

    rng = np.random.default_rng(1)
    for _ in range(100):
        lengths = rng.integers(0, 6, size=rng.integers(0, 6))
        n = int(lengths.sum())
        index = rng.integers(0, 1000, n)
        content = rng.integers(-(2**62), 2**62, n)
        ordered, multiset = ordered_digests(index, content, lengths), multiset_digests(index, content, lengths)
        which = rng.integers(0, 2, size=len(lengths)).astype(bool)
        mixed = run_digests(index, content, lengths, which)
        at = 0
        for k, length in enumerate(lengths):
            part = slice(at, at + length)
            assert int(ordered[k]) == ordered_digest(index[part], content[part])
            assert int(multiset[k]) == multiset_digest(index[part], content[part])
            assert as_int64s(ordered)[k] == as_int64(int(ordered[k]))
            assert mixed[k] == (ordered[k] if which[k] else multiset[k])
            at += length
