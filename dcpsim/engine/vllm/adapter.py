"""``VllmEngine``: an ``Engine`` whose decisions run vLLM's own code from a source tree.

Decisions made by vLLM code (the rest by the reference engine, and ``decisions`` says
which is which):

* ``write_slots``: the slot mapping kernel of model runner v2,
  ``vllm/v1/worker/gpu/block_table.py::_compute_slot_mappings_kernel`` (one launch per
  group per step over all of the step's writes, with the group's ``dcp_sharded`` flag), or
  with ``runner="v1"`` ``vllm/v1/worker/block_table.py::ComputeSlotMappingKernel.kernel``
  (a replicated group runs it with a DCP world of 1). Compressed-record groups run the
  kernel over record indices, their pages counted in records. Rings stay with the
  reference (vLLM has no kernel for them here).
* the scheduler side (``scheduler="manager"``, the default): vLLM's ``KVCacheManager``
  decides every block (``dcpsim.engine.vllm.scheduler``; ``SCHEDULER_SIDE`` names each
  decision's function); with ``scheduler="full"`` vLLM's v1 ``Scheduler`` drives every
  step on it (``dcpsim.engine.vllm.full_scheduler``; ``scheduler_decisions`` names who
  decides what).
* ``group_geometry``: whether a group is sharded (``dcp_sharded`` of vLLM's own spec
  classes in ``vllm/v1/kv_cache_interface.py``, built from the scenario's specs; a
  replicated spec becomes ``dcp_sharded=False``, or ``dcp_replicated=True`` on a fork that
  has that field), the manager block size that follows from it, and the block-table width
  (the spec's ``max_num_blocks_per_req``, widened by vLLM's ``get_block_table_width``); validation
  stays the reference's.
* ``merge_across_ranks`` (``--attention``; ``merge="vllm"``, the default of
  ``--vllm-merge``): vLLM's combine wrappers themselves, ``cp_lse_ag_out_rs`` (allgather)
  and ``dcp_a2a_lse_reduce`` (alltoall) of ``vllm/v1/attention/ops/dcp.py``, over the
  rank's group (``dcpsim.engine.vllm.merge``), on a sample of each merge's rows
  (``merge_programs``; the reference merges the rest), with the LSE base of the attention
  backend (``attention_backend``, read from the tree by ``dcpsim.engine.vllm.backends``);
  the ranks' attention computes its LSEs in that base too (``Engine.lse_base``).
* ``kernel_block_table`` (``Bk < B``): ``vllm/v1/worker/utils.py::AttentionGroup.
  map_to_kernel_block_table``, called on a stand-in for the attention group that holds
  only what it reads (the kernel block size, the spec's block size, its buffers).
* ``local_seq_lens`` and ``query_local_bounds``:
  ``vllm/v1/attention/backends/utils.py::get_dcp_local_seq_lens`` (the per-token bound of
  query token ``j`` is the local length of ``start + j + 1``).

An exception raised inside vLLM's code is reported as a ``VllmCallError`` naming the
function (the harness turns it into exit 3 naming the rank).
"""

from __future__ import annotations

import dataclasses
import inspect
import types

import numpy as np
import torch

from dcpsim.engine.interface import EngineError, MergedBy
from dcpsim.engine.loading.interpreter import sample_rows
from dcpsim.engine.loading.placeholders import is_placeholder
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.vllm.backends import DEFAULT_BACKEND, read_backend
from dcpsim.engine.vllm.core import load_with_core
from dcpsim.engine.vllm.full_scheduler import FULL_SCHEDULER_DECISIONS, VllmFullScheduler
from dcpsim.engine.vllm.loader import INTERPRETER_LOCK, SourceTree, source_dir
from dcpsim.engine.vllm.merge import ALLGATHER, ALLTOALL, DEFAULT_PROGRAMS, WRAPPERS, VllmCombine
from dcpsim.engine.vllm.scheduler import SCHEDULER_DECISIONS, VllmScheduler
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Storage
from dcpsim.model.layout import PAD
from dcpsim.model.specs import MambaSpec

SUPPORTED_VERSIONS = ("0.33.0",)
VLLM_SCHEDULERS = ("manager", "full", "dcpsim")
"""``--vllm-scheduler``: vLLM's ``KVCacheManager`` decides every block in dcpsim's step loop
(``manager``, the default), vLLM's v1 ``Scheduler`` drives the steps (``full``), or
dcpsim's own scheduler does (``dcpsim``: only the worker side runs vLLM's code)."""
_MANAGER = "vllm vllm.v1.core.kv_cache_manager.KVCacheManager"
SCHEDULER_SIDE = {
    "make_scheduler": f"{_MANAGER} in dcpsim's step loop (dcpsim.engine.vllm.scheduler)",
    "blocks_needed": f"{_MANAGER}.allocate_slots (its coordinator's get_num_blocks_to_allocate; None: preempt)",
    "first_needed_position": f"{_MANAGER}.allocate_slots (remove_skipped_blocks, lazily at the next allocation)",
    "num_released_blocks": f"{_MANAGER}.allocate_slots (remove_skipped_blocks)",
    "prefix_block_tokens": f"{_MANAGER}.get_computed_blocks (find_longest_cache_hit)",
    "prefix_hash_unit": f"{_MANAGER}.get_computed_blocks (find_longest_cache_hit)",
    "prefix_hash_block_size": "vllm vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes",
    "prefix_key_position": "vllm vllm.v1.core.kv_cache_utils.get_request_block_hasher (vLLM's block hashes)",
}
"""Who makes the scheduler-side decisions under ``--vllm-scheduler manager``."""
_SCHEDULER = "vllm vllm.v1.core.sched.scheduler.Scheduler"
FULL_SCHEDULER_SIDE = {
    **SCHEDULER_SIDE,
    "make_scheduler": f"{_SCHEDULER}.schedule and .update_from_output drive every step (dcpsim.engine.vllm.full_scheduler)",
}
"""Who makes the scheduler-side decisions under ``--vllm-scheduler full``."""
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
WIDTH_FUNCTION, WIDTH_ARGS = "get_block_table_width", ("max_num_blocks", "block_size")
"""The worker's block-table row width: max_num_blocks_per_req aligned to the spec's tokens."""
LENS_MODULE, LENS_FUNCTION = "vllm.v1.attention.backends.utils", "get_dcp_local_seq_lens"
LENS_ARGS = ("seq_lens", "dcp_size", "dcp_rank", "cp_kv_cache_interleave_size")
COMBINE_MODULE = "vllm.v1.attention.ops.dcp"
MERGE_MODULES = ("vllm.model_executor.warmup.jit_warmup", "vllm.model_executor.warmup.jit_warmup_triton_helper", COMBINE_MODULE)
"""The combine wrappers' module, and vLLM's JIT launcher the correction kernel launches through."""
WRAPPER_ARGS = ("cp_attn_out", "cp_attn_lse", "cp_group")
VLLM_MERGES = ("vllm", "reference")
"""``--vllm-merge``: vLLM's combine wrappers (the default) or the reference merge."""
KERNEL_TABLE_MODULE, KERNEL_TABLE_FUNCTION = "vllm.v1.worker.utils", "AttentionGroup.map_to_kernel_block_table"
KERNEL_TABLE_ARGS = ("self", "block_table", "ubatch_idx")
SPECS_MODULE = "vllm.v1.kv_cache_interface"
SPEC_MODULES = ("vllm.utils.math_utils", "vllm.v1.kv_cache_layout", "vllm.v1.kv_cache_spec_registry", SPECS_MODULE)
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


class VllmCallError(RuntimeError):
    """vLLM's code raised inside a rank."""


def _arg_names(fn) -> tuple[str, ...]:
    names = getattr(fn, "arg_names", None)
    if names is None:
        target = getattr(fn, "fn", fn)
        names = list(inspect.signature(target).parameters)
    return tuple(names)


class VllmEngine(ReferenceEngine):
    name = "vllm"
    description = (
        "vLLM's own DCP code from a source tree: its KV cache manager, slot mapping kernels, local lengths, "
        "spec classes and combine wrappers"
    )

    def __init__(
        self,
        vllm_source: str | None = None,
        runner: str = "v2",
        merge: str = "vllm",
        scheduler: str = "manager",
        attention_backend: str = DEFAULT_BACKEND,
        merge_programs: int = DEFAULT_PROGRAMS,
    ):
        if runner not in ("v1", "v2"):
            raise ConfigError(f"--vllm-runner must be v1 or v2, got {runner!r}")
        if scheduler not in VLLM_SCHEDULERS:
            raise ConfigError(f"--vllm-scheduler must be one of {', '.join(VLLM_SCHEDULERS)}, got {scheduler!r}")
        if merge not in VLLM_MERGES:
            raise ConfigError(f"--vllm-merge must be one of {', '.join(VLLM_MERGES)}, got {merge!r}")
        self.runner = runner
        self.merge = merge
        self.scheduler = scheduler
        self.tree = SourceTree(source_dir(vllm_source))
        self.version = self.tree.version
        self.backend = read_backend(str(self.tree.root), attention_backend)
        self.lse_base = self.backend.lse_base
        names = [V1_MODULE, LENS_MODULE, *MERGE_MODULES, KERNEL_TABLE_MODULE, *SPEC_MODULES]
        if runner == "v2":
            names = ["vllm.v1.worker.gpu.buffer_utils", V2_MODULE, *names]
        self.core = None
        if scheduler in ("manager", "full"):
            mods, self.core = load_with_core(self.tree, names, scheduler=scheduler == "full")
        else:
            mods = self.tree.load(names)
        if runner == "v2":
            self._slot_kernel = self._function(mods, V2_MODULE, V2_KERNEL, V2_ARGS)
        else:
            self._slot_kernel = self._function(mods, V1_MODULE, V1_KERNEL, V1_ARGS)
        self._specs = mods[SPECS_MODULE]
        for wrapper in WRAPPERS.values():
            self._function(mods, COMBINE_MODULE, wrapper, WRAPPER_ARGS)
        self._combine = VllmCombine(mods[COMBINE_MODULE], self.backend.lse_base_on_e, merge_programs)
        self._kernel_table = self._function(mods, KERNEL_TABLE_MODULE, KERNEL_TABLE_FUNCTION, KERNEL_TABLE_ARGS)
        self._local_lens = self._function(mods, LENS_MODULE, LENS_FUNCTION, LENS_ARGS)
        self._table_width = self._function(mods, V1_MODULE, WIDTH_FUNCTION, WIDTH_ARGS)
        slot = f"{(V2_MODULE if runner == 'v2' else V1_MODULE)}.{V2_KERNEL if runner == 'v2' else V1_KERNEL}"
        lens = f"{LENS_MODULE}.{LENS_FUNCTION}"
        self.decisions = {
            "group_geometry": f"vllm {SPECS_MODULE} spec classes (dcp_sharded, max_num_blocks_per_req, "
            "page_size_bytes, max_memory_usage_bytes); "
            "validation: reference",
            "write_slots": f"vllm {slot} (rings and Mamba states: reference)",
            "local_seq_lens": f"vllm {lens}",
            "query_local_bounds": f"vllm {lens}",
            "kernel_block_table": f"vllm {KERNEL_TABLE_MODULE}.{KERNEL_TABLE_FUNCTION} (when Bk < B)",
        }
        self.decisions["merge_across_ranks"] = "reference (--vllm-merge reference)"
        self.decisions["shard_lse"] = f"reference, in base {self.lse_base} (vllm {self.backend.describe()})"
        if merge == "vllm":
            self.decisions["merge_across_ranks"] = (
                f"vllm {COMBINE_MODULE}.{ALLGATHER} (allgather) and .{ALLTOALL} (alltoall) with "
                f"is_lse_base_on_e={self.backend.lse_base_on_e} ({self.backend.name}), over the rank's group, on at most "
                f"{merge_programs} token x head programs of each merge (evenly spaced rows; the rest: reference)"
            )
        self.decisions["make_scheduler"] = "reference (--vllm-scheduler dcpsim)"
        self.scheduler_decisions = {}
        """Each scheduler-side decision -> the vLLM function (and file) that makes it."""
        if self.core is not None:
            self.decisions.update(FULL_SCHEDULER_SIDE if scheduler == "full" else SCHEDULER_SIDE)
            self.scheduler_decisions = FULL_SCHEDULER_DECISIONS if scheduler == "full" else SCHEDULER_DECISIONS
        """Decision -> what makes it; every other decision is the reference engine's."""

    # --- the scheduler: vLLM's KVCacheManager decides every block ------------------------

    def make_scheduler(self, scenario, geometries, connector=None):
        if self.core is None:
            return super().make_scheduler(scenario, geometries, connector=connector)
        scheduler_class = VllmFullScheduler if self.scheduler == "full" else VllmScheduler
        return scheduler_class(scenario, self, geometries, connector=connector)

    def check_scenario(self, scenario) -> None:
        """Build the run's scheduler once, in the parent: a configuration vLLM refuses (an
        assertion or error of its KV cache manager, or of its v1 Scheduler under ``full``) is
        exit 2 quoting vLLM's own words."""
        if self.core is None:
            return
        try:
            self.make_scheduler(scenario, self.geometries(scenario.layers, scenario.config))
        except EngineError as exc:
            raise ConfigError(
                f"vLLM {self.version} refuses this configuration: {exc.function} ({exc.file}:{exc.line}): {exc.message}"
            ) from None

    def _function(self, mods, module: str, qualname: str, args: tuple[str, ...]):
        obj = mods[module]
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None or is_placeholder(obj):
                raise ConfigError(self._where(module, qualname, "is missing"))
        have = _arg_names(obj)
        if tuple(have[: len(args)]) != args:
            raise ConfigError(self._where(module, qualname, f"has the signature ({', '.join(have)}), expected ({', '.join(args)})"))
        return obj

    def _where(self, module: str, qualname: str, what: str) -> str:
        file = self.tree.root / (module.replace(".", "/") + ".py")
        return (
            f"vLLM {self.version} at {self.tree.root}: {qualname} in {file} {what}; this adapter supports "
            f"vLLM {', '.join(SUPPORTED_VERSIONS)}"
        )

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            with INTERPRETER_LOCK:
                return fn(*args, **kwargs)
        except Exception as exc:  # reported with the function's name
            raise VllmCallError(f"vLLM {what} raised {type(exc).__name__}: {exc}") from exc

    # --- geometry through vLLM's spec classes ----------------------------------------

    def vllm_spec(self, spec):
        """vLLM's spec of the same class name as one of the scenario's layer specs."""
        cls = getattr(self._specs, type(spec).__name__, None)
        if cls is None or not dataclasses.is_dataclass(cls):
            raise ConfigError(self._where(SPECS_MODULE, type(spec).__name__, "is missing"))
        names = {f.name for f in dataclasses.fields(cls)}
        values = {
            f.name: getattr(spec, f.name)
            for f in dataclasses.fields(spec)
            if f.name in names and f.name not in ("dtype", "dtypes", "mamba_type", "dcp_replicated")
        }
        if isinstance(spec, MambaSpec):
            # torch dtypes; mamba_type (a backend enum the loader stubs) keeps vLLM's default,
            # which no geometry reads; dcp_sharded keeps vLLM's default for a state (False)
            values["dtypes"] = tuple(_TORCH_DTYPES.get(d, torch.uint8) for d in spec.dtypes)
        else:
            values["dtype"] = _TORCH_DTYPES.get(spec.dtype, torch.uint8)  # fp8 caches: one byte
            if "dcp_replicated" in names:  # a fork with the seed's flag
                values["dcp_replicated"] = spec.dcp_replicated
            else:
                values["dcp_sharded"] = not spec.dcp_replicated
        try:
            return cls(**values)
        except Exception as exc:  # a spec class vLLM changed
            raise ConfigError(
                self._where(SPECS_MODULE, type(spec).__name__, f"refused {sorted(values)}: {type(exc).__name__}: {exc}")
            ) from None

    def group_geometry(self, group_id, group, config):
        g = super().group_geometry(group_id, group, config)  # validation, storage, retention
        vspec = self.vllm_spec(group.representative)
        replicated = getattr(vspec, "dcp_replicated", None)
        sharded = (not replicated) if replicated is not None else bool(vspec.dcp_sharded)
        sharded = sharded and config.decode_context_parallel_size > 1 and g.storage is not Storage.RING
        vllm_config = types.SimpleNamespace(  # what the spec methods read of a VllmConfig
            parallel_config=types.SimpleNamespace(decode_context_parallel_size=config.decode_context_parallel_size),
            model_config=types.SimpleNamespace(max_model_len=config.max_model_len),
            cache_config=types.SimpleNamespace(mamba_cache_mode=getattr(group.representative, "mamba_cache_mode", "none")),
            max_in_flight_tokens=config.max_in_flight_tokens,
        )
        cls = f"{SPECS_MODULE}.{type(vspec).__name__}"
        width = self._call(f"{cls}.max_num_blocks_per_req", vspec.max_num_blocks_per_req, vllm_config, config.max_model_len)
        width = self._call(
            f"{V1_MODULE}.{WIDTH_FUNCTION}", self._table_width, width, vspec.block_size, token_alignment=vspec.block_table_token_alignment
        )
        memory = self._call(f"{cls}.max_memory_usage_bytes", vspec.max_memory_usage_bytes, vllm_config)
        return dataclasses.replace(
            g,
            sharded=sharded,
            block_table_width=int(width),
            page_size_bytes=int(vspec.page_size_bytes),
            max_memory_usage_bytes=int(memory),
            manager_block_size=g.block_size * (config.decode_context_parallel_size if sharded else 1),
        )

    # --- the write path -------------------------------------------------------------

    def write_slots(self, geometry, write, block_row, dcp_rank):
        return self.step_write_slots(geometry, [write], [block_row], dcp_rank)[0]

    def step_write_slots(self, geometry, writes, block_rows, dcp_rank):
        # rings: no vLLM kernel here; Mamba states: vLLM maps none (SlotMappingMode.NONE, the
        # block table is the state index)
        if geometry.storage in (Storage.RING, Storage.STATE) or not writes:
            return [super(VllmEngine, self).write_slots(geometry, w, r, dcp_rank) for w, r in zip(writes, block_rows)]
        if geometry.storage is Storage.RECORDS:
            R = geometry.tokens_per_state
            indices = [np.arange(w.start // R, w.stop // R, dtype=np.int64) for w in writes]
        else:
            indices = [np.arange(w.start, w.stop, dtype=np.int64) for w in writes]
        slots = self._slot_mapping(geometry, indices, block_rows, dcp_rank)
        return list(zip(slots, indices))

    def _slot_mapping(self, g, indices, block_rows, dcp_rank) -> list[np.ndarray]:
        """One kernel launch over every request's indices (positions, or records)."""
        n = len(indices)
        width = max(1, max(len(r) for r in block_rows))
        table = torch.zeros((n, width), dtype=torch.int32)
        for i, row in enumerate(block_rows):
            table[i, : len(row)] = torch.as_tensor(np.asarray(row), dtype=torch.int32)
        lens = [len(ix) for ix in indices]
        qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
        total = int(qsl[-1])
        positions = torch.from_numpy(np.concatenate(indices)) if total else torch.zeros(0, dtype=torch.int64)
        page = g.states_per_page
        W, I = g.dcp_size, g.interleave_size
        # one pass of the kernel's loop per request (the result does not depend on it)
        block = 1 << max(10, int(max(lens, default=1) - 1).bit_length())
        if self.runner == "v2":
            out = torch.full((1, max(total, 1)), PAD_ID, dtype=torch.int64)
            self._call(
                f"{V2_MODULE}.{V2_KERNEL}",
                self._slot_kernel[(1, n + 1)],
                total,
                torch.arange(n, dtype=torch.int32),
                qsl,
                positions,
                torch.tensor([table.data_ptr()], dtype=torch.int64),
                torch.tensor([width], dtype=torch.int32),
                torch.tensor([page], dtype=torch.int32),
                torch.tensor([True]),
                torch.tensor([g.sharded]),
                out,
                out.stride(0),
                dcp_rank,
                CP_SIZE=W,
                CP_INTERLEAVE=I,
                PAD_ID=PAD_ID,
                TRITON_BLOCK_SIZE=block,
            )
            flat = out[0, :total].numpy()
        else:
            out = torch.full((max(total, 1),), PAD_ID, dtype=torch.int64)
            world, rank = (W, dcp_rank) if g.sharded else (1, 0)
            self._call(
                f"{V1_MODULE}.{V1_KERNEL}",
                self._slot_kernel[(n + 1,)],
                total,
                total,
                qsl,
                positions,
                table,
                width,
                out,
                KV_CACHE_BLOCK_SIZE=page,
                TOTAL_CP_WORLD_SIZE=world,
                TOTAL_CP_RANK=rank,
                CP_KV_CACHE_INTERLEAVE_SIZE=I,
                PAD_ID=PAD_ID,
                BLOCK_SIZE=block,
            )
            flat = out[:total].numpy()
        flat = np.where(flat == PAD_ID, PAD, flat).astype(np.int64)
        return np.split(flat, np.cumsum(lens)[:-1]) if n > 1 else [flat]

    # --- the merge across ranks -----------------------------------------------------

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        """vLLM's combine wrapper of ``variant`` on a sample of the rows (``VllmCombine``,
        ``sample_rows``), the reference on the whole batch; vLLM's rows replace the
        reference's. At W = 1 vLLM combines nothing (its layers skip the wrappers)."""
        ref_out, ref_lse, c = super().merge_across_ranks(out, lse, group, variant=variant, base=base)
        if self.merge != "vllm" or group.world_size == 1 or not out.shape[0]:
            return ref_out, ref_lse, c
        q, heads, _ = out.shape
        rows = torch.from_numpy(sample_rows(q, heads, self._combine.programs))
        got, merged = self._call_merge(variant, out[rows], lse[rows], group)
        if c != group.rank:  # the reference hands out slice c (to judge the final gather): rank c's vLLM rows
            got = group.all_gather_tensor(got.contiguous())[c]
            merged = group.all_gather_tensor(merged.contiguous())[c]
        ref_out, ref_lse = ref_out.clone(), ref_lse.clone()
        ref_out[rows], ref_lse[rows] = got.to(ref_out.dtype), merged.to(ref_lse.dtype)
        return ref_out, ref_lse, c, MergedBy(f"{COMBINE_MODULE}.{WRAPPERS[variant]}", len(rows), q)

    def _call_merge(self, variant, out, lse, group):
        try:
            return self._combine.merge(variant, out, lse, group)
        except Exception as exc:  # reported with the wrapper's name (the rank fails, naming it)
            raise VllmCallError(f"vLLM {COMBINE_MODULE}.{WRAPPERS[variant]} raised {type(exc).__name__}: {exc}") from exc

    # --- attention metadata ---------------------------------------------------------

    def kernel_block_table(self, geometry, block_row):
        page, bk = geometry.states_per_page, geometry.kernel_block_size
        if bk is None or bk == page:
            return np.asarray(block_row, dtype=np.int64)
        k = page // bk
        row = torch.as_tensor(np.asarray(block_row), dtype=torch.int32).reshape(1, -1)
        group = types.SimpleNamespace(  # what map_to_kernel_block_table reads of an AttentionGroup
            kernel_block_size=bk,
            kv_cache_spec=types.SimpleNamespace(block_size=page),
            kernel_block_table=torch.zeros((1, 1, row.shape[1] * k), dtype=torch.int32),
            kernel_block_offsets=torch.arange(k, dtype=torch.int32),
            kernel_block_stride=0,
        )
        out = self._call(f"{KERNEL_TABLE_MODULE}.{KERNEL_TABLE_FUNCTION}", self._kernel_table, group, row)
        return out.reshape(-1).numpy().astype(np.int64)

    def local_seq_lens(self, geometry, seq_lens, dcp_rank):
        lens = np.asarray(seq_lens, dtype=np.int64)
        if not geometry.sharded:
            return lens
        out = self._call(
            f"{LENS_MODULE}.{LENS_FUNCTION}",
            self._local_lens,
            torch.from_numpy(lens),
            geometry.dcp_size,
            dcp_rank,
            geometry.interleave_size,
        )
        return out.numpy().astype(np.int64)

    def query_local_bounds(self, geometry, start, stop, dcp_rank):
        lens = np.arange(start, stop, dtype=np.int64) + 1
        if geometry.storage is Storage.RECORDS:  # records emitted at positions <= p
            lens = lens // geometry.tokens_per_state
        return self.local_seq_lens(geometry, lens, dcp_rank)
