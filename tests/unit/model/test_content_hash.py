"""``model.content``: the vectorised prefix hash equals its definition
``h[p] = h[p-1] * K + token[p]`` (mod 2**64) at every length, across the power table's
block seams, and a draft's ``extend_fingerprints`` continues it."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.model import content


def sequential_hash(tokens) -> list[int]:
    h, out = 0, []
    for tok in tokens:
        h = (h * int(content._K) + int(tok)) % 2**64
        out.append(h)
    return out


@pytest.mark.parametrize("n", [0, 1, 2, 3, 1023, 1024, 1025, 2048, 2049, 3000])
def test_raw_prefix_hash_is_the_polynomial_hash(n):
    tokens = content.random_tokens([7, n], n)
    assert content.raw_prefix_hash(tokens).tolist() == sequential_hash(tokens)


@pytest.mark.parametrize("n,block", [(1, 4), (4, 4), (5, 4), (17, 4), (100, 7)])
def test_powers_across_block_seams(n, block):
    want = [pow(int(content._K), i, 2**64) for i in range(n)]
    assert content.powers(content._K, n, block).tolist() == want


def test_fingerprints_reuse_the_raw_hash_and_extend_for_drafts():
    tokens = content.random_tokens([9], 2000)
    raw = content.raw_prefix_hash(tokens)
    fp = content.prefix_fingerprints(tokens)
    assert np.array_equal(fp, content.prefix_fingerprints(tokens, raw))
    assert np.array_equal(fp, content.mix64(np.array(sequential_hash(tokens), dtype=np.uint64)).view(np.int64))
    assert np.array_equal(content.extend_fingerprints(int(raw[1499]), tokens[1500:]), fp[1500:])
    assert len(set(fp.tolist())) == len(fp)  # distinct prefixes, distinct fingerprints


@pytest.mark.parametrize("n", [1, 4, 5, 9, 10, 11, 23])
def test_chunked_hash_carries_across_chunk_seams(monkeypatch, n):
    """The hash goes a chunk at a time (``HASH_CHUNK``); a small chunk puts seams at every
    few positions, and each chunk must carry in the hash of all positions before it."""
    monkeypatch.setattr(content, "HASH_CHUNK", 5)
    tokens = content.random_tokens([11, n], n)
    want = sequential_hash(tokens)
    assert content.raw_prefix_hash(tokens).tolist() == want
    assert np.array_equal(content.prefix_fingerprints(tokens), content.mix64(np.array(want, dtype=np.uint64)).view(np.int64))


def test_hash_of_a_long_stream_across_the_real_chunk_seam():
    n = 2 * content.HASH_CHUNK + 3
    tokens = content.random_tokens([13], n)
    assert content.raw_prefix_hash(tokens).tolist() == sequential_hash(tokens)
