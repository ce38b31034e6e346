"""The write path under ``--engine vllm``: vLLM's slot mapping kernels, one launch per group
per step over every write of the step, in the shape the tree holds (``releases.WRITE_V2``,
``releases.WRITE_V1``).

``--vllm-runner v2`` (the default): model runner v2's
``vllm/v1/worker/gpu/block_table.py::_compute_slot_mappings_kernel``: with the group's
``dcp_sharded`` flag (0.31.0 on; 0.31.0 also takes ``kernel_block_sizes``, given the page size
as dcpsim's rows hold pages), or sharding every group (before: a replicated group never
reaches it, the spec classes refuse it). ``v1``: ``vllm/v1/worker/block_table.py``'s
``ComputeSlotMappingKernel.kernel`` or, before 0.29.0, ``_compute_slot_mapping_kernel`` (a
replicated group runs it with a DCP world of 1; ``BLOCKS_PER_KV_BLOCK`` is 1, the rows holding
pages). Compressed-record groups run the kernel over record indices (``indices``), their pages
counted in records.
"""

from __future__ import annotations

import numpy as np
import torch

from dcpsim.engine.loading.launch_key import pointers_to
from dcpsim.engine.vllm.functions import call
from dcpsim.model.layout import PAD

PAD_ID = -1
RUNNER_MODULES = {"v2": ("vllm.v1.worker.gpu.buffer_utils",), "v1": ()}
"""What each runner's kernel needs loaded besides its own module."""


def slot_mapping(shape, kernel, g, indices, block_rows, dcp_rank) -> list[np.ndarray]:
    """One launch of ``kernel`` (of ``shape``, a ``Shape`` of ``releases.WRITE_V2`` or
    ``WRITE_V1``) over every request's ``indices`` (positions, or records) with its block
    table row; each request's slots (``PAD`` where this rank stores nothing)."""
    n = len(indices)
    width = max(1, max(len(r) for r in block_rows))
    table = torch.zeros((n, width), dtype=torch.int32)
    for i, row in enumerate(block_rows):
        table[i, : len(row)] = torch.as_tensor(np.asarray(row), dtype=torch.int32)
    lens = [len(ix) for ix in indices]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    total = int(qsl[-1])
    positions = torch.from_numpy(np.concatenate(indices)) if total else torch.zeros(0, dtype=torch.int64)
    # one pass of the kernel's loop per request (the result does not depend on it)
    block = 1 << max(10, int(max(lens, default=1) - 1).bit_length())
    launch = _launch_v2 if shape.name.startswith("v2") else _launch_v1
    flat = launch(shape, kernel, g, n, total, qsl, positions, table, width, dcp_rank, block)
    flat = np.where(flat == PAD_ID, PAD, flat).astype(np.int64)
    return np.split(flat, np.cumsum(lens)[:-1]) if n > 1 else [flat]


def _launch_v2(shape, kernel, g, n, total, qsl, positions, table, width, dcp_rank, block) -> np.ndarray:
    out = torch.full((1, max(total, 1)), PAD_ID, dtype=torch.int64)
    page = torch.tensor([g.states_per_page], dtype=torch.int32)
    per_group = {
        "v2": (page, torch.tensor([True]), torch.tensor([g.sharded])),
        "v2-kernel-blocks": (page, page, torch.tensor([True]), torch.tensor([g.sharded])),
        "v2-kernel-blocks-all-sharded": (page, page, torch.tensor([True])),
        "v2-all-sharded": (page,),
    }[shape.name]
    call(
        f"{shape.module}.{shape.qualname}",
        kernel[(1, n + 1)],
        total,
        torch.arange(n, dtype=torch.int32),
        qsl,
        positions,
        pointers_to(table),  # the kernel loads the table's address (_load_ptr)
        torch.tensor([width], dtype=torch.int32),
        *per_group,
        out,
        out.stride(0),
        dcp_rank,
        CP_SIZE=g.dcp_size,
        CP_INTERLEAVE=g.interleave_size,
        PAD_ID=PAD_ID,
        TRITON_BLOCK_SIZE=block,
    )
    return out[0, :total].numpy()


def _launch_v1(shape, kernel, g, n, total, qsl, positions, table, width, dcp_rank, block) -> np.ndarray:
    out = torch.full((max(total, 1),), PAD_ID, dtype=torch.int64)
    world, rank = (g.dcp_size, dcp_rank) if g.sharded else (1, 0)
    page = g.states_per_page
    lead, blocks = {
        "v1": ((out,), dict(KV_CACHE_BLOCK_SIZE=page)),
        "v1-kernel-blocks": ((page, out), dict(KV_CACHE_BLOCK_SIZE=page, BLOCKS_PER_KV_BLOCK=1)),
        "v1-function": ((page, out), dict(KV_CACHE_BLOCK_SIZE=page, BLOCKS_PER_KV_BLOCK=1)),
        "v1-function-page": ((page, out), {}),
    }[shape.name]
    call(
        f"{shape.module}.{shape.qualname}",
        kernel[(n + 1,)],
        total,
        total,
        qsl,
        positions,
        table,
        width,
        *lead,
        **blocks,
        TOTAL_CP_WORLD_SIZE=world,
        TOTAL_CP_RANK=rank,
        CP_KV_CACHE_INTERLEAVE_SIZE=g.interleave_size,
        PAD_ID=PAD_ID,
        BLOCK_SIZE=block,
    )
    return out[:total].numpy()
