"""SGLang's merges across a rank's group (``kernels/ops/attention/dcp_kernels.py``), under Triton's
interpreter, on a sample of each merge's rows.

All-to-all: ``dcp_lse_combine_triton`` combines the ``W`` partial states each rank receives for its ``H / W`` heads, weighted by their
LSEs in the run's base, under Triton's interpreter (one Python call per row and head).

The all-to-all itself is the reference's exchange over the rank's group (SGLang packs output and
LSE into one buffer, ``dcp_pack_a2a_send``, and exchanges it the same way); the combine runs on at
most ``MERGE_PROGRAMS`` row x head programs of each merge (``loading.interpreter.sample_rows``, as the vLLM engine:
every row of a small merge, else evenly spaced rows with both ends, the same on every rank), whose
results replace the reference's rows.

All-gather: SGLang's MLA path (``srt/layers/dcp/comm.py::cp_lse_ag_out_rs_mla``) all-gathers the
float32 LSEs, corrects this rank's output with ``correct_attn_out`` (each head's output times
``base ** (lse_rank - lse_merged)``, written heads-first ``[H, rows, D]``), reduce-scatters it
over heads (rank ``i`` gets heads ``i * H / W ...``) and casts back. The collectives are the
rank's group's (the same all-gather and reduce-scatter); the kernel runs on the same sample of
rows, and each rank's merged slice is all-gathered so the engine returns another rank's slice,
as the reference does (the final gather is judged too).
"""

from __future__ import annotations

import numpy as np
import torch

from dcpsim.engine.loading.interpreter import sample_rows

COMBINE = "dcp_lse_combine_triton"
CORRECT = "correct_attn_out"
MERGE_PROGRAMS = 16


def combine_rows(combine, out: torch.Tensor, lse: torch.Tensor, group, *, base: str, programs: int = MERGE_PROGRAMS):
    """``(rows, merged out [len(rows), H / W, D], merged lse [len(rows), H / W])`` of this rank's
    heads, for the sampled rows of ``out [q, H, D]``, ``lse [q, H]``: every rank calls it
    with the same ``q`` (it runs one all-to-all over ``group``)."""
    q, heads, d = out.shape
    world = group.world_size
    hs = heads // world
    rows = sample_rows(q, hs, programs)
    picked = _padded(out[torch.from_numpy(rows)])
    dp = picked.shape[-1]
    packed = torch.cat([picked, lse[torch.from_numpy(rows)].unsqueeze(-1).to(picked.dtype)], dim=-1)
    send = packed.reshape(len(rows), world, hs, dp + 1).transpose(0, 1).contiguous()
    recv = group.all_to_all_tensor(send)  # [W, rows, hs, dp + 1]; recv[s] came from rank s
    got, merged = combine(recv[..., :dp].contiguous(), recv[..., dp].contiguous(), base == "e", True)
    return np.asarray(rows), got[..., :d], merged


def _padded(out: torch.Tensor) -> torch.Tensor:
    """``out [..., D]`` with zeros up to a power of two: ``HEAD_DIM`` is a ``tl.arange`` bound."""
    d = out.shape[-1]
    dp = 1 << max(0, (d - 1).bit_length())
    return out if dp == d else torch.cat([out, out.new_zeros((*out.shape[:-1], dp - d))], dim=-1)


def correct_rows(correct, out: torch.Tensor, lse: torch.Tensor, group, *, base: str, programs: int = MERGE_PROGRAMS):
    """``(rows, slice, merged out [len(rows), H / W, D], merged lse [len(rows), H / W])`` of
    slice ``(rank + 1) % W`` for the sampled rows of ``out [q, H, D]``, ``lse [q, H]``, merged
    as SGLang's ``cp_lse_ag_out_rs_mla`` does (see the module docstring); every rank calls it
    with the same ``q``. ``correct(out, lses, rank, new_output, is_lse_base_on_e)`` runs
    SGLang's ``correct_attn_out``."""
    q, heads, d = out.shape
    world, rank = group.world_size, group.rank
    hs = heads // world
    rows = sample_rows(q, heads, programs)
    picked = _padded(out[torch.from_numpy(rows)]).contiguous()
    mine = lse[torch.from_numpy(rows)].to(torch.float32).contiguous()
    lses = torch.stack(group.all_gather_tensor(mine)).contiguous()  # [W, rows, H]
    new_output = picked.new_empty(picked.transpose(0, 1).shape, dtype=torch.float32)  # [H, rows, Dp]
    corrected, merged = correct(picked, lses, rank, new_output, base == "e")
    part = group.reduce_scatter_tensor(corrected.reshape(world, hs, len(rows), -1).contiguous())  # [hs, rows, Dp]
    slices = torch.stack(group.all_gather_tensor(part.to(out.dtype).contiguous()))  # [W, hs, rows, Dp]
    c = (rank + 1) % world
    return np.asarray(rows), c, slices[c].transpose(0, 1)[..., :d], merged[:, c * hs : (c + 1) * hs]
