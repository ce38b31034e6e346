"""Shards of a correctness matrix, so that CI fans it out over machines, and their merge.

``--shard K/N`` (1-based) keeps cell ``i`` of the matrix's full cell list (0-based, skipped
cells included) when ``i % N == K - 1``. The list and its order depend only on the
scenarios and the grid flags, so every machine computes the same partition; round-robin
gives every shard a like mix of cheap and costly cells.

Every cell of a shard's ``matrix --json`` list says which matrix and shard it belongs to:
``"index"`` (its place in the full list) and ``"matrix": {"hash", "cells", "shard"}``,
where ``hash`` covers the full list of cell ids and the engine. ``merge`` checks that the
shards are of one matrix, that each of shards 1..N is there exactly once and that their
cells are the whole list; it then returns the cells in list order (JSON) for
``junit.write`` or the same list format.
"""

from __future__ import annotations

import hashlib
import json

from dcpsim.errors import ConfigError
from dcpsim.plural import plural


def parse_shard(text: str, flag: str = "--shard") -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``1 <= K <= N``; anything else is a ``ConfigError``."""
    parts = str(text).split("/")
    try:
        k, n = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        k = n = None
    if k is None or n is None or n < 1 or not 1 <= k <= n:
        raise ConfigError(f"{flag}: expected K/N with 1 <= K <= N (e.g. 2/4), got {text!r}")
    return k, n


def select(items: list, k: int, n: int) -> list:
    """Shard ``k`` of ``n`` (1-based) of ``items``: those at index ``i`` with ``i % n == k - 1``."""
    return [x for i, x in enumerate(items) if i % n == k - 1]


def matrix_hash(cell_ids: list[str], engine: dict | None = None) -> str:
    """A short digest of the full cell list (ids, in order) and the engine options."""
    text = "\n".join(cell_ids) + "\n" + json.dumps(engine or {}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stamp(entries: list[dict], indices: list[int], *, digest: str, total: int, shard: tuple[int, int]) -> None:
    """Mark each cell entry of a shard's JSON list with its index and the matrix it belongs to."""
    for entry, index in zip(entries, indices):
        entry["index"] = index
        entry["matrix"] = {"hash": digest, "cells": total, "shard": f"{shard[0]}/{shard[1]}"}


def merge(shards: list[tuple[str, list[dict]]]) -> list[dict]:
    """The cells of every shard ``(path, cell entries)`` in matrix order; a ``ConfigError``
    naming the files if they are not exactly shards 1..N of one matrix."""
    if not shards:
        raise ConfigError("merge: no shard reports given")
    seen: dict[int, str] = {}
    first_path, meta0 = None, None
    for path, entries in shards:
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{path}: not a matrix shard report (expected a non-empty list of cells)")
        metas = []
        for entry in entries:
            meta = entry.get("matrix") if isinstance(entry, dict) else None
            if not isinstance(meta, dict) or not isinstance(entry.get("index"), int):
                raise ConfigError(f"{path}: cell {entry.get('cell') if isinstance(entry, dict) else entry!r} has no "
                                  "matrix shard record (index, matrix); run matrix with --shard K/N --json")
            metas.append((meta.get("hash"), meta.get("cells"), meta.get("shard")))
        if len(set(metas)) != 1:
            raise ConfigError(f"{path}: its cells belong to different matrices or shards")
        digest, total, shard = metas[0]
        k, n = parse_shard(shard, f"{path}: matrix.shard")
        if meta0 is None:
            first_path, meta0 = path, (digest, total, n)
        elif (digest, total, n) != meta0:
            raise ConfigError(f"{path} and {first_path} are not shards of one matrix: "
                              f"hash {digest} vs {meta0[0]}, {total} vs {meta0[1]} cells, {n} vs {meta0[2]} shards")
        if k in seen:
            raise ConfigError(f"shard {k}/{n} given twice: {seen[k]} and {path}")
        seen[k] = path
    digest, total, n = meta0
    missing = [k for k in range(1, n + 1) if k not in seen]
    if missing:
        raise ConfigError(f"missing {plural(len(missing), 'shard')} of {n}: "
                          + ", ".join(f"{k}/{n}" for k in missing))
    cells: dict[int, dict] = {}
    for path, entries in shards:
        k, _ = parse_shard(entries[0]["matrix"]["shard"])
        for entry in entries:
            i = entry["index"]
            if i in cells or i % n != k - 1 or not 0 <= i < total:
                raise ConfigError(f"{path}: cell {entry.get('cell')!r} (index {i}) does not belong to shard {k}/{n} "
                                  f"of {total} cells, or is listed twice")
            cells[i] = entry
    if len(cells) != total:
        raise ConfigError(f"the shards hold {len(cells)} of the matrix's {total} cells")
    return [cells[i] for i in range(total)]
