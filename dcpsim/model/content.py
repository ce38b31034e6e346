"""What a KV entry holds: token streams and their prefix fingerprints.

Real KV at position ``p`` depends on every token up to ``p``; dcpsim stands
for it with a 64-bit prefix fingerprint ``fp[p] = mix(h[p])`` where
``h[p] = h[p-1] * K + token[p]`` (mod 2**64). Two requests that share a
prefix share fingerprints over it (so a prefix-cache hit is checkable), and a
rejected draft token changes the fingerprint of its position (so a stale,
never-rewritten entry is caught).

Pure numpy; the polynomial hash is vectorised with an inverse-power cumsum
(``K`` is odd, hence invertible mod 2**64), a chunk of ``HASH_CHUNK`` positions at a time.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

_K = np.uint64(0x9E3779B97F4A7C15 | 1)
_K_INV = np.uint64(pow(int(_K), -1, 2**64))
VOCAB = 50_000


def stable_seed(*parts) -> list[int]:
    """A numpy seed sequence key from strings and ints, stable across processes."""
    return [zlib.crc32(str(p).encode()) if not isinstance(p, int) else p & 0xFFFFFFFF for p in parts]


def random_tokens(seed_key: list[int], n: int) -> np.ndarray:
    return np.random.default_rng(seed_key).integers(1, VOCAB, size=n, dtype=np.int64)


def mix64(h: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads every input bit over the output. Array arithmetic wraps
    mod 2**64 without a warning (only numpy scalars warn), so no ``errstate`` is needed: it
    cost more than the hashing on the small arrays of a decode step."""
    return mix64_into(np.asarray(h).astype(np.uint64))


def mix64_into(z: np.ndarray) -> np.ndarray:
    """``mix64`` of a uint64 array the caller owns (a temporary of its own), in place: no copy."""
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def powers(base: np.uint64, n: int, block: int = 1024) -> np.ndarray:
    """``base**i`` for ``i`` in ``[0, n)``, mod 2**64: a short running product and one of
    ``base**block``, multiplied as an outer product (numpy's uint64 ``cumprod`` over millions
    of elements is ~20x slower than this)."""
    with np.errstate(over="ignore"):
        small = np.full(max(1, min(block, n)), base, dtype=np.uint64)
        small[0] = 1
        small = np.cumprod(small, dtype=np.uint64)
        big = np.full(max(1, -(-n // block)), np.uint64(pow(int(base), block, 2**64)), dtype=np.uint64)
        big[0] = 1
        big = np.cumprod(big, dtype=np.uint64)
        return (big[:, None] * small[None, :]).ravel()[:n]


HASH_CHUNK = 1 << 16
"""Positions hashed (and fingerprinted) at a time: a chunk's few arrays stay in the cache,
where whole-stream passes over a 10M-token request went at memory speed (about 8x the CPU)."""


@functools.cache
def _chunk_powers(chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """``K**-i`` for ``i < chunk`` and ``K**i`` for ``i <= chunk`` (read-only)."""
    inverse, forward = powers(_K_INV, chunk), powers(_K, chunk + 1)
    inverse.flags.writeable = forward.flags.writeable = False
    return inverse, forward


def raw_prefix_hash(tokens: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``h[p] = sum_{i<=p} tok[i] * K**(p-i)`` for every p, mod 2**64 (into ``out``, a uint64
    array of the tokens' length, if given). A chunk starting at ``s`` is
    ``cumsum(tok * K**-j) * K**j`` over its own positions ``j``, plus the hash carried in,
    ``h[s-1] * K**(j+1)``."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int64).view(np.uint64)  # tokens are >= 0
    n = len(tokens)
    out = np.empty(n, dtype=np.uint64) if out is None else out
    chunk = HASH_CHUNK
    inverse, forward = _chunk_powers(chunk)
    work = np.empty(min(n, chunk), dtype=np.uint64)
    carry = 0
    for start in range(0, n, chunk):
        m = min(n - start, chunk)
        acc, h = work[:m], out[start : start + m]
        np.multiply(tokens[start : start + m], inverse[:m], out=acc)
        np.cumsum(acc, out=acc)
        np.multiply(acc, forward[:m], out=h)
        if carry:
            np.multiply(forward[1 : m + 1], np.uint64(carry), out=acc)
            h += acc
        carry = int(h[-1])
    return out


def prefix_fingerprints(tokens: np.ndarray, raw: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Fingerprint of every prefix of ``tokens`` as int64 (never -1 in practice; into ``out``,
    an int64 array of their length, if given); ``raw``: their ``raw_prefix_hash`` if already
    computed. Mixed a chunk at a time (see ``HASH_CHUNK``)."""
    if raw is None:
        raw = raw_prefix_hash(tokens)
    out, chunk = np.empty(len(raw), dtype=np.int64) if out is None else out, HASH_CHUNK
    mixed = out.view(np.uint64)
    for start in range(0, len(raw), chunk):
        part = mixed[start : start + chunk]
        part[:] = raw[start : start + chunk]
        mix64_into(part)
    return out


def extend_fingerprints(raw_before: int, new_tokens) -> np.ndarray:
    """Fingerprints of ``new_tokens`` appended to a prefix whose raw hash is
    ``raw_before`` (0 for an empty prefix): used for draft tokens."""
    out = np.empty(len(new_tokens), dtype=np.uint64)
    h = int(raw_before)
    for j, tok in enumerate(new_tokens):
        h = (h * int(_K) + int(tok)) % 2**64
        out[j] = h
    return mix64_into(out).view(np.int64)
