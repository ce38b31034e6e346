"""What an incremental check re-reads: the local indices of one (group, request) that can
have changed since the last check, from the rank's own change records.

The records belong to the worker's data structures and reach the checker through the
``RankView`` (``take_written_slots``, ``take_table_changes``), never from the engine's
plans or slot mapping. An entry attention reads for local index ``i`` of a paged group
can only differ from what the last check saw when

* a slot was written since: each written slot is mapped back through the request's block
  table as the checker reads it (local ``i = e * P + slot % P`` for every column ``e``
  whose block holds the slot, ``P`` states a page), so a write into another request's
  block re-verifies that request's index;
* its block-table column changed (set, replaced, nulled, grown or cut off): every local
  index of the column;
* it was not expected at the last check (the committed length grew): the new indices.

Anything else forces a full read of the item (``None``): a request the checker has not
verified yet, one that got or lost its whole row, a ring or a Mamba state (a handful of
entries whose slot moves), or a sharded group whose local numbering does not start at
index 0.
"""

from __future__ import annotations

import numpy as np

from dcpsim.model.distinct import sorted_distinct
from dcpsim.model.kinds import Storage
from dcpsim.model.plan import RequestView
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.oracle import owned_count, retained_start

NO_LOCALS = np.zeros(0, dtype=np.int64)


def expected_span(group: ExpectedGroup, num_committed: int) -> tuple[int, int]:
    """``[first, stop)`` of the indices (positions, or records) the group must hold."""
    if group.storage is Storage.RECORDS:
        return 0, expected_stop(group, num_committed)
    return retained_start(group, num_committed), num_committed


def expected_stop(group: ExpectedGroup, num_committed: int) -> int:
    """The ``stop`` of ``expected_span``: the committed length, in records for a records group."""
    return num_committed // group.tokens_per_state if group.storage is Storage.RECORDS else num_committed


def owned_index(group: ExpectedGroup, rank: int, local: np.ndarray) -> np.ndarray:
    """The index that the rank's ``local``-th owned entry of a sharded group holds."""
    I = group.interleave_size
    run, offset = np.divmod(local, I)
    return run * (I * group.dcp_size) + (offset + rank * I)


def locals_of_slots(row: np.ndarray, slots: np.ndarray, page: int) -> np.ndarray:
    """Local indices that read one of the sorted, distinct ``slots`` through ``row``."""
    if not len(slots) or not len(row):
        return NO_LOCALS
    blocks = slots // page  # sorted, as the slots are: membership by binary search, not np.isin
    lo = np.searchsorted(blocks, row, side="left")
    counts = np.searchsorted(blocks, row, side="right") - lo
    hit = np.flatnonzero(counts)
    if not len(hit):
        return NO_LOCALS
    lo, counts = lo[hit], counts[hit]
    starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
    picked = slots[np.arange(int(counts.sum())) + starts]
    return np.repeat(hit, counts) * page + picked % page


def locals_of_slots_per_row(rows: list[np.ndarray], slots: np.ndarray, page: int, flat: np.ndarray | None = None) -> list[np.ndarray]:
    """``locals_of_slots`` of each of ``rows`` (a group's requests), in one pass (``flat``:
    the rows concatenated, when the caller has them)."""
    return locals_of_slots_groups([rows], [slots], [page], [flat])[0]


def locals_of_slots_groups(rows_of: list[list], slots_of: list[np.ndarray], pages: list[int], flats: list) -> list[list[np.ndarray]]:
    """``locals_of_slots_per_row`` of several groups (each its rows, sorted and distinct written
    slots, page and rows concatenated or None), in one pass over all of them: the blocks of
    group ``k`` are numbered apart from the others' (shifted past them), so one look-up serves all."""
    out = [[NO_LOCALS] * len(rows) for rows in rows_of]
    keys, within, nears, lens, row_pages, whose = [], [], [], [], [], []
    offset = 0
    for k, (rows, slots, page) in enumerate(zip(rows_of, slots_of, pages)):
        if not len(slots) or not rows:
            continue
        flat = np.concatenate(rows) if flats[k] is None else flats[k]
        blocks = slots // page  # sorted, as the slots are
        first, span = int(blocks[0]), int(blocks[-1]) - int(blocks[0]) + 1
        # the columns whose block lies in the written blocks' range, by a table over that
        # range (a pass over the rows at memory speed), then a binary search for those only:
        # a row is the whole context (164K columns at 10M tokens), a step writes a few blocks
        near = flat - first
        nears.append(np.where((near >= 0) & (near < span), near + offset, -1))
        keys.append(blocks + (offset - first))
        within.append(slots % page)
        lens += [len(r) for r in rows]
        row_pages.append(np.full(len(rows), page, dtype=np.int64))
        whose.append(k)
        offset += span
    if not keys:
        return out
    key, within, near = (np.concatenate(x) if len(x) > 1 else x[0] for x in (keys, within, nears))
    written = np.zeros(offset, dtype=bool)
    written[key] = True
    hit = np.flatnonzero(near >= 0)
    hit = hit[written[near[hit]]]
    if not len(hit):
        return out
    lo = np.searchsorted(key, near[hit], side="left")
    counts = np.searchsorted(key, near[hit], side="right") - lo
    starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
    picked = within[np.arange(int(counts.sum())) + starts]
    lens = np.array(lens, dtype=np.int64)
    row_start = np.cumsum(lens) - lens
    owner = np.searchsorted(row_start, hit, side="right") - 1  # the row of each hit column
    page = np.concatenate(row_pages) if len(row_pages) > 1 else row_pages[0]
    local = np.repeat((hit - row_start[owner]) * page[owner], counts) + picked
    bounds = np.searchsorted(np.repeat(owner, counts), np.arange(len(lens) + 1)).tolist()
    first_row = 0
    for k in whose:
        rows = len(rows_of[k])
        out[k] = [local[bounds[first_row + r] : bounds[first_row + r + 1]] for r in range(rows)]
        first_row += rows
    return out


def locals_of_columns(columns: np.ndarray, page: int) -> np.ndarray:
    """Every local index that reads through one of ``columns``."""
    return (np.asarray(columns, np.int64)[:, None] * page + np.arange(page, dtype=np.int64)).reshape(-1)


class ChangeTracker:
    """The checker's memory between checks: the change records of the last interval and
    how far each (group, request) was expected at its last check."""

    def __init__(self, view, store_of: list[int]):
        self.view = view
        self.store_of = store_of
        self.written: list[np.ndarray] = [NO_LOCALS for _ in store_of]
        self.changed: list[dict] = [{} for _ in store_of]
        self.stop: dict[tuple[int, int], int] = {}
        """(group, request) -> the stop of its expected span at its last check."""

    def take(self, views) -> None:
        """Consume the rank's change records (every check, in either mode) and forget the
        requests no longer live: they are read in full if they come back."""
        stores = dict.fromkeys(self.store_of)  # two groups an engine keeps in one store share its record
        written = {s: self.view.take_written_slots(s) for s in stores}
        changed = {s: self.view.take_table_changes(s) for s in stores}
        self.written = [written[s] for s in self.store_of]
        self.changed = [changed[s] for s in self.store_of]
        live = {v.req_index for v in views}
        self.stop = {key: stop for key, stop in self.stop.items() if key[1] in live}

    def checked_all(self, groups: list[ExpectedGroup], views: list) -> None:
        """Every group's requests ``views`` were checked up to their ``expected_stop``."""
        for g, group in enumerate(groups):
            self.stop.update(((g, v.req_index), expected_stop(group, v.num_committed)) for v in views)

    def locals_to_read_groups(self, groups: list[ExpectedGroup], views: list, table: list, rank: int, flats: list) -> list:
        """The sorted local indices of each item to re-read, or None (read all of them; always
        for a ring or state group), item by item (group-major; ``table``: the items' rows,
        ``flats``: each group's concatenated), the written slots of all groups mapped through
        their rows in one pass."""
        n = len(views)
        paged = [g for g, group in enumerate(groups) if group.storage not in (Storage.RING, Storage.STATE)]
        rewritten = locals_of_slots_groups(
            [table[g * n : (g + 1) * n] for g in paged],
            [self.written[g] for g in paged],
            [groups[g].page_states for g in paged],
            [flats[g] for g in paged],
        )
        out = []
        again_of = dict(zip(paged, rewritten))
        for g, group in enumerate(groups):
            if g not in again_of:
                out += [None] * n
                continue
            out += [self._to_read(g, group, v, again, rank) for v, again in zip(views, again_of[g])]
        return out

    def _to_read(self, g: int, group: ExpectedGroup, view: RequestView, rewritten: np.ndarray, rank: int) -> np.ndarray | None:
        """One item's local indices to re-read (``rewritten``: those its row maps the
        written slots to), or None."""
        last = self.stop.get((g, view.req_index))
        changed = self.changed[g].get(view.req_index, NO_LOCALS)
        first, stop = expected_span(group, view.num_committed)
        if last is None or changed is None or stop < last or (group.sharded and first):
            return None
        if group.sharded:
            lo, hi = 0, owned_count(group, rank, stop)
            begin = owned_count(group, rank, last)
        else:
            lo, hi = first, stop
            begin = max(last, first)
        new = np.arange(begin, hi, dtype=np.int64)
        if not len(changed) and (not len(rewritten) or (begin < hi and int(rewritten[0]) >= begin and int(rewritten[-1]) < hi)):
            # only the new indices (sorted, distinct, inside [lo, hi)): most steps, whose
            # writes all map to new indices (``rewritten`` is sorted: by column, then slot)
            return new
        local = np.concatenate([new, rewritten, locals_of_columns(changed, group.page_states)])
        return sorted_distinct(local[(local >= lo) & (local < hi)])


def expected_at(group: ExpectedGroup, view: RequestView, rank: int, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indices and contents rank ``rank`` must hold at the (valid) local indices
    ``local`` of a paged group: ``expected_on_rank`` restricted to them."""
    index = owned_index(group, rank, local) if group.sharded else local
    if group.storage is Storage.RECORDS:
        R = group.tokens_per_state
        return index, view.fingerprints[index * R + R - 1]
    return index, view.fingerprints[index]
