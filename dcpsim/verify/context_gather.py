"""The checker's judgement of a step's context gather (``docs/dcp-semantics.md`` section 10).

Any valid chunking passes, whoever packs it (vLLM 0.33.0 packs a step's requests into the
workspace, vllm-ascend cuts every request alike and pads each piece to ``I`` per rank): from the
step's plan and the checker's own geometry, the entries must name exactly the prefill rows
(more than ``1 + k`` query tokens) with a cached context (their write starts past 0), in
chunk order and within a chunk in batch order, a request at most once a chunk; each request's
pieces, in chunk order, must cover its context tokens ``[0, c)`` exactly once, none empty; each
chunk must fit the workspace (a piece takes, on every rank, as many rows as the rank holding
most of its keys holds: the ranks' pieces are all-gathered side by side); and a rank gathers, of
an entry covering context tokens ``[s, e)``, exactly the keys of its shard among them, counted
with ``owned_below`` (its runs of ``I`` below a length), read through its block-table row.
Written apart from the engine's ``model.context_gather``. ``expected_entries`` is vLLM 0.33.0's
packing, one valid chunking (the tests compare the reference engine's with it): it walks down
the split length one alignment at a time, and the rows a piece takes are rank 0's keys of whole
interleave runs.
"""

from __future__ import annotations

import math

import numpy as np

from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import StepPlan
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.metadata import MetadataJudge, kernel_states, show
from dcpsim.verify.oracle import owned_below

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
    """Every field of the rank's gather of this group in this step under vLLM 0.33.0's
    packing (None: no gather). ``kept``: request id -> the slots of its local keys kept from
    the group's earlier steps (``MetadataJudge.gather_slots`` of the group's store), updated
    to this step's requests (None: every slot derived again). ``every_slot``: every entry's
    slots, in order."""
    prefills = _prefills(group, plan)
    entries = expected_entries(group, [w.start for w in prefills], workspace)
    if not entries:
        if kept is not None:
            kept.clear()
        return None
    chunks, which, starts, lengths = (np.array(column, dtype=np.int64) for column in zip(*entries))
    return gather_fields(group, prefills, rows, rank, (chunks, which, starts, lengths), workspace, kept)


def _prefills(group: ExpectedGroup, plan: StepPlan) -> list:
    """The step's prefill rows (more than ``1 + k`` query tokens), in batch order."""
    return [w for w in plan.writes if w.stop - w.start > 1 + group.num_speculative_tokens]


def gather_fields(group: ExpectedGroup, prefills: list, rows: dict, rank: int, entries, workspace: int, kept: dict | None) -> dict:
    """The fields of a gather of ``entries`` (``(chunks, which, starts, lengths)``, ``which``
    indexing ``prefills``): this rank's local rows of each entry and their slots."""
    chunks, which, starts, lengths = entries
    ends = np.minimum(starts + lengths, np.array([w.start for w in prefills], dtype=np.int64)[which])
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
    entries, a valid chunking of the step's cached contexts, field by field, each mismatch
    naming the request and the chunk."""
    if gathers is None or judge.config is None or not plan.writes:
        return
    by_group = {g.group: g for g in gathers}
    for g, group in enumerate(judge.groups):
        if not gathered_group(group):
            continue
        store = judge.store_of[g]
        kept = judge.gather_slots.setdefault(store, {})
        prefills = _prefills(group, plan)
        gathering = [w.request_id for w in prefills if w.start > 0]
        have = by_group.get(store)
        if not gathering and have is None:
            kept.clear()
            continue
        judge.gather_checks += 1
        if not gathering or have is None:
            kept.clear()
            what = "none" if not gathering else f"entries of {show(tuple(gathering))}"
            judge.add(plan, group, "context gather", None, what, "none" if have is None else f"{len(have.request_ids)} entries")
            continue
        workspace = expected_workspace(group, judge.config)
        entries = _valid_entries(judge, plan, group, have, prefills, workspace)
        if entries is None:
            kept.clear()
            continue
        want = gather_fields(group, prefills, plan.rows_before[store], judge.rank, entries, workspace, kept)
        _compare_gather(judge, plan, group, have, want)


def _valid_entries(judge: MetadataJudge, plan, group, have, prefills, workspace: int):
    """``(chunks, which, starts, lengths)`` of the engine's entries when they are a valid
    chunking of the step's cached contexts; else None, the first violation added."""
    if have.workspace_size != workspace:
        judge.add(plan, group, "context gather workspace_size", None, str(workspace), str(have.workspace_size))
        return None
    index = {w.request_id: i for i, w in enumerate(prefills) if w.start > 0}
    ids = tuple(have.request_ids)
    chunks = np.asarray(have.chunks, dtype=np.int64)
    if not ids or len(chunks) != len(ids) or set(ids) != index.keys():
        judge.add(plan, group, "context gather requests", None, show(tuple(index)), show(ids))
        return None
    which = np.fromiter(map(index.__getitem__, ids), dtype=np.int64, count=len(ids))
    key = chunks * len(prefills) + which  # chunk order, then batch order, each request once a chunk
    if chunks[0] != 0 or (np.diff(chunks) > 1).any() or (np.diff(key) <= 0).any():
        judge.add(plan, group, "context gather requests", None, "chunks 0, 1, ... in order, batch order within one", show(chunks))
        return None
    starts, lengths = np.asarray(have.starts, dtype=np.int64), np.asarray(have.seq_lens, dtype=np.int64)
    if len(starts) != len(ids) or len(lengths) != len(ids):
        judge.add(plan, group, "context gather requests", None, f"{len(ids)} starts and seq_lens", f"{len(starts)}, {len(lengths)}")
        return None
    if not _covers(judge, plan, group, (chunks, which, starts, lengths), ids, np.array([w.start for w in prefills], np.int64)):
        return None
    rows = _rows_per_rank(group, starts, starts + lengths)
    used = np.bincount(chunks, weights=rows).astype(np.int64)
    budget = workspace // _ranks(group)
    over = np.flatnonzero(used > budget)
    if len(over):
        c = int(over[0])
        judge.add(plan, group, f"context gather chunk {c} rows", None, f"at most {budget}", str(int(used[c])))
        return None
    return chunks, which, starts, lengths


def _covers(judge: MetadataJudge, plan, group, entries, ids, contexts: np.ndarray) -> bool:
    """Each request's pieces, in chunk order, cover its context ``[0, c)`` once: none empty,
    each starting where the one before ended, the last ending at ``c``."""
    chunks, which, starts, lengths = entries
    empty = np.flatnonzero(lengths <= 0)
    if len(empty):
        k = int(empty[0])
        judge.add(plan, group, f"context gather chunk {int(chunks[k])} seq_lens", ids[k], "at least 1", str(int(lengths[k])))
        return False
    order = np.argsort(which, kind="stable")  # a request's entries, in chunk order
    w, s = which[order], starts[order]
    e = s + lengths[order]
    first = np.r_[True, w[1:] != w[:-1]]
    want = np.where(first, 0, np.r_[0, e[:-1]])  # where each piece must start
    bad = np.flatnonzero(s != want)
    if len(bad):
        k = int(order[bad[0]])
        judge.add(plan, group, f"context gather chunk {int(chunks[k])} starts", ids[k], str(int(want[bad[0]])), str(int(starts[k])))
        return False
    last = np.r_[w[1:] != w[:-1], True]
    bad = np.flatnonzero(last & (e != contexts[w]))
    if len(bad):
        k = int(order[bad[0]])
        expect = int(contexts[which[k]] - starts[k])
        judge.add(plan, group, f"context gather chunk {int(chunks[k])} seq_lens", ids[k], str(expect), str(int(lengths[k])))
        return False
    return True


def _rows_per_rank(group: ExpectedGroup, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Workspace rows each entry takes on every rank: the most keys of ``[start, end)`` any
    rank holds (the ranks' pieces are all-gathered side by side, so each is padded to that)."""
    if not group.sharded:
        return ends - starts
    per_round = group.dcp_size * group.interleave_size
    if not (starts % per_round).any():  # pieces start at a rank-0 run: rank 0 holds the most
        n = ends - starts
        return n // per_round * group.interleave_size + np.minimum(n % per_round, group.interleave_size)
    return np.max([owned_below(ends, r, group) - owned_below(starts, r, group) for r in range(group.dcp_size)], axis=0)


def _compare_gather(judge: MetadataJudge, plan, group, have, want: dict) -> None:
    for name in ("local_starts", "local_seq_lens"):
        got, expect = np.asarray(getattr(have, name)), want[name]
        bad = np.nonzero(got != expect)[0] if got.shape == expect.shape else [0]
        if len(bad):
            k = int(bad[0])
            field = f"context gather chunk {int(want['chunks'][k])} {name}"
            judge.add(plan, group, field, want["request_ids"][k], str(int(expect[k])), str(int(got[k])) if k < len(got) else "none")
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
