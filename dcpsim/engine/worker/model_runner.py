"""The write path of one rank: apply a step's plan to the rank's block tables and KV stores.

The engine decides every slot (``Engine.write_slots``); this module only syncs the block
tables to the plan, writes fingerprint rows (and, for the attention check, K/V vectors)
where the engine said, and keeps the step's write log, which the checker judges. A slot
outside a store, or an index the step does not compute, is logged but not written.

An optional ``observer`` (a ``WriteObserver``; the harness's ``--trace`` recorder) hears
when each group's writes of a step start and end; without one the write path is unchanged.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.engine.interface import Engine
from dcpsim.engine.worker.block_table import BlockTable
from dcpsim.engine.worker.kv_store import KVStore
from dcpsim.model.distinct import has_repeats
from dcpsim.model.kinds import Storage
from dcpsim.model.kv_entry import FIELDS
from dcpsim.model.layout import PAD, local_seq_lens
from dcpsim.model.plan import (
    PAD_REQUEST,
    AttentionMetadata,
    BlockCopy,
    ContextGather,
    PcpQueryKeys,
    ReqWrite,
    SpecDecodeMask,
    StepPlan,
    WriteRecord,
)
from dcpsim.model.vectors import kv_vectors

ATTENTION_KV = (Storage.PAGED, Storage.RECORDS)
"""The storages of attention KV: the groups with attention metadata and draft writes."""


class WriteObserver(Protocol):
    """Hears the write path group by group (``ModelRunner(observer=...)``)."""

    def group_started(self, step: int, group_id: int) -> None: ...

    def group_written(self, step: int, group_id: int, records: list[WriteRecord]) -> None:
        """``records``: this group's entries of the step's write log."""


class ModelRunner:
    def __init__(
        self,
        engine: Engine,
        geometries: list[GroupGeometry],
        pool_sizes: list[int],
        rank: int,
        max_num_reqs: int,
        vector_width: int = 0,
        observer: WriteObserver | None = None,
        kv_heads: dict[int, np.ndarray] | None = None,
    ):
        """``vector_width > 0``: also store K/V vectors of that width (the attention check);
        ``kv_heads``: group id -> the KV heads (global) the rank holds in a group with several
        (``engine.attention.heads``), one vector each per slot, in that order."""
        self.engine = engine
        self.observer = observer
        self.geometries = geometries
        self.rank = rank
        self.vector_width = vector_width
        self.kv_heads = kv_heads or {}
        self.block_tables = [BlockTable(g.name, max_num_reqs, g.block_table_width) for g in geometries]
        self.stores = [
            KVStore(g.group_id, n + 1, g.states_per_page, vector_dim=self._vector_dim(g)) for g, n in zip(geometries, pool_sizes)
        ]
        self.write_log: list[WriteRecord] = []
        """What the last applied step wrote (every group, every request, in order)."""
        self.metadata_log: list[AttentionMetadata] = []
        """The last applied step's attention metadata, one per attention group."""
        self.builds_metadata = _implements(engine, "build_attention_metadata")
        self.gather_log: list[ContextGather] = []
        """The last applied step's context gathers, one per group whose prefill rows have a
        cached context (``Engine.context_gather``; empty for an engine without it)."""
        self.gathers_context = _implements(engine, "context_gather")
        self.mask_log: list[SpecDecodeMask] = []
        """The last applied step's spec-decode masks, one per sharded paged group of a speculative
        model whose step has decode rows (``Engine.spec_decode_mask``)."""
        self.builds_masks = _implements(engine, "spec_decode_mask") or _implements(engine, "query_local_bounds")
        self.pcp_keys_log: list[PcpQueryKeys] = []
        """The last step's PCP attention metadata of its split rows (``Engine.pcp_query_keys``),
        filled by the PCP split before the step is applied."""

    def apply(self, plan: StepPlan, request_ids: dict[int, str], during_step=None) -> None:
        """Write the step. ``during_step(plan, runner)``, if given, runs after the writes with
        the block tables the step ran with (before releases): the step's attention."""
        for table in self.block_tables:
            table.mark_read(False)
        self._sync_tables(plan.rows_before, request_ids)
        for table in self.block_tables:  # the rows the step reads: each one's first change keeps it
            table.mark_read(True)
        self.write_log = []
        self.metadata_log = []
        self.gather_log = []
        self.mask_log = []
        for copy in plan.copies:
            self._copy_block(copy)
        for geometry, table, store in zip(self.geometries, self.block_tables, self.stores):
            self._write_group(plan, geometry, table, store)
        if during_step is not None:
            during_step(plan, self)
        self._sync_tables(plan.rows_after, request_ids)

    def _copy_block(self, copy: BlockCopy) -> None:
        """A partial prefix-cache hit's copy-on-write on this rank: the states the rank holds of
        the block's first ``copy.tokens`` positions (its first ``local(tokens, rank)`` slots of
        the page when sharded, semantics section 2), from block ``src`` to block ``dst``."""
        geometry, store = self.geometries[copy.group], self.stores[copy.group]
        held = copy.tokens
        if geometry.sharded:
            held = int(
                local_seq_lens([copy.tokens], dcp_size=geometry.dcp_size, interleave_size=geometry.interleave_size, dcp_rank=self.rank)[0]
            )
        if not held:
            return
        page = store.states_per_page
        offsets = np.arange(held, dtype=np.int64)
        src, dst = copy.src * page + offsets, copy.dst * page + offsets
        store.write(dst, store.read(src))
        if store.vectors is not None:
            store.write_vectors(dst, store.read_vectors(src).numpy())

    def _sync_tables(self, rows_of_groups, request_ids: dict[int, str]) -> None:
        """Set each group's block table to its rows of the plan (``rows_before`` or ``rows_after``)."""
        for table, rows in zip(self.block_tables, rows_of_groups):
            table.sync(rows, request_ids)

    def _write_group(self, plan: StepPlan, geometry: GroupGeometry, table: BlockTable, store: KVStore) -> None:
        """One group's part of the step: its attention metadata (if the engine builds it),
        then every request's writes, logged in ``write_log``; the observer hears both ends."""
        observer = self.observer
        if observer is not None:
            observer.group_started(plan.step, geometry.group_id)
            logged = len(self.write_log)
        rows = [table.row(w.req_index) for w in plan.writes]
        mapped = self._group_write_slots(plan, geometry, table, rows)
        if self.builds_metadata and geometry.storage in ATTENTION_KV:
            self._build_group_metadata(plan, geometry, rows, store)
        if self.gathers_context and geometry.storage is Storage.PAGED:
            gather = self.engine.context_gather(geometry, list(plan.writes), rows, self.rank)
            if gather is not None:
                self.gather_log.append(gather)
        if self.builds_masks and geometry.sharded and geometry.storage is Storage.PAGED and geometry.num_speculative_tokens:
            self._build_mask(plan, geometry)
        writes = [(write, *self._log_write(geometry, write, slots, index)) for write, (slots, index) in zip(plan.writes, mapped)]
        self._store_step(plan.step, geometry, store, [w for w in writes if len(w[1])])
        if observer is not None:
            observer.group_written(plan.step, geometry.group_id, self.write_log[logged:])

    def _group_write_slots(self, plan: StepPlan, geometry: GroupGeometry, table: BlockTable, rows):
        """The engine's ``(slots, index)`` of each write of the step in this group, with the
        drafter's writes of a group that holds draft layers."""
        mapped = self.engine.step_write_slots(geometry, list(plan.writes), rows, self.rank)
        if geometry.draft and geometry.storage in ATTENTION_KV:
            mapped = self._with_draft_writes(geometry, table, plan, mapped)
        return mapped

    def _build_group_metadata(self, plan: StepPlan, geometry: GroupGeometry, rows, store: KVStore) -> None:
        """The step's attention metadata of an attention group; a group with draft layers
        also gets the drafter's own, built over the same block table."""
        self._build_metadata(plan, geometry, rows, store)
        if geometry.draft:
            self._build_metadata(plan, self.engine.draft_geometry(geometry), rows, store)

    def _build_mask(self, plan: StepPlan, geometry: GroupGeometry) -> None:
        """The engine's spec-decode mask of the step's decode rows (``1 <= q <= 1 + k`` tokens
        past a context, not a prefill row) in a sharded paged group."""
        q_max = 1 + geometry.num_speculative_tokens
        rows = [w for w in plan.writes if not w.prefill and w.start > 0 and 1 <= len(w.contents) <= q_max]
        if not rows:
            return
        context = np.array([w.start for w in rows], dtype=np.int64)
        q_lens = np.array([len(w.contents) for w in rows], dtype=np.int64)
        visible = self.engine.spec_decode_mask(geometry, context, q_lens, self.rank)
        self.mask_log.append(
            SpecDecodeMask(
                geometry.group_id, tuple(w.request_id for w in rows), context, q_lens, tuple(np.asarray(v, bool) for v in visible)
            )
        )

    def _log_write(self, geometry: GroupGeometry, write: ReqWrite, slots, index) -> tuple[np.ndarray, np.ndarray]:
        """Log one request's writes in a group (``PAD``, another rank's, dropped); the logged
        ``(slots, index)``, for the store."""
        slots, index = np.asarray(slots, np.int64), np.asarray(index, np.int64)
        if len(slots) and slots.min() < 0:  # drop PAD (not this rank's); other negatives stay, for the guard
            mine = slots != PAD
            slots, index = slots[mine], index[mine]
        self.write_log.append(WriteRecord(geometry.group_id, write.req_index, write.request_id, slots, index))
        return slots, index

    def _store_step(self, step: int, geometry: GroupGeometry, store: KVStore, logged: list) -> None:
        """Store a group's logged writes of the step (``(write, slots, index)`` of each request
        that has some) in one pass, as vLLM's one cache write over the step's ``slot_mapping``;
        request by request where a slot is written twice (a later request's entry then lands
        last, as it would in a step written request by request)."""
        slots = None
        if len(logged) > 1:
            slots = np.concatenate([s for _, s, _ in logged])
            if has_repeats(slots):
                for entry in logged:
                    self._store_entries(step, geometry, store, [entry])
                return
        self._store_entries(step, geometry, store, logged, slots)

    def _store_entries(self, step: int, geometry: GroupGeometry, store: KVStore, logged: list, slots: np.ndarray | None = None) -> None:
        """Write the fingerprint rows (and K/V vectors) of the logged ``(write, slots, index)``
        of some requests, at once (``slots``: theirs concatenated, when the caller has them); a
        slot outside the store, or an index the step does not compute, is left out."""
        if not logged:
            return
        writes = [w for w, _, _ in logged]
        if slots is None:
            slots = np.concatenate([s for _, s, _ in logged])
        index = np.concatenate([i for _, _, i in logged])
        lens = [len(s) for _, s, _ in logged]
        contents = [w.contents for w in writes]
        sizes = np.array([len(c) for c in contents], dtype=np.int64)
        tps = geometry.tokens_per_state

        def each(values) -> np.ndarray:  # a per-request value, for each of its entries
            return np.repeat(np.asarray(values, dtype=np.int64), lens)

        # what a state holds: the KV of its position, or of the position emitting a
        # record; an index the step does not compute has no KV to store
        emit = index * tps + each([tps - 1 - w.start for w in writes])
        num_contents, base, req = each(sizes), each(np.cumsum(sizes) - sizes), each([w.req_index for w in writes])
        # as unsigned, a negative value is above every bound: one reduction checks both ends
        if not (slots.view(np.uint64).max() < store.num_slots and (emit.view(np.uint64) < num_contents.view(np.uint64)).all()):
            keep = (slots >= 0) & (slots < store.num_slots) & (emit >= 0) & (emit < num_contents)
            slots, index, emit, base, req = slots[keep], index[keep], emit[keep], base[keep], req[keep]
        content = (np.concatenate(contents) if len(contents) > 1 else contents[0])[base + emit]  # no copy of a lone prefill chunk
        entries = np.empty((len(slots), len(FIELDS)), dtype=np.int64)
        entries[:, 0] = geometry.group_id
        entries[:, 1] = index
        entries[:, 2] = content
        entries[:, 3] = req
        entries[:, 4] = step
        store.write(slots, entries)
        if store.vectors is not None:
            heads = self.kv_heads.get(geometry.group_id)
            if heads is None:
                store.write_vectors(slots, kv_vectors(geometry.group_id, content, self.vector_width))
            else:  # one K/V vector per KV head the rank holds, head after head
                vectors = [kv_vectors(geometry.group_id, content, self.vector_width, int(h)) for h in heads]
                store.write_vectors(slots, np.concatenate(vectors, axis=1))

    def _vector_dim(self, geometry: GroupGeometry) -> int:
        """Floats of K/V a slot of the group holds: one vector per KV head held (none in a
        ring or a Mamba state)."""
        if geometry.storage in (Storage.RING, Storage.STATE):
            return 0
        heads = self.kv_heads.get(geometry.group_id)
        return self.vector_width * (1 if heads is None else len(heads))

    def _with_draft_writes(self, geometry: GroupGeometry, table: BlockTable, plan: StepPlan, mapped):
        """The draft layers' KV is written by the drafter, with the slot mapping of its own
        parallel config (``Engine.draft_geometry``) over the group's block table, read as a
        kernel reads it (null past the blocks held). A group of draft layers only takes the
        drafter's mapping; in a group the draft shares with the target (an MTP layer in the
        target's group), the draft layers' tensors are written where the drafter's mapping puts
        them, so the store gets the drafter's writes wherever they differ from the target's."""
        draft = self.engine.draft_geometry(geometry)
        rows = [table.padded_row(w.req_index, -(-w.stop // draft.block_size) + 1) for w in plan.writes]
        # a drafter at W = 1 is rank 0 of its own world
        drafted = self.engine.step_write_slots(draft, list(plan.writes), rows, self.rank % draft.dcp_size)
        if geometry.draft_only:
            return drafted
        out = []
        for (slots, index), (dslots, dindex) in zip(mapped, drafted):
            slots, index = np.asarray(slots, np.int64), np.asarray(index, np.int64)
            dslots, dindex = np.asarray(dslots, np.int64), np.asarray(dindex, np.int64)
            if len(dindex) == len(index) and (dindex == index).all():
                extra = (dslots != slots) & (dslots != PAD)
            else:  # another set of indices: every drafter write counts
                extra = dslots != PAD
            out.append((np.concatenate([slots, dslots[extra]]), np.concatenate([index, dindex[extra]])))
        return out

    def _build_metadata(self, plan: StepPlan, geometry: GroupGeometry, rows, store: KVStore) -> None:
        """The engine's metadata for the step; the dummy tokens of CUDA-graph padding are
        written where the engine mapped them (a correct engine maps them all to ``PAD``)."""
        meta = self.engine.build_attention_metadata(geometry, list(plan.writes), rows, self.rank)
        self.metadata_log.append(meta)
        slots = np.asarray(meta.padded_slot_mapping, np.int64)
        slots = slots[slots != PAD]
        if len(slots):
            self.write_log.append(WriteRecord(geometry.group_id, -1, PAD_REQUEST, slots, np.full(len(slots), -1)))
            inside = slots[(slots >= 0) & (slots < store.num_slots)]
            entries = np.zeros((len(inside), len(FIELDS)), dtype=np.int64)
            entries[:, 0], entries[:, 1], entries[:, 3], entries[:, 4] = geometry.group_id, -1, -1, plan.step
            store.write(inside, entries)


def _implements(engine: Engine, name: str) -> bool:
    """Whether the engine overrides the interface's ``name`` (a plugin may leave it out)."""
    return getattr(type(engine), name) is not getattr(Engine, name)
