"""The keys a prefill over a cached context reads when its context is gathered in chunks.

vLLM's MLA prefill attends to the cached context through the workspace its gather fills,
chunk by chunk (``Engine.context_gather``), and to the step's own tokens causally; the two
partial states are merged by their LSEs. On one rank that is attention over the keys of
every chunk it gathered (visible to every query token: the context lies before them all)
beside its own keys of the step's tokens, each token up to its bound
(``Engine.query_local_bounds``), read through the kernel block table. The rank's state is
then merged across ranks like any sharded one, so a gather that reads a key twice, or
rows past its piece, shows in the attention check.
"""

from __future__ import annotations

import numpy as np

from dcpsim.model.layout import PAD
from dcpsim.model.plan import ContextGather, ReqWrite


def gathered_keys(engine, geometry, write: ReqWrite, block_row: np.ndarray, rank: int, rows: np.ndarray, gather: ContextGather):
    """``(slots, mask, merged)`` as ``Engine.attention_metadata`` returns them, with the
    context read through the gather's slots instead of the block table."""
    rows = np.asarray(rows, dtype=np.int64)
    context = [gather.slots_of(k) for k in gather.entries_of(write.request_id)]
    context_slots = np.concatenate(context).astype(np.int64) if context else np.zeros(0, np.int64)
    bounds = np.asarray(engine.query_local_bounds(geometry, write.start, write.stop, rank), dtype=np.int64)[rows]
    first = int(np.asarray(engine.local_seq_lens(geometry, np.array([write.start], np.int64), rank))[0])
    own = np.arange(first, int(bounds.max(initial=first)), dtype=np.int64)
    kernel = geometry.kernel_block_size or geometry.states_per_page
    kernel_ids = np.asarray(engine.kernel_block_table(geometry, np.asarray(block_row, dtype=np.int64)), dtype=np.int64)
    page, offset = np.divmod(own, kernel)
    inside = page < len(kernel_ids)
    own_slots = np.full(len(own), PAD, dtype=np.int64)
    own_slots[inside] = kernel_ids[page[inside]] * kernel + offset[inside]
    mask = np.concatenate([np.ones((len(rows), len(context_slots)), dtype=bool), own[None, :] < bounds[:, None]], axis=1)
    return np.concatenate([context_slots, own_slots]), mask, geometry.sharded
