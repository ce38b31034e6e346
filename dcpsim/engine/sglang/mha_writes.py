"""SGLang's MHA write under DCP, run from its own code: the Triton attention backend's
``TritonAttnBackend._set_kv_buffer`` (``srt/layers/attention/triton_backend.py``) called unbound
on a minimal backend, over SGLang's own pool write ``MHATokenToKVPool.set_kv_buffer``
(``srt/mem_cache/memory_pool.py``) called unbound on a minimal pool whose buffers are a probe.

The backend decides the write: ``loc = out_cache_loc // W`` (a ``KVWriteLoc``) and the mask
``positions % W == rank``; the pool launches ``masked_set_kv_buffer_kernel`` (one program per
token under Triton's interpreter), which stores token ``i``'s K and V at row ``loc[i]`` where the
mask holds. The minimal objects hold only what those two methods read (``dcp_size``,
``dcp_rank``, ``token_to_kv_pool``; the pool's sizes, dtypes, per-layer buffers and the flag
``requires_physical_write_loc``).

The kernel runs on at most ``programs`` tokens of a step's write (``evenly_spaced``, as the MLA
write); for the other tokens the backend's method runs over a pool that records the ``loc`` and
mask it is handed, and the row of each token is ``loc`` where the mask holds (the kernel's
store, stated, not run). So the backend's rule is SGLang's for every token; the pool kernel's
placement on the sample.
"""

from __future__ import annotations

import types

import numpy as np
import torch

from dcpsim.engine.loading.interpreter import evenly_spaced
from dcpsim.engine.sglang.writes import read_back
from dcpsim.model.layout import PAD

POOL_MODULE = "sglang.srt.mem_cache.memory_pool"
BACKEND_MODULE = "sglang.srt.layers.attention.triton_backend"
BACKEND_WRITE = "TritonAttnBackend._set_kv_buffer"
POOL_WRITE = "MHATokenToKVPool.set_kv_buffer"
CALLS = (BACKEND_WRITE, POOL_WRITE)
WIDTH = 2
"""Columns of the probe's K and V rows (one head of two): the kernel's row logic does not
depend on them."""


class _Recorder:
    """A pool that records what the backend hands it."""

    def __init__(self):
        self.loc = self.mask = None

    def set_kv_buffer(self, layer, loc_info, k, v, *args, dcp_kv_mask=None, **kwargs):
        # a KVWriteLoc (0.5.22 on), or the local ids themselves (before)
        self.loc, self.mask = getattr(loc_info, "loc", loc_info), dcp_kv_mask


def _pool(pool_cls, rows: int):
    """SGLang's pool write bound to a minimal pool of ``rows`` probe rows."""
    pool = types.SimpleNamespace(
        size=rows,
        page_size=1,
        start_layer=0,
        is_quantized_kv_cache=False,
        requires_physical_write_loc=False,
        kernel_page_blocks=1,  # 0.5.20, 0.5.21 (the kernel page is the page)
        dtype=torch.int64,
        store_dtype=torch.int64,
        k_buffer=[torch.zeros((rows, WIDTH), dtype=torch.int64)],
        v_buffer=[torch.zeros((rows, WIDTH), dtype=torch.int64)],
    )
    if hasattr(pool_cls, "_check_physical_write_loc"):  # 0.5.22 on
        pool._check_physical_write_loc = types.MethodType(pool_cls._check_physical_write_loc, pool)
    pool.set_kv_buffer = types.MethodType(pool_cls.set_kv_buffer, pool)
    return pool


def _write(modules, pool, loc: torch.Tensor, positions: torch.Tensor, dcp_size: int, dcp_rank: int) -> None:
    """``TritonAttnBackend._set_kv_buffer`` on a minimal backend over ``pool``, with tags."""
    backend_cls = modules[BACKEND_MODULE].TritonAttnBackend
    backend = types.SimpleNamespace(dcp_size=dcp_size, dcp_rank=dcp_rank, token_to_kv_pool=pool)
    batch = types.SimpleNamespace(out_cache_loc=loc, out_cache_loc_is_physical=True, positions=positions, dcp_kv_mask=None)
    tag = torch.arange(1, len(loc) + 1, dtype=torch.int64).reshape(-1, 1, 1).repeat(1, 1, WIDTH)
    backend_cls._set_kv_buffer(backend, batch, types.SimpleNamespace(layer_id=0), None, tag, tag.clone())


def probe_mha_slots(modules, loc: np.ndarray, positions: np.ndarray, *, dcp_size: int, dcp_rank: int, programs: int, call) -> np.ndarray:
    """The rank's slot of each token (widened id ``loc``, position ``positions``); ``PAD``
    where this rank does not store it. ``call(name, fn, *args)`` runs SGLang's code."""
    n = len(loc)
    if not n:
        return np.zeros(0, dtype=np.int64)
    locs = torch.from_numpy(np.ascontiguousarray(loc, dtype=np.int64))
    pos = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
    recorder = _Recorder()
    call(BACKEND_WRITE, _write, modules, recorder, locs, pos, dcp_size, dcp_rank)
    rows, mask = recorder.loc.numpy(), recorder.mask.numpy().astype(bool)
    slots = np.where(mask, rows, PAD).astype(np.int64)
    chosen = evenly_spaced(n, programs)
    if len(chosen):
        picked = torch.from_numpy(chosen)
        # as wide as the widened id space: a store past the rank's rows lands in the probe
        pool = _pool(modules[POOL_MODULE].MHATokenToKVPool, int(loc.max()) + 2)
        call(POOL_WRITE, _write, modules, pool, locs[picked], pos[picked], dcp_size, dcp_rank)
        k, v = read_back(pool.k_buffer[0], len(chosen)), read_back(pool.v_buffer[0], len(chosen))
        slots[chosen] = np.where(k == v, k, PAD)
    return slots
