"""The all-gather step: prove the shards reassemble and the replicas agree.

Phase 1 (every verification, small): each rank reads every live request
through its block tables (``verify.read``), compares with the oracle, and
all-gathers one compact row per (group, request): bad count, entries read,
an ordered digest and a multiset digest, plus its write-violation count and
block-table digests. Every rank then judges the same gathered data:

* sharded groups: no rank has a bad entry, and the multiset digests of all
  ranks add up to the digest of the full context (every index exactly once);
* replicated groups: no rank has a bad entry and every rank's ordered digest
  is the same;
* no write violations; identical block tables on every rank.

Phase 2 runs only on a failure: the ranks gather details of the first problem
(what each rank holds at the expected slot, where the entry went) to build
one report. ``paranoid`` additionally gathers the raw read views and
reassembles them explicitly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dcpsim.content import mix64
from dcpsim.group_layout import RECORDS, RING, GroupLayout
from dcpsim.runtime.collectives import Collectives
from dcpsim.runtime.kv_store import CONTENT, GROUP, INDEX, STEP, WRITER
from dcpsim.runtime.model_runner import ModelRunner
from dcpsim.scheduler.plan import RequestView, StepPlan
from dcpsim.verify.oracle import expected_full, expected_on_rank, expected_owner
from dcpsim.verify.read import read_slots, read_view
from dcpsim.verify.report import Failure, Holding

_K1 = np.uint64(0xD6E8FEB86659FD93)
_K2 = np.uint64(0xA0761D6478BD642F)
BAD, COUNT, ORDERED, MULTISET = range(4)


def _pair_hash(index: np.ndarray, content: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix64(index.astype(np.uint64) * _K1 ^ content.view(np.uint64))


def multiset_digest(index: np.ndarray, content: np.ndarray) -> int:
    with np.errstate(over="ignore"):
        return int(_pair_hash(index, content).sum(dtype=np.uint64))


def ordered_digest(index: np.ndarray, content: np.ndarray) -> int:
    with np.errstate(over="ignore"):
        order = (np.arange(1, len(index) + 1, dtype=np.uint64)) * _K2
        return int(mix64(_pair_hash(index, content) ^ order).sum(dtype=np.uint64))


def _i64(u: int) -> int:
    return int(np.array([u], dtype=np.uint64).view(np.int64)[0])


class Checker:
    def __init__(self, layouts: list[GroupLayout], collectives: Collectives, request_ids: dict[int, str], paranoid: bool = False):
        self.layouts = layouts
        self.coll = collectives
        self.rank = collectives.rank
        self.world = collectives.world_size
        self.request_ids = request_ids
        self.paranoid = paranoid
        self.verified_indices = 0
        self.verifications = 0

    # --- phase 1 ------------------------------------------------------------------

    def _local_read(self, runner: ModelRunner, layout: GroupLayout, view: RequestView):
        index, content = expected_on_rank(layout, view, self.rank)
        row = runner.block_tables[layout.group_id].row(view.req_index)
        local = index if not layout.sharded else np.arange(len(index), dtype=np.int64)
        got = read_view(layout, runner.stores[layout.group_id], row, local)
        bad = (got[:, INDEX] != index) | (got[:, CONTENT] != content) | (got[:, GROUP] != layout.group_id)
        return index, got, bad

    def verify(self, plan: StepPlan, runner: ModelRunner) -> Failure | None:
        self.verifications += 1
        items = [(lay, v) for lay in self.layouts for v in plan.views]
        rows = np.zeros((len(items), 4), dtype=np.int64)
        reads = []
        for k, (lay, view) in enumerate(items):
            index, got, bad = self._local_read(runner, lay, view)
            reads.append((index, got, bad))
            rows[k] = (
                int(bad.sum()),
                len(got),
                _i64(ordered_digest(got[:, INDEX], got[:, CONTENT])),
                _i64(multiset_digest(got[:, INDEX], got[:, CONTENT])),
            )
        tables = [_i64(self._table_digest(runner, lay, plan.views)) for lay in self.layouts]
        header = np.array([runner.guard.count, len(tables)] + tables, dtype=np.int64)
        mine = torch.from_numpy(np.concatenate([header, rows.reshape(-1)]))
        gathered = np.stack([t.numpy() for t in self.coll.all_gather_tensor(mine)])
        h = len(header)
        violations = gathered[:, 0]
        table_digests = gathered[:, 2:h]
        per_item = gathered[:, h:].reshape(self.world, len(items), 4)
        self.verified_indices += int(per_item[:, :, COUNT].sum())

        if self.paranoid:
            failure = self._paranoid(plan, items, reads)
            if failure:
                return failure
        if violations.any():
            return self._violation_failure(plan, runner, int(violations.sum()))
        if (table_digests != table_digests[0]).any():
            return self._table_failure(plan, runner)
        for k, (lay, view) in enumerate(items):
            bad_total = int(per_item[:, k, BAD].sum())
            if lay.sharded:
                full_index, full_content = expected_full(lay, view)
                want = multiset_digest(full_index, full_content)
                have = int(per_item[:, k, MULTISET].astype(np.uint64).sum(dtype=np.uint64))
                if bad_total or want != have:
                    return self._item_failure(plan, runner, lay, view, reads[k], bad_total, "wrong-content" if bad_total else "reassembly")
            else:
                differ = (per_item[:, k, ORDERED] != per_item[0, k, ORDERED]).any()
                if bad_total or differ:
                    return self._item_failure(plan, runner, lay, view, reads[k], bad_total, "wrong-content" if bad_total else "replicas-differ")
        return None

    @staticmethod
    def _table_digest(runner: ModelRunner, lay: GroupLayout, views) -> int:
        table = runner.block_tables[lay.group_id]
        parts = []
        for v in views:
            row = table.row(v.req_index)
            parts.append(np.concatenate([[v.req_index, len(row)], row]).astype(np.int64))
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return ordered_digest(flat, np.zeros(len(flat), np.int64))

    # --- phase 2: details of the first problem --------------------------------------

    def _item_failure(self, plan, runner, lay: GroupLayout, view: RequestView, read, bad_total: int, kind: str) -> Failure:
        index, got, bad = read
        first_local = int(index[bad][0]) if bad.any() else None
        gathered = self.coll.all_gather_object((first_local, got[:, INDEX].tolist()))
        firsts = [f for f, _ in gathered if f is not None]
        full_index, full_content = expected_full(lay, view)
        if firsts:
            target = min(firsts)
        else:  # nothing bad per rank, yet the pieces do not add up: find the odd one out
            seen = np.concatenate([np.asarray(ix, np.int64) for _, ix in gathered])
            counts = {int(i): 0 for i in full_index}
            for i in seen:
                counts[int(i)] = counts.get(int(i), 0) + 1
            odd = [i for i, c in sorted(counts.items()) if c != (1 if lay.sharded else self.world)]
            target = odd[0] if odd else int(full_index[0])
        owner = expected_owner(lay, target)
        if lay.sharded:
            owned = full_index[(full_index // lay.interleave_size) % lay.dcp_size == owner]
            local = int(np.searchsorted(owned, target))
        else:
            local = target
        row = runner.block_tables[lay.group_id].row(view.req_index)
        slot = int(read_slots(lay, row, np.array([local]))[0])
        store = runner.stores[lay.group_id]
        entry = store.read(np.array([slot]))[0]
        found = store.find(target, writer=view.req_index).tolist()
        holdings = [Holding(**h) for h in self.coll.all_gather_object(dict(
            rank=self.rank, slot=slot, group=int(entry[GROUP]), index=int(entry[INDEX]),
            content=int(entry[CONTENT]),
            writer=self.request_ids.get(int(entry[WRITER])) if entry[WRITER] >= 0 else None,
            step=int(entry[STEP]), found_at=found,
        ))]
        pos = np.searchsorted(full_index, target)
        expected_content = int(full_content[pos]) if pos < len(full_index) and full_index[pos] == target else None
        owner_holding = holdings[owner if owner is not None else 0]
        index_kind = {RECORDS: "record", RING: "ring row"}.get(lay.storage, "position")
        what = {
            "wrong-content": "a rank does not hold the right entry where attention reads it",
            "reassembly": "the shards do not reassemble the full context exactly once",
            "replicas-differ": "the replicas of a replicated group differ across ranks",
        }[kind]
        return Failure(
            kind=kind,
            step=plan.step,
            message=what,
            group=lay.name,
            request_id=view.request_id,
            index_kind=index_kind,
            index=target,
            expected_owner="all" if owner is None else owner,
            expected_slot=slot,
            expected_content=expected_content,
            holdings=holdings,
            last_write_step=owner_holding.step if owner_holding.step >= 0 else None,
            further_bad=max(0, bad_total - 1),
        )

    def _violation_failure(self, plan, runner, total: int) -> Failure:
        kept = [v for per_rank in self.coll.all_gather_object(runner.guard.kept) for v in per_rank]
        lines = [str(v) for v in kept]
        first = kept[0] if kept else None
        return Failure(
            kind="write-violation",
            step=plan.step,
            message=f"{total} write violation(s) in the write path",
            group=first.group if first else None,
            request_id=first.request_id if first else None,
            index=first.index if first else None,
            violations=[dataclasses.asdict(v) for v in kept],
            details=lines[:10] + ([f"... and {len(lines) - 10} more runs of violations"] if len(lines) > 10 else []),
        )

    def _table_failure(self, plan, runner) -> Failure:
        mine = {lay.name: {v.request_id: runner.block_tables[lay.group_id].row(v.req_index).tolist() for v in plan.views} for lay in self.layouts}
        tables = self.coll.all_gather_object(mine)
        details = []
        for name in mine:
            for rid in mine[name]:
                rows = [t[name].get(rid) for t in tables]
                if any(r != rows[0] for r in rows):
                    details.append(f"group {name} request {rid}: " + "; ".join(f"rank {i}: {r}" for i, r in enumerate(rows)))
        return Failure(kind="block-table-mismatch", step=plan.step, message="ranks hold different block tables", details=details[:10])

    def _paranoid(self, plan, items, reads) -> Failure | None:
        """Gather raw read views and reassemble them explicitly."""
        raw = self.coll.all_gather_object([got for _, got, _ in reads])
        for k, (lay, view) in enumerate(items):
            full_index, full_content = expected_full(lay, view)
            parts = [r[k] for r in raw]
            if lay.sharded:
                allrows = np.concatenate(parts)
                order = np.argsort(allrows[:, INDEX], kind="stable")
                ok = len(allrows) == len(full_index) and np.array_equal(allrows[order, INDEX], full_index) and np.array_equal(allrows[order, CONTENT], full_content)
            else:
                ok = all(np.array_equal(p, parts[0]) for p in parts) and np.array_equal(parts[0][:, INDEX], full_index) and np.array_equal(parts[0][:, CONTENT], full_content)
            if not ok:
                return Failure(kind="reassembly", step=plan.step, message="paranoid reassembly of raw read views failed", group=lay.name, request_id=view.request_id)
        return None
