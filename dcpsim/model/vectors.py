"""Deterministic stand-ins for real activations: K/V per stored entry, queries per token.

A K/V vector is a function of (group, content fingerprint) only, so an entry written
with the wrong content (a stale rejected draft, a wrong prefix, another request's
entry) carries different vectors, while two requests sharing a prefix share them.
A query is a function of (group, request, position, content).

Each element is a splitmix64 hash of (seed, element index) mapped to a uniform value in
``[-sqrt(3), sqrt(3))`` (unit variance), computed for a whole ``[n, width]`` array at
once. float32 throughout, exact (24 random bits per element).
"""

from __future__ import annotations

import math

import numpy as np

from dcpsim.model.content import mix64_into

_GROUP_SALT = np.uint64(0x8CB92BA72F3D8DD7)
_ELEM_STEP = np.uint64(0x9E3779B97F4A7C15)
_QUERY_SALT = np.uint64(0x5851F42D4C957F2D)
_POS_MUL = np.uint64(0xD1342543DE82EF95)
_HEAD_MUL = np.uint64(0xA0761D6478BD642F)
_REQ_MUL = np.uint64(0xC6A4A7935BD1E995)
_HALF_RANGE = np.float32(math.sqrt(3.0))


def _u64(values) -> np.ndarray:
    """int64 (possibly negative) or uint64 values as uint64, modulo 2**64."""
    return np.asarray(values).astype(np.uint64)


def uniform_rows(seeds: np.ndarray, width: int) -> np.ndarray:
    """``[len(seeds), width]`` float32 values, uniform in [-sqrt 3, sqrt 3), one row per seed."""
    seeds = _u64(seeds)
    with np.errstate(over="ignore"):
        elems = np.arange(1, width + 1, dtype=np.uint64) * _ELEM_STEP
        h = mix64_into(seeds[:, None] + elems[None, :])
    unit = (h >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # [0, 1), exact
    return (unit * np.float32(2.0) - np.float32(1.0)) * _HALF_RANGE


_BLOCK = 1 << 14  # rows hashed at a time: bounds the uint64 temporaries of long contexts


def kv_vectors(group_id: int, contents, width: int, kv_head: int | None = None) -> np.ndarray:
    """K and V (concatenated, ``[n, width]`` float32) of entries with ``contents`` in a group;
    with ``kv_head``, of that KV head (its global index, semantics section 12 "Heads"): each KV
    head of a token carries its own vectors, so a query read against another head differs.
    ``None``: the group's single KV head (an MLA latent, or a scenario that states no heads)."""
    with np.errstate(over="ignore"):
        salt = np.uint64(group_id + 1) * _GROUP_SALT
        if kv_head is not None:
            salt = mix64_into(np.asarray([salt ^ (np.uint64(kv_head + 1) * _HEAD_MUL)], dtype=np.uint64))[0]
        seeds = mix64_into(_u64(contents) ^ salt)
    if len(seeds) <= _BLOCK:
        return uniform_rows(seeds, width)
    out = np.empty((len(seeds), width), dtype=np.float32)
    for i in range(0, len(seeds), _BLOCK):
        out[i : i + _BLOCK] = uniform_rows(seeds[i : i + _BLOCK], width)
    return out


def query_vectors(group_id: int, req_index: int, positions, contents, heads: int, dim: int) -> np.ndarray:
    """Queries ``[q, heads, dim]`` float32 of a request's tokens at ``positions`` with ``contents``."""
    positions = _u64(positions)
    with np.errstate(over="ignore"):
        base = mix64_into(positions * _POS_MUL + np.uint64(req_index + 1) * _REQ_MUL + np.uint64(group_id + 1) * _GROUP_SALT + _QUERY_SALT)
        seeds = mix64_into(_u64(contents) ^ base)
    return uniform_rows(seeds, heads * dim).reshape(len(positions), heads, dim)


class KVVectors:
    """The write path's vector function: ``kv(group_id, contents) -> [n, width]`` float32."""

    def __init__(self, width: int):
        self.width = width

    def __call__(self, group_id: int, contents) -> np.ndarray:
        return kv_vectors(group_id, contents, self.width)
