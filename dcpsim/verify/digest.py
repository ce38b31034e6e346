"""Order-sensitive and order-free digests of (index, content) pairs, for the all-gather.

Each rank sends one 64-bit digest per (group, request) instead of its entries: the
multiset digests of a sharded group's ranks must add up to the full context's (every
index exactly once), and the ordered digests of a replicated group's ranks must agree.
"""

from __future__ import annotations

import numpy as np

from dcpsim.model.content import mix64_into

_K1 = np.uint64(0xD6E8FEB86659FD93)
_K2 = np.uint64(0xA0761D6478BD642F)


def _pair_hash(index: np.ndarray, content: np.ndarray) -> np.ndarray:
    # array arithmetic wraps mod 2**64 silently (content.mix64); one new array, hashed in place
    z = np.asarray(index, dtype=np.int64).view(np.uint64) * _K1
    z ^= np.asarray(content).view(np.uint64)
    return mix64_into(z)


def multiset_digest(index: np.ndarray, content: np.ndarray) -> int:
    if not len(index):
        return 0
    return int(_pair_hash(index, content).sum(dtype=np.uint64))


def ordered_digest(index: np.ndarray, content: np.ndarray) -> int:
    if not len(index):
        return 0
    order = np.arange(1, len(index) + 1, dtype=np.uint64) * _K2
    return int(mix64_into(_pair_hash(index, content) ^ order).sum(dtype=np.uint64))


def as_int64(u: int) -> int:
    """A uint64 digest as the int64 with the same bits (for int64 tensors)."""
    return int(np.array([u], dtype=np.uint64).view(np.int64)[0])


def _segment_sums(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The uint64 sum (mod 2**64) of each run of ``lengths`` consecutive ``values``."""
    ends = np.cumsum(lengths)
    running = np.zeros(len(values) + 1, dtype=np.uint64)
    np.cumsum(values, dtype=np.uint64, out=running[1:])
    return running[ends] - running[ends - lengths]


def multiset_digests(index: np.ndarray, content: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``multiset_digest`` of each run of ``lengths`` consecutive pairs, in one pass (uint64)."""
    return _segment_sums(_pair_hash(index, content), lengths)


def ordered_digests(index: np.ndarray, content: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``ordered_digest`` of each run of ``lengths`` consecutive pairs (each run ordered
    from its own first pair), in one pass over all of them (uint64)."""
    return run_digests(index, content, lengths, np.ones(len(lengths), dtype=bool))


def as_int64s(u: np.ndarray) -> np.ndarray:
    """uint64 digests as the int64s with the same bits."""
    return np.asarray(u, dtype=np.uint64).view(np.int64)


def ordered_terms(index: np.ndarray, content: np.ndarray, places: np.ndarray) -> np.ndarray:
    """The term each pair adds to an ordered digest at its place (``places``, from 1 at a
    run's first pair): an ordered digest is their sum (mod 2**64), which lets a kept digest
    be updated term by term (``verify.table_digest``)."""
    return mix64_into(_pair_hash(index, content) ^ np.asarray(places, dtype=np.int64).view(np.uint64) * _K2)


def run_digests(index: np.ndarray, content: np.ndarray, lengths: np.ndarray, ordered: np.ndarray) -> np.ndarray:
    """Per run of ``lengths`` consecutive pairs, its ``ordered_digest`` where ``ordered`` (a
    bool per run) is set, else its ``multiset_digest``; all runs in one pass (uint64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ordered = np.asarray(ordered, dtype=bool)
    values = _pair_hash(index, content)
    if not ordered.any():
        return _segment_sums(values, lengths)
    order = np.arange(1, len(values) + 1, dtype=np.int64)
    if len(lengths) > 1:
        order -= np.repeat(np.cumsum(lengths) - lengths, lengths)
    if ordered.all():  # no mask (a replicated group's runs, the block tables)
        return _segment_sums(mix64_into(values ^ order.view(np.uint64) * _K2), lengths)
    each = np.repeat(ordered, lengths)
    values[each] = mix64_into(values[each] ^ order[each].view(np.uint64) * _K2)
    return _segment_sums(values, lengths)
