"""Shards of a correctness matrix, so that CI fans it out over machines, and their merge.

A matrix's cells run in worlds, one per (scenario, W). The pending cells of each world,
in list order, are cut into *work units* of at most ``UNIT`` cells (one world start each).
``--shard K/N`` (1-based) takes the units that a greedy balance gives shard ``K``: units
by descending cost (``W`` ranks x cells), each to the shard with the least cost so far
(ties to the lowest ``K``); skipped cells go round-robin. Everything depends only on the
full cell list, so every machine computes the same partition, and no shard starts a world
for a single cell (as ``index % N`` would, for N near a world's cell count).

Every cell of a shard's ``matrix --json`` list says which matrix and shard it belongs to:
``"index"`` (its place in the full list) and ``"matrix": {"hash", "cells", "shard"}``,
where ``hash`` covers the full list of cell ids and the engine. ``merge`` checks that the
shards are of one matrix, that each of shards 1..N is there exactly once and that their
cells are the whole list, each once; it returns the cells in list order.
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


UNIT = 12


def work_units(results: list) -> list[list[int]]:
    """Indices of the pending cells, cut into runs of at most ``UNIT`` cells of one world."""
    groups: dict[str, list[int]] = {}
    for i, res in enumerate(results):
        if res.status == "pending":
            groups.setdefault(res.cell.group, []).append(i)
    return [idx[j : j + UNIT] for idx in groups.values() for j in range(0, len(idx), UNIT)]


def unit_cost(results: list, unit: list[int]) -> int:
    """A unit's estimated cost: rank processes x cells."""
    return sum(results[i].cell.dcp for i in unit)


def partition(results: list, n: int) -> list[list[int]]:
    """The cell indices of shards 1..n (each sorted); see the module doc."""
    shards: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    units = work_units(results)
    for u in sorted(units, key=lambda u: (-unit_cost(results, u), u[0])):
        k = min(range(n), key=lambda j: (load[j], j))
        shards[k] += u
        load[k] += unit_cost(results, u)
    skipped = [i for i, res in enumerate(results) if res.status != "pending"]
    for j, i in enumerate(skipped):
        shards[j % n].append(i)
    return [sorted(s) for s in shards]


def select(results: list, k: int, n: int) -> list[int]:
    """The indices of shard ``k`` of ``n`` (1-based); a ``ConfigError`` if some shard would be
    empty (more shards than work units)."""
    units = len(work_units(results))
    if n > max(units, 1):
        raise ConfigError(
            f"--shard {k}/{n}: the matrix has only {plural(units, 'work unit')} "
            f"(runs of at most {UNIT} cells of one world) to share out; use N <= {max(units, 1)}"
        )
    return partition(results, n)[k - 1]


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
    return _cells_in_order(shards, _matrix_size(shards))


def _matrix_size(shards: list[tuple[str, list[dict]]]) -> int:
    """The number of cells of the one matrix the shards belong to; a ``ConfigError`` unless
    they are of one matrix (hash, cell count and shard count alike) and each of its shards
    1..N is there exactly once."""
    seen: dict[int, str] = {}
    first_path, meta0 = None, None
    for path, entries in shards:
        digest, total, shard = _shard_record(path, entries)
        k, n = parse_shard(shard, f"{path}: matrix.shard")
        if meta0 is None:
            first_path, meta0 = path, (digest, total, n)
        elif (digest, total, n) != meta0:
            raise ConfigError(
                f"{path} and {first_path} are not shards of one matrix: "
                f"hash {digest} vs {meta0[0]}, {total} vs {meta0[1]} cells, {n} vs {meta0[2]} shards"
            )
        if k in seen:
            raise ConfigError(f"shard {k}/{n} given twice: {seen[k]} and {path}")
        seen[k] = path
    digest, total, n = meta0
    missing = [k for k in range(1, n + 1) if k not in seen]
    if missing:
        raise ConfigError(f"missing {plural(len(missing), 'shard')} of {n}: " + ", ".join(f"{k}/{n}" for k in missing))
    return total


def _shard_record(path: str, entries) -> tuple:
    """``(hash, cells, shard)``: the matrix record that every cell of one shard's report
    carries; a ``ConfigError`` naming the file if it is no shard report or its cells disagree."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: not a matrix shard report (expected a non-empty list of cells)")
    metas = [_cell_record(path, entry) for entry in entries]
    if len(set(metas)) != 1:
        raise ConfigError(f"{path}: its cells belong to different matrices or shards")
    return metas[0]


def _cell_record(path: str, entry) -> tuple:
    """``(hash, cells, shard)`` of one cell entry's matrix record; a ``ConfigError`` if it has none."""
    meta = entry.get("matrix") if isinstance(entry, dict) else None
    if not isinstance(meta, dict) or not isinstance(entry.get("index"), int):
        raise ConfigError(
            f"{path}: cell {entry.get('cell') if isinstance(entry, dict) else entry!r} has no "
            "matrix shard record (index, matrix); run matrix with --shard K/N --json"
        )
    return meta.get("hash"), meta.get("cells"), meta.get("shard")


def _cells_in_order(shards: list[tuple[str, list[dict]]], total: int) -> list[dict]:
    """Every shard's cells by their index in the matrix of ``total`` cells; a ``ConfigError``
    for an index outside it, a cell in two shards, or cells missing."""
    cells: dict[int, dict] = {}
    source: dict[int, str] = {}
    for path, entries in shards:
        for entry in entries:
            i = entry["index"]
            if not 0 <= i < total:
                raise ConfigError(f"{path}: cell {entry.get('cell')!r} has index {i}, outside the matrix's {total} cells")
            if i in cells:
                raise ConfigError(f"cell {entry.get('cell')!r} (index {i}) is in both {source[i]} and {path}")
            cells[i], source[i] = entry, path
    if len(cells) != total:
        raise ConfigError(f"the shards hold {len(cells)} of the matrix's {total} cells")
    return [cells[i] for i in range(total)]
