"""Cleared page tails of a decode instance with asynchronous loads (P/D class 8, vllm#54875).

Where a kernel reads whole pages (masking unused slots by multiplying by zero, so a stale NaN
poisons the result), every slot of a request's pages past its length must hold the cleared value:
newly allocated blocks are cleared before use, and the blocks an asynchronous load fills, which are
not (clearing them would race the transfer), are cleared where the load did not write once it
completes (``docs/dcp-semantics.md`` section 11). The checker reads each running request's pages
through the rank's block table: every slot at a local index past the entries the rank must hold of
the request's computed tokens (``oracle.owned_mask``, from the scenario alone) must read
``EMPTY``. A slot holding an entry is stale: what the block's earlier request wrote.
"""

from __future__ import annotations

import numpy as np

from dcpsim.model.kinds import Storage
from dcpsim.model.kv_entry import EMPTY, GROUP, INDEX, STEP, WRITER
from dcpsim.model.plan import RequestView
from dcpsim.model.rank_view import RankView
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.oracle import owned_mask


def local_length(group: ExpectedGroup, view: RequestView, rank: int) -> int:
    """The entries rank ``rank`` holds of the request's computed tokens (its local indices
    ``0 .. n-1`` under vLLM's layout)."""
    return int(owned_mask(group, np.arange(view.num_committed, dtype=np.int64), rank, view.request_id).sum())


def judge_page_tails(groups: list[ExpectedGroup], rank_view: RankView, views, rank: int, names: dict[int, str] | None = None) -> list[str]:
    """What stale slots rank ``rank`` holds past the running requests' lengths in their pages, one
    line per (group, request, page), naming the stale entry's position, writer and step."""
    problems = []
    names = names or {}
    for group in groups:
        if group.storage is not Storage.PAGED or group.tokens_per_state != 1 or group.helix:
            continue
        store = rank_view.group_of_layer(group.layer_names[0])
        page = group.page_states
        for view in views:
            row = np.asarray(rank_view.block_table_row(store, view.req_index), dtype=np.int64)
            length = local_length(group, view, rank)
            local = np.arange(len(row) * page, dtype=np.int64)
            local = local[(local >= length) & (row[local // page] > 0)]
            if not len(local):
                continue
            entries = rank_view.read_entries(store, row[local // page] * page + local % page)
            stale = np.nonzero(entries[:, GROUP] != EMPTY)[0]
            for j in np.unique(local[stale] // page).tolist():
                on_page = stale[local[stale] // page == j]
                first = entries[on_page[0]]
                writer = names.get(int(first[WRITER]), str(int(first[WRITER])))
                problems.append(
                    f"decode rank {rank}: request {view.request_id} group {group.name} page {j} (block {int(row[j])}): "
                    f"{len(on_page)} slot(s) past its {length} local entries hold stale entries, not cleared "
                    f"(local index {int(local[on_page[0]])} holds position {int(first[INDEX])} of request {writer}, "
                    f"written at step {int(first[STEP])})"
                )
    return problems
