"""SGLang's MLA write kernels run on a probe of a rank's store: where each token's KV lands.

SGLang writes a step's MLA latents with ``set_mla_kv_buffer_dcp_sharded_triton``
(``kernels/ops/kvcache/mla_buffer.py``): every rank gets every token's widened id ``loc``
and the kernel stores the rows this rank owns, at row ``loc // W``; an entry without a rope
part goes to ``set_mla_kv_buffer_kernel_norope``. dcpsim runs the kernel as SGLang's memory
pool calls it, on a scratch buffer as wide as the widened id space (so a write past the
rank's store lands somewhere and is seen), whose token ``i`` has the tag ``i + 1`` in every
column of its nope (and rope) part; a row that holds one tag in every column was written by
that token, and its index is the slot.

Triton's interpreter runs one Python call per token (milliseconds each), so the Triton
kernel runs on at most ``programs`` tokens of a step's write (``evenly_spaced``: evenly spaced,
the first and last among them, the same on every rank); the rest go through SGLang's own
torch-native scatter ``set_mla_kv_buffer_naive`` (the path SGLang takes on a platform that
cannot launch Triton), so SGLang's code places every token. The kernel's placement of a
sampled token replaces the scatter's.
"""

from __future__ import annotations

import numpy as np
import torch

from dcpsim.engine.loading.interpreter import evenly_spaced
from dcpsim.model.layout import PAD

TRITON_WRITE = "set_mla_kv_buffer_dcp_sharded_triton"
TORCH_WRITE = "set_mla_kv_buffer_naive"
NOPE, ROPE = 2, 1
"""Columns of the probe's nope and rope parts: the kernels' row logic does not depend on
the widths (a real entry is 512 + 64: the kernel's one tile spans the boundary, as here)."""


def _tags(n: int, rope: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    tag = torch.arange(1, n + 1, dtype=torch.int64).reshape(-1, 1)
    return tag.repeat(1, NOPE).contiguous(), (tag.repeat(1, ROPE).contiguous() if rope else None)


def read_back(buffer: torch.Tensor, n: int) -> np.ndarray:
    """Slot of each of ``n`` tokens: the row holding its tag in every column, else ``PAD``."""
    rows = buffer.numpy()
    written = np.flatnonzero(rows.any(axis=1))
    slots = np.full(n, PAD, dtype=np.int64)
    whole = written[(rows[written] == rows[written, :1]).all(axis=1)]
    tags = rows[whole, 0]
    ok = (tags >= 1) & (tags <= n)
    slots[tags[ok] - 1] = whole[ok]
    return slots


def probe_slots(
    mla_buffer, loc: np.ndarray, *, rope: bool, dcp_size: int, dcp_rank: int, programs: int, call, base: np.ndarray | None = None
) -> np.ndarray:
    """The rank's slot of each widened id in ``loc`` (``PAD``: not written here), placed by
    SGLang's writes (see the module docstring). ``call(name, fn, *args, **kwargs)`` runs
    SGLang's function (its failures reported with its name); ``get_parallel()`` must give
    ``dcp_size`` and ``dcp_rank`` (the engine sets it). ``base``: the slots of the tokens the
    Triton kernel does not run on, for a tree without ``set_mla_kv_buffer_naive`` (before
    0.5.22); None: the scatter places them."""
    n = len(loc)
    if not n:
        return np.zeros(0, dtype=np.int64)
    width = NOPE + (ROPE if rope else 0)
    rows = int(loc.max()) + 1
    locs = torch.from_numpy(np.ascontiguousarray(loc, dtype=np.int64))
    if base is not None:
        slots = np.asarray(base, dtype=np.int64).copy()
    else:
        slots = _scatter(mla_buffer, locs, rows, width, n, rope, dcp_size, dcp_rank, call)
    chosen = evenly_spaced(n, programs)
    if len(chosen):
        buffer = torch.zeros((rows, width), dtype=torch.int64)
        knope, krope = _tags(len(chosen), rope)
        call(TRITON_WRITE, mla_buffer.set_mla_kv_buffer_dcp_sharded_triton, buffer, locs[torch.from_numpy(chosen)], knope, krope)
        slots[chosen] = read_back(buffer, len(chosen))
    return slots


def _scatter(mla_buffer, locs, rows: int, width: int, n: int, rope: bool, dcp_size: int, dcp_rank: int, call) -> np.ndarray:
    """Every token's slot by SGLang's torch-native scatter ``set_mla_kv_buffer_naive``."""
    nope, rope_part = _tags(n, rope)
    buffer = torch.zeros((rows, width), dtype=torch.int64)
    call(
        TORCH_WRITE,
        mla_buffer.set_mla_kv_buffer_naive,
        buffer,
        locs,
        nope,
        rope_part,
        reserved_skip_index=0,
        dcp_world_size=dcp_size,
        dcp_rank=dcp_rank,
    )
    return read_back(buffer, n)
