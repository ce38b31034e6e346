"""SGLang's all-to-all merge: ``dcp_lse_combine_triton`` (``kernels/ops/attention/dcp_kernels.py``)
combines the ``W`` partial states each rank receives for its ``H / W`` heads, weighted by their
LSEs in the run's base, under Triton's interpreter (one Python call per row and head).

The all-to-all itself is the reference's exchange over the rank's group (SGLang packs output and
LSE into one buffer, ``dcp_pack_a2a_send``, and exchanges it the same way); the combine runs on at
most ``MERGE_PROGRAMS`` row x head programs of each merge (``loading.interpreter.sample_rows``, as the vLLM engine:
every row of a small merge, else evenly spaced rows with both ends, the same on every rank), whose
results replace the reference's rows.
"""

from __future__ import annotations

import numpy as np
import torch

from dcpsim.engine.loading.interpreter import sample_rows

COMBINE = "dcp_lse_combine_triton"
MERGE_PROGRAMS = 16


def combine_rows(combine, out: torch.Tensor, lse: torch.Tensor, group, *, base: str, programs: int = MERGE_PROGRAMS):
    """``(rows, merged out [len(rows), H / W, D], merged lse [len(rows), H / W])`` of this rank's
    heads, for the sampled rows of ``out [q, H, D]``, ``lse [q, H]``: every rank calls it
    with the same ``q`` (it runs one all-to-all over ``group``)."""
    q, heads, d = out.shape
    world = group.world_size
    hs = heads // world
    rows = sample_rows(q, hs, programs)
    dp = 1 << max(0, (d - 1).bit_length())  # HEAD_DIM is a tl.arange bound: a power of two
    picked = out[torch.from_numpy(rows)]
    if dp != d:
        picked = torch.cat([picked, picked.new_zeros((*picked.shape[:-1], dp - d))], dim=-1)
    packed = torch.cat([picked, lse[torch.from_numpy(rows)].unsqueeze(-1).to(picked.dtype)], dim=-1)
    send = packed.reshape(len(rows), world, hs, dp + 1).transpose(0, 1).contiguous()
    recv = group.all_to_all_tensor(send)  # [W, rows, hs, dp + 1]; recv[s] came from rank s
    got, merged = combine(recv[..., :dp].contiguous(), recv[..., dp].contiguous(), base == "e", True)
    return np.asarray(rows), got[..., :d], merged
