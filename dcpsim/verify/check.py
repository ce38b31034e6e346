"""The all-gather step: prove the shards reassemble and the replicas agree.

Phase 1 (every verification, small): each rank reads every live request through its
block tables (``verify.read``, over the rank's ``RankView``), compares with the oracle,
and all-gathers one compact row per (group, request): bad count, entries read, an ordered
digest and a multiset digest, plus its write-violation count and block-table digests.
Every rank then judges the same gathered data:

* sharded groups: no rank has a bad entry, and the multiset digests of all ranks add up
  to the digest of the full context (every index exactly once);
* replicated groups: no rank has a bad entry and every rank's ordered digest is the same;
* no write violations; identical block tables on every rank.

``incremental`` (the default mode) restricts each item's read to the local indices that
can have changed on the rank since the last check, from the rank's own change records
(``verify.changes``). Replicas compare ordered digests only where every rank re-read the
same indices; elsewhere each rank's entries are judged against the oracle, which every
replica matched at the last check, so the replicas still agree wherever no rank has a bad
entry. Rings, Mamba states, new requests, every request as it finishes and everything at
the run's last step are read in full. ``full`` reads every
live index at every check. The oracle judges the read entries the same way in both modes.

Phase 2 runs only on a failure: the ranks gather details of the first problem (what each
rank holds at the expected slot, where the entry went) to build one report. ``paranoid``
additionally gathers the raw read views and reassembles them explicitly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dcpsim.collectives import Collectives
from dcpsim.model.kinds import Storage
from dcpsim.model.kv_entry import CONTENT, FIELDS, GROUP, INDEX, STEP, WRITER
from dcpsim.model.plan import RequestView, StepPlan
from dcpsim.model.rank_view import RankView
from dcpsim.plural import plural
from dcpsim.verify.attention_mask import MaskJudge
from dcpsim.verify.changes import ChangeTracker, expected_at
from dcpsim.verify.context_gather import judge_gathers
from dcpsim.verify.digest import as_int64, as_int64s, multiset_digest, run_digests
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.helix import helix_local_of
from dcpsim.verify.kv_events import KVEventRouter, prefix_cacheable
from dcpsim.verify.metadata import MetadataJudge
from dcpsim.verify.options import CheckOptions
from dcpsim.verify.oracle import expected_full, expected_on_rank, expected_owner, expected_share, owned_mask, state_column
from dcpsim.verify.passing import all_pass, column_roles
from dcpsim.verify.pcp_mask import judge_pcp_keys
from dcpsim.verify.prefix_hit import PrefixHitJudge, hits_judged
from dcpsim.verify.read import read_slots, read_slots_flat
from dcpsim.verify.report import Failure, FailureKind, Holding
from dcpsim.verify.retention import RetentionJudge
from dcpsim.verify.step_reads import StepReads, expected_partial
from dcpsim.verify.table_digest import TableDigests
from dcpsim.verify.write_guard import WriteGuard

_ROW = BAD, COUNT, ORDERED, MULTISET, LOCALS, SHARE = range(6)
"""Columns of a gathered row: entries unlike the expectation, entries read, then a sharded
group's ``MULTISET`` digest of a full read's pairs (partial reads: 0) and the rank's
``SHARE`` of the full context's digest (``oracle.expected_share``: the ranks' shares add up
to it), or a replicated group's ``ORDERED`` digest and ``LOCALS``, a digest of which local
indices it re-read (0: all)."""
_TABLES = 7
"""Where the block-table digests start in a step's header: after the judges' counts (write guard,
metadata, KV events, spec-decode masks, prefix hits, keys missing at read) and the digests' count."""
_RETAINED = 5
"""The header's column of the retention judge's count (keys the step's queries read but missing)."""

_WHAT = {
    FailureKind.WRONG_CONTENT: "a rank does not hold the right entry where attention reads it",
    FailureKind.REASSEMBLY: "the shards do not reassemble the full context exactly once",
    FailureKind.REPLICAS_DIFFER: "the replicas of a replicated group differ across ranks",
}


def _replicas_differ(rows: np.ndarray) -> bool:
    """Whether every rank re-read the same local indices of an item (``LOCALS``; ``rows``:
    the ranks' rows of it) yet their ``ORDERED`` digests differ."""
    return bool((rows[:, LOCALS] == rows[0, LOCALS]).all() and (rows[:, ORDERED] != rows[0, ORDERED]).any())


def _concatenated(rows: list[np.ndarray]) -> np.ndarray:
    """A group's block-table rows as one int64 array (a copy)."""
    if len(rows) == 1:
        return np.array(rows[0], dtype=np.int64)
    return np.concatenate(rows).astype(np.int64, copy=False) if rows else np.zeros(0, np.int64)


def _concatenated_reads(index: list, got: list, bad: list, counts: list[int]) -> StepReads:
    """The groups' reads of a check as one ``StepReads`` (items group by group)."""
    if not counts:
        return StepReads(np.zeros(0, np.int64), np.zeros((0, len(FIELDS)), np.int64), np.zeros(0, bool), np.zeros(0, np.int64))
    one = len(index) == 1
    return StepReads(
        index[0] if one else np.concatenate(index),
        got[0] if one else np.concatenate(got),
        bad[0] if one else np.concatenate(bad),
        np.array(counts, dtype=np.int64),
    )


class StaleFailure(Exception):
    """A queued step failed, but it is no longer the newest: the stores have moved on, so
    its report's details cannot be read any more. The run is redone in lockstep (one
    exchange a step), which stops at that step and builds the report there."""

    def __init__(self, step: int):
        super().__init__(f"verification of step {step} failed (found in a later exchange)")
        self.step = step


STALE = Failure(kind=FailureKind.WRONG_CONTENT, step=-1, message="stale")
"""``Checker._judge``'s answer for a failing step older than the newest queued one."""


@dataclasses.dataclass
class _Pending:
    """One step's half of a verification, waiting for the exchange."""

    plan: StepPlan
    items: list
    local: list
    message: np.ndarray
    """This rank's header (violations, metadata and event counts, table digests) and rows."""
    header_len: int
    roles: np.ndarray
    """What each column of ``message`` must show if the step passes (``verify.passing``)."""


class Checker:
    def __init__(
        self,
        groups: list[ExpectedGroup],
        collectives: Collectives,
        view: RankView,
        request_ids: dict[int, str],
        config=None,
        options: CheckOptions = CheckOptions(),  # noqa: B008 - a frozen value
        prompt_lens: dict[str, int] | None = None,
    ):
        """``config``: the scenario's ``SimConfig`` (the metadata check reads
        ``max_model_len`` and the CUDA-graph capture sizes of it; None: no metadata check).
        ``options``: ``--verify`` (``incremental`` or ``full``) and ``--paranoid`` (which
        also reads in full). ``prompt_lens``: each request's prompt length (the prefix-hit
        judge's limit; None: no admission is judged beyond a re-admission's committed length)."""
        self.groups = groups
        self.coll = collectives
        self.view = view
        self.rank = collectives.rank
        self.world = collectives.world_size
        self.request_ids = request_ids
        self.paranoid = options.paranoid
        self.verified_indices = 0
        self.incremental = options.incremental and not options.paranoid and not any(g.helix for g in groups)
        """Under Helix every check reads in full (``verify.changes`` tracks vLLM's local order)."""
        self.full_sweeps = 0
        """Checks that read every live index (all of them in ``full`` mode)."""
        self.verifications = 0
        self.store_of = [view.group_of_layer(g.layer_names[0]) for g in groups]
        """The engine's store holding each expected group (found by its first layer)."""
        self.changes = ChangeTracker(view, self.store_of)
        self.guard = WriteGuard(self.rank, {s: g.name for s, g in zip(self.store_of, groups)})
        self.retention = RetentionJudge(self.rank, groups, self.store_of, request_ids)
        """Judges every step's context keys where its attention reads them (``verify.retention``)."""
        self._metadata_total = 0
        self._events_total = 0
        self._mask_total = 0
        self._hit_total = 0
        self.router = KVEventRouter(self.rank, groups) if groups and prefix_cacheable(groups) else None
        """The checker as a router reading the engine's KV events (prefix-cacheable models)."""
        self.metadata = (
            MetadataJudge(
                self.rank,
                groups,
                self.store_of,
                config.max_model_len if config else 0,
                config.cudagraph_capture_sizes if config else (),
                table_width=view.block_table_width,
                config=config,
            )
            if config is not None
            else None
        )
        self.masks = MaskJudge(self.rank, groups, self.store_of) if self.metadata is not None else None
        """The spec-decode masks' judge (``verify.attention_mask``), beside the metadata's."""
        self.hits = PrefixHitJudge(self.rank, groups, config.eagle_drop, prompt_lens or {}) if hits_judged(groups, config) else None
        """The prefix-cache hit lengths' judge (``verify.prefix_hit``)."""
        self._last_write: dict[int, tuple[int, int, int]] = {}
        """Each request's last write (start, stop, drafts): where its Mamba states went."""
        self._pending: list[_Pending] = []
        """Steps read (``read``) whose rows wait for the next ``exchange``."""
        self._last_reads: StepReads | None = None
        self._tables = TableDigests()
        self._store_shapes: dict[int, tuple[int, int]] = {}
        """Store -> (blocks, states per block), as the view first gave it."""

    # --- every step: the write log ----------------------------------------------------

    def record_writes(self, plan: StepPlan) -> None:
        """Judge what the rank wrote in this step (before the next step's writes)."""
        writes = self.view.step_writes()
        for w in writes:  # a store's shape is fixed when the rank is set up: asked once
            if w.group not in self._store_shapes:
                self._store_shapes[w.group] = self.view.store_shape(w.group)
        self.guard.judge(plan, writes, self._store_shapes)
        self.retention.judge(plan, self.view)
        if self.metadata is not None:
            self.metadata.judge(plan, self.view.step_attention_metadata())
            judge_gathers(self.metadata, plan, self.view.step_context_gathers())
            self.masks.judge(plan, self.view.step_spec_decode_masks())
            judge_pcp_keys(self.masks, plan, self.view.step_pcp_query_keys())
        if self.router is not None:
            self.router.judge(plan)
        if self.hits is not None:
            self.hits.judge(plan)
        for w in plan.writes:
            self._last_write[w.req_index] = (w.start, w.stop, w.num_drafts)

    # --- phase 1 ------------------------------------------------------------------

    def _row(self, g: int, view: RequestView) -> np.ndarray:
        return self.view.block_table_row(self.store_of[g], view.req_index)

    def _local(self, g: int, view: RequestView, index: np.ndarray) -> np.ndarray:
        """What the read path looks up for ``index`` (this rank's expected indices, in order):
        local indices of a sharded group, positions of a replicated one, the state's column."""
        group = self.groups[g]
        if group.storage is Storage.STATE:
            column = state_column(group, *self._last_write[view.req_index], view.num_committed)
            return np.full(len(index), column, dtype=np.int64)
        if group.helix:  # a position's local slot (with the gaps of Helix's blocks)
            return helix_local_of(index, group.prompt_len(view.request_id), group.block_size, group.dcp_size)
        return np.arange(len(index), dtype=np.int64) if group.sharded else index

    def _expected(self, g: int, view: RequestView, local: np.ndarray | None):
        """The item's expected entries (``local``: only those local indices) and the local
        indices attention reads them at; returns (index, content, local)."""
        group = self.groups[g]
        if local is None:
            index, content = expected_on_rank(group, view, self.rank)
            return index, content, self._local(g, view, index)
        index, content = expected_at(group, view, self.rank, local)
        return index, content, local

    def _read_group(self, g: int, views, table: list, local: list, flat: np.ndarray):
        """Read the expected entries of group ``g`` for every request of ``views`` (its
        block-table rows ``table``, concatenated ``flat``; local indices ``local``) in one store
        read, and judge them; all of them concatenated (index, got, bad) and each request's count."""
        group = self.groups[g]
        if not any(x is None for x in local) and group.storage not in (Storage.STATE, Storage.RING) and not group.helix:
            index, content, local_flat = expected_partial(group, views, self.rank, local)  # the usual incremental check
            counts = [len(x) for x in local]
        else:
            expected = [self._expected(g, v, loc) for v, loc in zip(views, local)]
            index = np.concatenate([e[0] for e in expected])
            content = np.concatenate([e[1] for e in expected])
            counts = [len(e[0]) for e in expected]
            local_flat = np.concatenate([np.asarray(e[2], dtype=np.int64) for e in expected])
        store = self.store_of[g]
        slots = read_slots_flat(group, table, counts, local_flat, flat=flat)
        got = self.view.read_entries(store, slots)
        bad = (got[:, INDEX] != index) | (got[:, CONTENT] != content) | (got[:, GROUP] != store)
        return index, got, bad, counts

    def _locals(self, plan: StepPlan, items, table: list, flats: list) -> list[np.ndarray | None]:
        """Per item, the local indices to read (None: all); ``table``: the items' rows
        (``flats``: each group's, concatenated)."""
        if not self.incremental or plan.last:
            return [None] * len(items)
        local = self.changes.locals_to_read_groups(self.groups, plan.views, table, self.rank, flats)
        return [None if view.finished else x for (_, view), x in zip(items, local)]

    def verify(self, plan: StepPlan) -> Failure | None:
        """Read and judge this step at once (lockstep): ``read`` then ``exchange``."""
        self.read(plan)
        return self.exchange()

    def read(self, plan: StepPlan) -> None:
        """This rank's half of a verification: read every item of the step, judge it
        against the oracle, and queue its compact row for the next ``exchange``."""
        self.verifications += 1
        self.changes.take(plan.views)
        views = plan.views
        items = [(g, v) for g in range(len(self.groups)) for v in views]
        table = [self._row(g, v) for g, v in items]  # each row once per check
        n = len(views)
        flats = [_concatenated(table[g * n : (g + 1) * n]) for g in range(len(self.groups))]
        local = self._locals(plan, items, table, flats)
        if all(x is None for x in local):
            self.full_sweeps += 1
        index, got, bad, counts = [], [], [], []
        for g in range(len(self.groups) if n else 0):
            part = slice(g * n, (g + 1) * n)
            group_index, group_got, group_bad, group_counts = self._read_group(g, views, table[part], local[part], flats[g])
            index.append(group_index)
            got.append(group_got)
            bad.append(group_bad)
            counts += group_counts
        reads = _concatenated_reads(index, got, bad, counts)
        sharded = np.array([self.groups[g].sharded for g, _ in items], dtype=bool)
        partial = np.array([x is not None for x in local], dtype=bool)
        rows = self._digest_rows(items, local, reads, sharded, partial)
        tables = self._tables.digests(len(self.groups), [v.req_index for v in views], table, flats)  # kept across checks
        meta_count = self.metadata.count if self.metadata is not None else 0
        event_count = self.router.count if self.router is not None else 0
        mask_count = self.masks.count if self.masks is not None else 0
        hit_count = self.hits.count if self.hits is not None else 0
        counts = [self.guard.count, meta_count, event_count, mask_count, hit_count, self.retention.count, len(tables)]
        header = np.concatenate([np.array(counts, dtype=np.int64), tables])
        self.changes.checked_all(self.groups, views)  # as if it passes: a failure found later ends the run anyway
        roles = column_roles(_TABLES - 1, len(header), sharded, partial)
        self._pending.append(_Pending(plan, items, local, np.concatenate([header, rows.reshape(-1)]), len(header), roles))
        self._last_reads = reads  # kept for the details of a failure at this step

    def _digest_rows(self, items, local: list, reads: StepReads, sharded: np.ndarray, partial: np.ndarray) -> np.ndarray:
        """The items' rows from their reads (every group's, concatenated): bad count,
        entries read and the digests, for the whole step at once (``sharded``, ``partial``:
        each item's group is sharded, its read is partial)."""
        rows = np.zeros((len(items), len(_ROW)), dtype=np.int64)
        if not items:
            return rows
        got, bad, lengths = reads.got, reads.bad, reads.lengths
        ends = np.cumsum(lengths)
        bad_run = np.zeros(len(bad) + 1, dtype=np.int64)
        np.cumsum(bad, out=bad_run[1:])
        rows[:, BAD], rows[:, COUNT] = bad_run[ends] - bad_run[ends - lengths], lengths
        # Sharded: a full read's pieces must add up to the full context (_judge). A partial
        # read sends no digest: with every entry equal to the rank's expectation (BAD 0
        # everywhere) the pieces add up to the expectations' sum by construction; the full
        # sweeps prove the whole reassembly. Replicated: the replicas must agree wherever
        # every rank read the same local indices. So only the items that send a digest are
        # hashed (each run's digest is its own: the others' entries change none).
        sends = ~sharded | ~partial
        again = partial & ~sharded
        # one hashing pass: the items' entries that send a digest, then the local indices of
        # the replicated items read in part (``LOCALS``: a digest of the pairs (i, i))
        parts = []  # (index, content, run lengths, ordered) of each kind of run
        if sends.all():
            parts.append((got[:, INDEX], got[:, CONTENT], lengths, ~sharded))
        elif sends.any():
            entries = np.repeat(sends, lengths)
            parts.append((got[entries, INDEX], got[entries, CONTENT], lengths[sends], ~sharded[sends]))
        if again.any():
            read = [x for x, k in zip(local, again) if k]
            flat = np.concatenate(read)
            parts.append((flat, flat, np.array([len(x) for x in read], dtype=np.int64), np.ones(len(read), dtype=bool)))
        if not parts:
            return rows
        columns = parts[0] if len(parts) == 1 else [np.concatenate(x) for x in zip(*parts)]
        digests = as_int64s(run_digests(*columns))
        sent = int(sends.sum())
        mine = np.zeros(len(items), dtype=np.int64)
        mine[sends] = digests[:sent]
        whole = sharded & ~partial
        rows[:, MULTISET] = np.where(whole, mine, 0)
        rows[:, ORDERED] = np.where(sharded, 0, mine)
        if again.any():
            rows[again, LOCALS] = digests[sent:] | np.int64(1)
        if whole.any():
            rows[whole, SHARE] = self._shares([items[k] for k in np.flatnonzero(whole)])
        return rows

    def _shares(self, items) -> list[int]:
        """This rank's share of each item's full-context digest (``oracle.expected_share``):
        the pieces' ``MULTISET`` digests must add up to the shares' sum. Item by item: a step
        has one or two such items, which a joined pass would cost more calls than it saves."""
        return [as_int64(multiset_digest(*expected_share(self.groups[g], view, self.rank, self.world))) for g, view in items]

    @property
    def pending(self) -> int:
        """Steps read but not yet exchanged."""
        return len(self._pending)

    def exchange(self, metadata: bool = False) -> Failure | None:
        """Gather the queued rows of every rank in one collective and judge each queued
        step in order; the first failure, or None.

        The failure's details (phase 2) read the stores as they are now, so they are
        only built for the newest queued step; a failure at an older one raises
        ``StaleFailure`` (the run is then redone in lockstep, ``harness.rank``).
        ``metadata``: also judge each step's attention-metadata and KV-event totals
        right after its KV verdict (with a step queue; in lockstep ``metadata_verdict``
        asks for them after the attention check)."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        mine = torch.from_numpy(np.concatenate([p.message for p in pending]))
        gathered = np.stack([t.numpy() for t in self.coll.all_gather_tensor(mine)])
        if not self.paranoid:  # the usual case, every queued step passing: judged at once
            counted = all_pass(gathered, np.concatenate([p.roles for p in pending]) if len(pending) > 1 else pending[0].roles)
            if counted is not None:
                self.verified_indices += counted
                self._metadata_total = self._events_total = self._mask_total = self._hit_total = 0
                return None
        offset = 0
        for n, p in enumerate(pending):
            newest = n == len(pending) - 1
            part = gathered[:, offset : offset + len(p.message)]
            offset += len(p.message)
            failure = self._judge(p, part, self._last_reads if newest else None)
            if failure is None and metadata:
                failure = self.metadata_verdict(p.plan)
            if failure is not None:
                if failure is STALE:
                    raise StaleFailure(p.plan.step)
                return failure
        return None

    def _judge(self, p: _Pending, gathered: np.ndarray, reads) -> Failure | None:
        """One step's verdict from every rank's row. ``reads``: this rank's reads of the
        step (None: an older step, whose failure is reported as ``STALE``)."""
        h = p.header_len
        violations, mismatches, event_errors = gathered[:, 0], gathered[:, 1], gathered[:, 2]
        per_item = gathered[:, h:].reshape(self.world, len(p.items), len(_ROW))
        self.verified_indices += int(per_item[:, :, COUNT].sum())
        failure = self._step_failure(p, violations, gathered[:, _TABLES:h], reads, gathered[:, _RETAINED])
        if failure is None:
            failure = self._first_bad_item(p, per_item, reads)
        if failure is not None:
            return failure
        self._metadata_total = int(mismatches.sum())  # reported by metadata_verdict, last
        self._events_total = int(event_errors.sum())
        self._mask_total = int(gathered[:, 3].sum())
        self._hit_total = int(gathered[:, 4].sum())
        if reads is None and (self._metadata_total or self._events_total or self._mask_total or self._hit_total):
            return STALE
        return None

    def _step_failure(self, p: _Pending, violations: np.ndarray, table_digests: np.ndarray, reads, missing: np.ndarray) -> Failure | None:
        """What fails before any item is judged: the paranoid reassembly (lockstep only),
        a write violation on any rank, block tables that differ across the ranks, a key a
        step's query read that its rank no longer held (``missing``: every rank's count); or None."""
        if self.paranoid and reads is not None:  # paranoid runs in lockstep (harness.rank)
            failure = self._paranoid(p.plan, p.items, reads)
            if failure:
                return failure
        if violations.any():
            return self._violation_failure(p.plan, int(violations.sum())) if reads is not None else STALE
        if (table_digests != table_digests[0]).any():
            return self._table_failure(p.plan) if reads is not None else STALE
        if missing.any():
            return self._retention_failure(p.plan, int(missing.sum())) if reads is not None else STALE
        return None

    def _first_bad_item(self, p: _Pending, per_item: np.ndarray, reads) -> Failure | None:
        """The failure of the first (group, request) item whose rows fail on some rank
        (``STALE`` for an older step), or None."""
        bad = per_item[:, :, BAD].sum(axis=0)  # every item's at once: this runs at every verification
        # the items that can fail (the others pass _item_kind trivially): an entry unlike
        # the oracle's, a full read of a sharded group, replicas whose digests differ
        sharded = np.array([self.groups[g].sharded for g, _ in p.items], dtype=bool)
        full = np.array([x is None for x in p.local], dtype=bool)
        differ = (per_item[:, :, ORDERED] != per_item[0, :, ORDERED]).any(axis=0)
        suspects = np.flatnonzero((bad != 0) | (sharded & full) | (~sharded & differ)).tolist()
        bad = bad.tolist()
        for k in suspects:
            g, view = p.items[k]
            kind = self._item_kind(g, view, p.local[k], per_item[:, k], bad[k])
            if kind is not None:
                return STALE if reads is None else self._item_failure(p.plan, g, view, reads[k], bad[k], kind)
        return None

    def _item_kind(self, g: int, view: RequestView, local, rows: np.ndarray, bad: int) -> FailureKind | None:
        """How an item fails, from every rank's row of it (``rows``) and its ``bad`` entries
        on all ranks: an entry unlike the oracle's (``WRONG_CONTENT``), a full read of a
        sharded group whose pieces do not add up to the full context (``REASSEMBLY``),
        replicas that read the same indices but differ (``REPLICAS_DIFFER``); None if it passes."""
        if bad:
            return FailureKind.WRONG_CONTENT
        if self.groups[g].sharded:
            return FailureKind.REASSEMBLY if local is None and not self._reassembles(rows) else None
        return FailureKind.REPLICAS_DIFFER if _replicas_differ(rows) else None

    @staticmethod
    def _reassembles(rows: np.ndarray) -> bool:
        """Whether the ranks' multiset digests of a full read add up to the full context's
        (the sum of the ranks' ``SHARE`` of it)."""
        return int(rows[:, MULTISET].astype(np.uint64).sum(dtype=np.uint64)) == int(rows[:, SHARE].astype(np.uint64).sum(dtype=np.uint64))

    def metadata_verdict(self, plan: StepPlan) -> Failure | None:
        """The attention-metadata verdict of the last ``verify`` (every rank knows the
        gathered total). Asked for after the KV and attention checks: wrong KV or a wrong
        attention output is the more telling report when both show."""
        total, self._metadata_total = self._metadata_total, 0
        if total:
            return self._metadata_failure(plan, total)
        kept_judges = (
            (
                "_mask_total",
                self.masks,
                FailureKind.ATTENTION_MASK,
                "attention mask row(s) differ from causality over positions (spec-decode verify masks, PCP prefill key ranges)",
            ),
            (
                "_hit_total",
                self.hits,
                FailureKind.PREFIX_HIT_SHORT,
                "prefix-cache hit(s) shorter than the cache allows (a lost hit: the tokens are recomputed, the KV is right)",
            ),
        )
        for attr, judge, kind, what in kept_judges:
            total = getattr(self, attr)
            setattr(self, attr, 0)
            if total:
                return self._kept_failure(plan, total, judge.kept, kind, f"{total} {what}")
        total, self._events_total = self._events_total, 0
        return self._events_failure(plan, total) if total else None

    def _events_failure(self, plan, total: int) -> Failure:
        return self._kept_failure(
            plan, total, self.router.kept, FailureKind.KV_EVENTS, f"{total} advertised prefix-cache event(s) a router cannot match"
        )

    def _kept_failure(self, plan, total: int, mine: list, kind: FailureKind, message: str) -> Failure:
        """A failure from what every rank's judge kept (gathered), the earliest first."""
        kept = sorted((m for per_rank in self.coll.all_gather_object(mine) for m in per_rank), key=lambda m: (m.step, m.rank))
        first = kept[0] if kept else None
        return Failure(
            kind=kind,
            step=first.step if first else plan.step,
            message=message,
            group=getattr(first, "group", None),
            request_id=first.request_id if first else None,
            details=[str(m) for m in kept[:10]] + ([f"... and {total - 10} more"] if total > 10 else []),
        )

    # --- phase 2: details of the first problem --------------------------------------

    def _item_failure(self, plan, g: int, view: RequestView, read, bad_total: int, kind: FailureKind) -> Failure:
        group, store = self.groups[g], self.store_of[g]
        index, got, bad = read
        first_local = int(index[bad][0]) if bad.any() else None
        gathered = self.coll.all_gather_object((first_local, got[:, INDEX].tolist()))
        firsts = [f for f, _ in gathered if f is not None]
        full_index, full_content = expected_full(group, view)
        if firsts:
            target = min(firsts)
        else:  # nothing bad per rank, yet the pieces do not add up: find the odd one out
            seen = np.concatenate([np.asarray(ix, np.int64) for _, ix in gathered])
            counts = {int(i): 0 for i in full_index}
            for i in seen:
                counts[int(i)] = counts.get(int(i), 0) + 1
            odd = [i for i, c in sorted(counts.items()) if c != (1 if group.sharded else self.world)]
            target = odd[0] if odd else int(full_index[0])
        owner = expected_owner(group, target, view.request_id)
        if group.helix:
            local = int(self._local(g, view, np.array([target]))[0])
        elif group.sharded:
            owned = full_index[owned_mask(group, full_index, owner)]
            local = int(np.searchsorted(owned, target))
        else:
            local = int(self._local(g, view, np.array([target]))[0])
        slot = int(read_slots(group, self._row(g, view), np.array([local]))[0])
        entry = self.view.read_entries(store, np.array([slot]))[0]
        found = self.view.find_entries(store, target, writer=view.req_index).tolist()
        holdings = [
            Holding(**h)
            for h in self.coll.all_gather_object(
                dict(
                    rank=self.rank,
                    slot=slot,
                    group=int(entry[GROUP]),
                    index=int(entry[INDEX]),
                    content=int(entry[CONTENT]),
                    writer=self.request_ids.get(int(entry[WRITER])) if entry[WRITER] >= 0 else None,
                    step=int(entry[STEP]),
                    found_at=found,
                )
            )
        ]
        pos = np.searchsorted(full_index, target)
        expected_content = int(full_content[pos]) if pos < len(full_index) and full_index[pos] == target else None
        owner_holding = holdings[owner if owner is not None else 0]
        return Failure(
            kind=kind,
            step=plan.step,
            message=_WHAT[kind],
            group=group.name,
            request_id=view.request_id,
            index_kind=group.index_kind,
            index=target,
            expected_owner="all" if owner is None else owner,
            expected_slot=slot,
            expected_content=expected_content,
            holdings=holdings,
            last_write_step=owner_holding.step if owner_holding.step >= 0 else None,
            further_bad=max(0, bad_total - 1),
            block_table=self._row(g, view).tolist(),
        )

    def _violation_failure(self, plan, total: int) -> Failure:
        kept = [v for per_rank in self.coll.all_gather_object(self.guard.kept) for v in per_rank]
        lines = [str(v) for v in kept]
        first = kept[0] if kept else None
        return Failure(
            kind=FailureKind.WRITE_VIOLATION,
            step=plan.step,
            message=f"{plural(total, 'write violation')} in the write path",
            group=first.group if first else None,
            request_id=first.request_id if first else None,
            index=first.index if first else None,
            violations=[dataclasses.asdict(v) for v in kept],
            details=lines[:10] + ([f"... and {len(lines) - 10} more runs of violations"] if len(lines) > 10 else []),
            block_table=self._first_row(plan, first.group, first.request_id) if first else None,
        )

    def _metadata_failure(self, plan, total: int) -> Failure:
        return self._kept_failure(
            plan,
            total,
            self.metadata.kept,
            FailureKind.ATTENTION_METADATA,
            f"{total} attention-metadata field(s) differ from what the scenario gives",
        )

    def _retention_failure(self, plan, total: int) -> Failure:
        """The keys the ranks' step queries read but no longer held (``verify.retention``),
        the earliest step's first; gathered from every rank's judge."""
        gathered = self.coll.all_gather_object(self.retention.kept)
        kept = sorted((m for per_rank in gathered for m in per_rank), key=lambda m: (m.step, m.rank))
        first = kept[0] if kept else None
        return Failure(
            kind=FailureKind.RETENTION_AT_READ,
            step=first.step if first else plan.step,
            message=f"{plural(total, 'key')} (over the ranks) a step's queries read, not held by its owner when the step ran",
            group=first.group if first else None,
            request_id=first.request_id if first else None,
            index_kind=first.index_kind if first else "position",
            index=first.key if first else None,
            expected_owner=first.owner if first else None,
            expected_slot=first.slot if first else None,
            expected_content=first.content if first else None,
            further_bad=max(0, total - 1),
            query_position=first.query_position if first else None,
            details=[str(m) for m in kept[:10]] + ([f"... and {len(kept) - 10} more"] if len(kept) > 10 else []),
            block_table=list(first.row) if first else None,
        )

    def _first_row(self, plan, group_name: str, request_id: str) -> list[int] | None:
        """The block-table row of a request in a group, both named as in a violation."""
        g = next((k for k, grp in enumerate(self.groups) if grp.name == group_name), None)
        view = next((v for v in plan.views if v.request_id == request_id), None)
        return None if g is None or view is None else self._row(g, view).tolist()

    def _table_failure(self, plan) -> Failure:
        mine = {group.name: {v.request_id: self._row(g, v).tolist() for v in plan.views} for g, group in enumerate(self.groups)}
        tables = self.coll.all_gather_object(mine)
        details = []
        for name in mine:
            for rid in mine[name]:
                rows = [t[name].get(rid) for t in tables]
                if any(r != rows[0] for r in rows):
                    details.append(f"group {name} request {rid}: " + "; ".join(f"rank {i}: {r}" for i, r in enumerate(rows)))
        return Failure(
            kind=FailureKind.BLOCK_TABLE_MISMATCH, step=plan.step, message="ranks hold different block tables", details=details[:10]
        )

    def _paranoid(self, plan, items, reads) -> Failure | None:
        """Gather raw read views and reassemble them explicitly."""
        raw = self.coll.all_gather_object([got for _, got, _ in reads])
        for k, (g, view) in enumerate(items):
            full_index, full_content = expected_full(self.groups[g], view)
            parts = [r[k] for r in raw]
            if self.groups[g].sharded:
                allrows = np.concatenate(parts)
                order = np.argsort(allrows[:, INDEX], kind="stable")
                ok = (
                    len(allrows) == len(full_index)
                    and np.array_equal(allrows[order, INDEX], full_index)
                    and np.array_equal(allrows[order, CONTENT], full_content)
                )
            else:
                ok = (
                    all(np.array_equal(p, parts[0]) for p in parts)
                    and np.array_equal(parts[0][:, INDEX], full_index)
                    and np.array_equal(parts[0][:, CONTENT], full_content)
                )
            if not ok:
                return Failure(
                    kind=FailureKind.REASSEMBLY,
                    step=plan.step,
                    message="paranoid reassembly of raw read views failed",
                    group=self.groups[g].name,
                    request_id=view.request_id,
                )
        return None
