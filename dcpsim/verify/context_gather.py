"""The checker's expectation of a step's context gather (``docs/dcp-semantics.md`` section 10).

From the step's plan and the checker's own geometry: the prefill rows (more than ``1 + k``
query tokens) with a cached context (their write starts past 0), packed in batch order into
chunks of workspace rows; a rank gathers, of an entry covering context tokens ``[s, e)``,
exactly the keys of its shard among them, counted with ``owned_below`` (its runs of ``I``
below a length), and reads them through its block-table row. Written apart from the
engine's ``model.context_gather``: the packing walks down the split length one alignment
at a time, and the rows a piece takes are rank 0's keys of whole interleave runs.
"""

from __future__ import annotations

import math

import numpy as np

from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import StepPlan
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.metadata import MetadataJudge, kernel_states, owned_below, show

WORKSPACE_CAP = 65536


def gathered_group(group: ExpectedGroup) -> bool:
    """Whether a group's prefills gather their context: paged full attention (MLA's rule)."""
    return group.storage is Storage.PAGED and group.retention is Retention.FULL


def expected_workspace(group: ExpectedGroup, config) -> int:
    """The workspace rows: the configured size or vLLM's rule, rounded up to the alignment."""
    B = group.block_size
    want = config.chunked_prefill_workspace_size
    if want is None:
        want = min(WORKSPACE_CAP, max(config.max_model_len * 8, config.max_num_seqs * B * 4))
    unit = B if not group.sharded else B * group.dcp_size * group.interleave_size // math.gcd(B, group.dcp_size * group.interleave_size)
    return max(want + (-want) % unit, unit)


def _ranks(group: ExpectedGroup) -> int:
    return group.dcp_size if group.sharded else 1


def _rows(group: ExpectedGroup, tokens: int) -> int:
    """Workspace rows per rank of ``tokens`` context tokens: whole interleave runs of rank 0."""
    W = _ranks(group)
    if W == 1:
        return tokens
    runs_per_round = W * group.interleave_size
    return (tokens + runs_per_round - 1) // runs_per_round * group.interleave_size


def expected_entries(group: ExpectedGroup, contexts: list[int], workspace: int) -> list[tuple[int, int, int, int]]:
    """``(chunk, row, start, length)`` of every entry; ``row`` indexes ``contexts``.

    Request by request, not chunk by chunk: a row's context goes, in order, into what is left
    of the open chunk (whole, or the longest split that room takes), then into fresh chunks
    of ``whole`` tokens while the rest needs more rows than a chunk has, then its rest opens
    the chunk the next row packs into; an empty context closes an open chunk. Splits are
    whole multiples of the alignment, so a split's rows are its tokens over ``W``. The same
    entries as ``expected_entries_walked``, which it falls back to when a chunk cannot take
    one alignment."""
    W = _ranks(group)
    step = group.block_size if W == 1 else math.lcm(group.block_size, W * group.interleave_size)
    budget, biggest = workspace // W, workspace - workspace % step
    whole = min(biggest, budget * W // step * step)  # a fresh chunk's split of a longer context
    if whole <= 0:
        return expected_entries_walked(group, contexts, workspace)
    most = budget if W == 1 else budget // group.interleave_size * W * group.interleave_size  # the longest rest a chunk takes
    entries: list[tuple[int, int, int, int]] = []
    chunk, room = 0, budget
    for i, c in enumerate(contexts):
        if not c:
            chunk, room = chunk + (room < budget), budget
            continue
        if _rows(group, c) <= room:
            entries.append((chunk, i, 0, c))
            room -= _rows(group, c)
            continue
        start = max(0, min(whole, (c - 1) // step * step, room * W // step * step))
        if start:
            entries.append((chunk, i, 0, start))
        chunk += 1 if start or room < budget else 0
        rest = c - start
        if rest > most:
            pieces = (rest - most + whole - 1) // whole
            entries.extend((chunk + j, i, start + j * whole, whole) for j in range(pieces))
            chunk, start, rest = chunk + pieces, start + pieces * whole, rest - pieces * whole
        entries.append((chunk, i, start, rest))
        room = budget - _rows(group, rest)
    return entries


def expected_entries_walked(group: ExpectedGroup, contexts: list[int], workspace: int) -> list[tuple[int, int, int, int]]:
    """``expected_entries`` from scratch: chunk after chunk, each split walked down one
    alignment at a time."""
    W = _ranks(group)
    step = group.block_size if W == 1 else math.lcm(group.block_size, W * group.interleave_size)
    budget, biggest = workspace // W, workspace - workspace % step
    entries, chunk, i, start = [], 0, 0, 0
    while i < len(contexts):
        if not contexts[i]:
            i += 1
            continue
        room, took = budget, False
        while i < len(contexts) and contexts[i]:
            cost = _rows(group, contexts[i]) - _rows(group, start)
            if cost <= room:
                entries.append((chunk, i, start, contexts[i] - start))
                room, took, i, start = room - cost, True, i + 1, 0
                continue
            n = min(biggest, (contexts[i] - start - 1) // step * step)
            while n > 0 and _rows(group, start + n) - _rows(group, start) > room:
                n -= step
            if n > 0:
                entries.append((chunk, i, start, n))
                start, took = start + n, True
            break
        chunk += 1 if took else 0
    return entries


def expected_gather(group: ExpectedGroup, plan: StepPlan, rows: dict, rank: int, workspace: int, kept: dict | None = None) -> dict | None:
    """Every field of the rank's gather of this group in this step (None: no gather).
    ``kept``: request id -> the slots of its local keys kept from the group's earlier steps
    (``MetadataJudge.gather_slots`` of the group's store), updated to this step's requests
    (None: every slot derived again). ``every_slot``: every entry's slots, in order."""
    prefills = [w for w in plan.writes if w.stop - w.start > 1 + group.num_speculative_tokens]
    contexts = [w.start for w in prefills]
    entries = expected_entries(group, contexts, workspace)
    if not entries:
        if kept is not None:
            kept.clear()
        return None
    chunks, which, starts, lengths = (np.array(column, dtype=np.int64) for column in zip(*entries))
    ends = np.minimum(starts + lengths, np.array(contexts, dtype=np.int64)[which])
    lo, hi = owned_below(starts, rank, group), owned_below(ends, rank, group)
    if kept is None:
        req_rows = [np.asarray(rows.get(prefills[i].req_index, np.zeros(0, np.int64)), dtype=np.int64) for i in which.tolist()]
        slots = [_slots(group, row, np.arange(a, b, dtype=np.int64)) for row, a, b in zip(req_rows, lo.tolist(), hi.tolist())]
        every = np.concatenate(slots) if slots else np.zeros(0, np.int64)
    else:
        # runs of entries of one request whose local keys follow on: (request, first key, past the last)
        cut = np.flatnonzero((which[1:] != which[:-1]) | (lo[1:] != hi[:-1])) + 1
        firsts, lasts = np.r_[0, cut], np.r_[cut, len(which)] - 1
        runs = list(zip(which[firsts].tolist(), lo[firsts].tolist(), hi[lasts].tolist()))
        now: dict = {}
        slots, every = _kept_slots(group, prefills, rows, runs, lo, hi, which, kept, now)
        kept.clear()
        kept.update(now)
    return dict(
        request_ids=tuple(prefills[i].request_id for i in which.tolist()),
        chunks=chunks,
        starts=starts,
        seq_lens=lengths,
        local_starts=lo,
        local_seq_lens=hi - lo,
        slots=slots,
        every_slot=every,
        workspace_size=workspace,
    )


def _slots(group: ExpectedGroup, row: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The slots of local keys through a block-table row (-1 past it)."""
    kernel = kernel_states(group)
    per_block = group.page_states // kernel
    page, offset = keys // kernel, keys % kernel
    entry = page // per_block
    inside = entry < len(row)
    slots = np.full(len(keys), -1, np.int64)
    slots[inside] = (row[entry[inside]] * per_block + page[inside] % per_block) * kernel + offset[inside]
    return slots


class _Kept:
    """One request's slots of its local keys ``[0, count)`` (``values``, never rewritten
    below ``count``), through ``row``, the request's row when they were derived."""

    def __init__(self, row: np.ndarray, size: int):
        self.row, self.values, self.count = row, np.empty(size, np.int64), 0


def _kept_slots(group, prefills, rows, runs, lo, hi, which, kept: dict, now: dict):
    """Each entry's slots from the request's kept ones, adding only the local keys past them;
    and every slot of the step (one view when a single request's entries follow on)."""
    need: dict[int, int] = {}
    for i, _, b in runs:
        need[i] = max(need.get(i, 0), b)
    values = {i: _request_slots(group, prefills[i], rows, n, kept, now) for i, n in need.items()}
    slots = [values[i][a:b] for i, a, b in zip(which.tolist(), lo.tolist(), hi.tolist())]
    if len(runs) == 1:
        every = values[runs[0][0]][runs[0][1] : runs[0][2]]
    else:
        every = np.concatenate([values[i][a:b] for i, a, b in runs])
    return slots, every


def _request_slots(group, w, rows, need: int, kept: dict, now: dict) -> np.ndarray:
    """An array whose first ``need`` values are the slots of the request's local keys
    ``[0, need)``: the kept ones while the row still holds them, the rest derived and kept."""
    per_entry = group.page_states
    row = np.asarray(rows.get(w.req_index, np.zeros(0, np.int64)), dtype=np.int64)
    if need > len(row) * per_entry:  # keys past the row read -1: derived each time, not kept
        return _slots(group, row, np.arange(need, dtype=np.int64))
    mine = kept.get(w.request_id)
    if mine is not None:
        held = -(-mine.count // per_entry)  # the row entries the known keys sit in
        if len(row) < held or not np.array_equal(row[:held], mine.row[:held]):
            mine = None  # a new row under the known keys (preempted, replaced): derive them again
    if mine is None or need > mine.values.size:  # a new array: the views of the old one stay as they are
        grown = _Kept(row.copy(), need * 9 // 8 + 1)  # room to grow by an eighth before the next copy
        if mine is not None:
            grown.values[: mine.count], grown.count = mine.values[: mine.count], mine.count
        mine = grown
    if need > mine.count:
        mine.values[mine.count : need] = _slots(group, row, np.arange(mine.count, need, dtype=np.int64))
        mine.count, mine.row = need, row.copy()
    now[w.request_id] = mine
    return mine.values


def judge_gathers(judge: MetadataJudge, plan: StepPlan, gathers) -> None:
    """The step's context gathers (``verify.context_gather``): every gathered group's
    entries, field by field, each mismatch naming the request and the chunk."""
    if gathers is None or judge.config is None or not plan.writes:
        return
    by_group = {g.group: g for g in gathers}
    for g, group in enumerate(judge.groups):
        if not gathered_group(group):
            continue
        store = judge.store_of[g]
        kept = judge.gather_slots.setdefault(store, {})
        want = expected_gather(group, plan, plan.rows_before[store], judge.rank, expected_workspace(group, judge.config), kept)
        have = by_group.get(store)
        if want is None and have is None:
            continue
        judge.gather_checks += 1
        if want is None or have is None:
            what = "none" if want is None else f"{len(want['request_ids'])} entries"
            judge.add(plan, group, "context gather", None, what, "none" if have is None else f"{len(have.request_ids)} entries")
            continue
        _compare_gather(judge, plan, group, have, want)


def _compare_gather(judge: MetadataJudge, plan, group, have, want: dict) -> None:
    if have.workspace_size != want["workspace_size"]:
        judge.add(plan, group, "context gather workspace_size", None, str(want["workspace_size"]), str(have.workspace_size))
    if tuple(have.request_ids) != want["request_ids"] or not np.array_equal(np.asarray(have.chunks), want["chunks"]):
        judge.add(plan, group, "context gather requests", None, show(want["request_ids"]), show(tuple(have.request_ids)))
        return
    for name in ("starts", "seq_lens", "local_starts", "local_seq_lens"):
        got, expect = np.asarray(getattr(have, name)), want[name]
        bad = np.nonzero(got != expect)[0]
        if len(bad):
            k = int(bad[0])
            field = f"context gather chunk {int(want['chunks'][k])} {name}"
            judge.add(plan, group, field, want["request_ids"][k], str(int(expect[k])), str(int(got[k])))
            return
    every = np.asarray(have.slots)
    if every.shape == want["every_slot"].shape and np.array_equal(every, want["every_slot"]):
        return  # every entry's slots at once (the entries' lengths are the expected ones)
    for k, slots in enumerate(want["slots"]):
        got = have.slots_of(k)
        if not np.array_equal(got, slots):
            field = f"context gather chunk {int(want['chunks'][k])} slots"
            judge.add(plan, group, field, want["request_ids"][k], show(slots), show(np.asarray(got)))
            return
