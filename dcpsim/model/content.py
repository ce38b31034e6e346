"""What a KV entry holds: token streams and their prefix fingerprints.

Real KV at position ``p`` depends on every token up to ``p``; dcpsim stands
for it with a 64-bit prefix fingerprint ``fp[p] = mix(h[p])`` where
``h[p] = h[p-1] * K + token[p]`` (mod 2**64). Two requests that share a
prefix share fingerprints over it (so a prefix-cache hit is checkable), and a
rejected draft token changes the fingerprint of its position (so a stale,
never-rewritten entry is caught).

Pure numpy; the polynomial hash is vectorised with an inverse-power cumsum
(``K`` is odd, hence invertible mod 2**64).
"""

from __future__ import annotations

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
    """splitmix64 finaliser: spreads every input bit over the output."""
    with np.errstate(over="ignore"):
        z = h.astype(np.uint64, copy=True)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def raw_prefix_hash(tokens: np.ndarray) -> np.ndarray:
    """``h[p] = sum_{i<=p} tok[i] * K**(p-i)`` for every p, mod 2**64."""
    n = len(tokens)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        pows = np.empty(n, dtype=np.uint64)
        pows[0] = 1
        inv = np.empty(n, dtype=np.uint64)
        inv[0] = 1
        if n > 1:
            pows[1:] = _K
            inv[1:] = _K_INV
            pows = np.cumprod(pows, dtype=np.uint64)
            inv = np.cumprod(inv, dtype=np.uint64)
        acc = np.cumsum(tokens.astype(np.uint64) * inv, dtype=np.uint64)
        return acc * pows


def prefix_fingerprints(tokens: np.ndarray) -> np.ndarray:
    """Fingerprint of every prefix of ``tokens`` as int64 (never -1 in practice)."""
    return mix64(raw_prefix_hash(np.asarray(tokens, dtype=np.int64))).view(np.int64)


def extend_fingerprints(raw_before: int, new_tokens) -> np.ndarray:
    """Fingerprints of ``new_tokens`` appended to a prefix whose raw hash is
    ``raw_before`` (0 for an empty prefix): used for draft tokens."""
    out = np.empty(len(new_tokens), dtype=np.uint64)
    h = int(raw_before)
    for j, tok in enumerate(new_tokens):
        h = (h * int(_K) + int(tok)) % 2**64
        out[j] = h
    return mix64(out).view(np.int64)
