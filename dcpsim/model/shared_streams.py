"""A world's long token streams, drawn and hashed once, mapped read-only by every rank.

Every rank of a world draws the same requests' token streams and hashes them
(``model.content``): at 10M tokens three 80 MB arrays a rank, the tokens, their raw prefix
hashes and their fingerprints, of which a rank reads all the fingerprints but the tokens
and raw hashes only where drafts are made. So before a world starts, the launcher writes the
streams of every long request (``SHARE_MIN_TOKENS`` tokens or more, no shared prefix) to
``.npy`` files in a temp directory once (``write_streams``), and each rank maps them
(``attach``): no rank draws or hashes them again, and only the pages a rank reads count in
its memory. A request's streams are a function of the scenario's seed, its id and its
length alone, drawn and hashed here as the request itself draws them
(``engine.scheduler.request.Request.tokens``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from dcpsim.model.content import prefix_fingerprints, random_tokens, raw_prefix_hash, stable_seed
from dcpsim.model.scenario import RequestSpec

SHARE_MIN_TOKENS = 1 << 18
"""Streams at least this long are shared; a shorter request costs its ranks less than a file."""
_MANIFEST = "streams.json"
_FIELDS = ("tokens", "raw", "fingerprints")


@dataclass(frozen=True)
class Streams:
    """One request's token stream and its prefix hashes (``model.content``), position by position."""

    tokens: np.ndarray
    raw: np.ndarray
    fingerprints: np.ndarray


def stream_key(seed: int, spec: RequestSpec) -> tuple[int, str, int]:
    """What a request's streams depend on: the scenario's seed, its id and its length."""
    return (seed, spec.request_id, spec.prompt_len + spec.output_len)


def shareable(spec: RequestSpec) -> bool:
    """A long request whose tokens are all its own (none drawn for a shared prefix)."""
    return spec.shared_prefix_len == 0 and spec.prompt_len + spec.output_len >= SHARE_MIN_TOKENS


def write_streams(seed_and_specs, directory: str) -> int:
    """Write the streams of every shareable request of ``(seed, spec)`` pairs to ``directory``
    (each once; hashed straight into the files); return how many were written."""
    keys = list(dict.fromkeys(stream_key(seed, spec) for seed, spec in seed_and_specs if shareable(spec)))
    manifest = []
    for k, (seed, request_id, n) in enumerate(keys):
        files = {field: os.path.join(directory, f"{k}-{field}.npy") for field in _FIELDS}
        tokens = random_tokens(stable_seed(seed, "request", request_id), n)
        np.save(files["tokens"], tokens)
        raw = raw_prefix_hash(tokens, out=np.lib.format.open_memmap(files["raw"], mode="w+", dtype=np.uint64, shape=(n,)))
        prefix_fingerprints(tokens, raw, out=np.lib.format.open_memmap(files["fingerprints"], mode="w+", dtype=np.int64, shape=(n,)))
        del raw  # the maps close; the pages stay in the files
        manifest.append([seed, request_id, n, k])
    with open(os.path.join(directory, _MANIFEST), "w") as f:
        json.dump(manifest, f)
    return len(keys)


_attached: dict[tuple[int, str, int], tuple[str, int]] = {}
"""This process's shared streams: key -> (directory, file number). A rank process runs one world."""


def attach(directory: str | None) -> None:
    """Use the streams written to ``directory`` (None: none) for the rest of this process."""
    _attached.clear()
    if directory is None:
        return
    with open(os.path.join(directory, _MANIFEST)) as f:
        for seed, request_id, n, k in json.load(f):
            _attached[(seed, request_id, n)] = (directory, k)


def shared_streams(seed: int, spec: RequestSpec) -> Streams | None:
    """The request's streams as written by the launcher, mapped read-only; None if not shared."""
    where = _attached.get(stream_key(seed, spec)) if spec.shared_prefix_len == 0 else None
    if where is None:
        return None
    directory, k = where
    return Streams(*(_mapped(os.path.join(directory, f"{k}-{field}.npy")) for field in _FIELDS))


def _mapped(path: str) -> np.ndarray:
    """The ``.npy`` file's array, mapped read-only (a plain ndarray view of the map)."""
    return np.asarray(np.load(path, mmap_mode="r"))
