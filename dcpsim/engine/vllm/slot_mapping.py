"""The write path under ``--engine vllm``: vLLM's slot mapping kernels, one launch per group
per step over every write of the step.

``--vllm-runner v2`` (the default): model runner v2's
``vllm/v1/worker/gpu/block_table.py::_compute_slot_mappings_kernel`` with the group's
``dcp_sharded`` flag; ``v1``: ``vllm/v1/worker/block_table.py::ComputeSlotMappingKernel.kernel``
(a replicated group runs it with a DCP world of 1). Compressed-record groups run the kernel over
record indices (``indices``), their pages counted in records.
"""

from __future__ import annotations

import numpy as np
import torch

from dcpsim.engine.vllm.functions import call
from dcpsim.model.layout import PAD

PAD_ID = -1
V2_MODULE, V2_KERNEL = "vllm.v1.worker.gpu.block_table", "_compute_slot_mappings_kernel"
V2_ARGS = (
    "max_num_tokens",
    "idx_mapping",
    "query_start_loc",
    "pos",
    "block_table_ptrs",
    "block_table_strides",
    "block_sizes",
    "slot_mapping_enabled",
    "dcp_sharded",
    "slot_mappings_ptr",
    "slot_mappings_stride",
    "cp_rank",
    "CP_SIZE",
    "CP_INTERLEAVE",
    "PAD_ID",
    "TRITON_BLOCK_SIZE",
)
V1_MODULE, V1_KERNEL = "vllm.v1.worker.block_table", "ComputeSlotMappingKernel.kernel"
V1_ARGS = (
    "num_tokens",
    "max_num_tokens",
    "query_start_loc_ptr",
    "positions_ptr",
    "block_table_ptr",
    "block_table_stride",
    "slot_mapping_ptr",
    "KV_CACHE_BLOCK_SIZE",
    "TOTAL_CP_WORLD_SIZE",
    "TOTAL_CP_RANK",
    "CP_KV_CACHE_INTERLEAVE_SIZE",
    "PAD_ID",
    "BLOCK_SIZE",
)
KERNELS = {"v2": (V2_MODULE, V2_KERNEL, V2_ARGS), "v1": (V1_MODULE, V1_KERNEL, V1_ARGS)}
"""``--vllm-runner`` -> (module, kernel, its first parameters)."""
RUNNER_MODULES = {"v2": ("vllm.v1.worker.gpu.buffer_utils", V2_MODULE), "v1": ()}
"""What each runner's kernel needs loaded besides ``V1_MODULE`` (always loaded: the block-table width)."""


def kernel_name(runner: str) -> str:
    module, kernel, _ = KERNELS[runner]
    return f"{module}.{kernel}"


def slot_mapping(runner: str, kernel, g, indices, block_rows, dcp_rank) -> list[np.ndarray]:
    """One launch of ``kernel`` over every request's ``indices`` (positions, or records) with
    its block table row; each request's slots (``PAD`` where this rank stores nothing)."""
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
    launch = _launch_v2 if runner == "v2" else _launch_v1
    flat = launch(kernel, g, n, total, qsl, positions, table, width, dcp_rank, block)
    flat = np.where(flat == PAD_ID, PAD, flat).astype(np.int64)
    return np.split(flat, np.cumsum(lens)[:-1]) if n > 1 else [flat]


def _launch_v2(kernel, g, n, total, qsl, positions, table, width, dcp_rank, block) -> np.ndarray:
    out = torch.full((1, max(total, 1)), PAD_ID, dtype=torch.int64)
    call(
        kernel_name("v2"),
        kernel[(1, n + 1)],
        total,
        torch.arange(n, dtype=torch.int32),
        qsl,
        positions,
        torch.tensor([table.data_ptr()], dtype=torch.int64),
        torch.tensor([width], dtype=torch.int32),
        torch.tensor([g.states_per_page], dtype=torch.int32),
        torch.tensor([True]),
        torch.tensor([g.sharded]),
        out,
        out.stride(0),
        dcp_rank,
        CP_SIZE=g.dcp_size,
        CP_INTERLEAVE=g.interleave_size,
        PAD_ID=PAD_ID,
        TRITON_BLOCK_SIZE=block,
    )
    return out[0, :total].numpy()


def _launch_v1(kernel, g, n, total, qsl, positions, table, width, dcp_rank, block) -> np.ndarray:
    out = torch.full((max(total, 1),), PAD_ID, dtype=torch.int64)
    world, rank = (g.dcp_size, dcp_rank) if g.sharded else (1, 0)
    call(
        kernel_name("v1"),
        kernel[(n + 1,)],
        total,
        total,
        qsl,
        positions,
        table,
        width,
        out,
        KV_CACHE_BLOCK_SIZE=g.states_per_page,
        TOTAL_CP_WORLD_SIZE=world,
        TOTAL_CP_RANK=rank,
        CP_KV_CACHE_INTERLEAVE_SIZE=g.interleave_size,
        PAD_ID=PAD_ID,
        BLOCK_SIZE=block,
    )
    return out[:total].numpy()
