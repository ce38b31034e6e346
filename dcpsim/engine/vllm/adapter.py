"""``VllmEngine``: an ``Engine`` whose decisions run vLLM's own code from a source tree.

Decisions made by vLLM code (the rest by the reference engine, and ``decisions`` says
which is which), each in a module of its own:

* ``write_slots``: vLLM's slot mapping kernels (``dcpsim.engine.vllm.slot_mapping``; rings
  stay with the reference, vLLM has no kernel for them here, and Mamba states are mapped by
  none);
* the scheduler side (``--vllm-scheduler``, ``dcpsim.engine.vllm.scheduler_choice``):
  vLLM's ``KVCacheManager`` decides every block, or its v1 ``Scheduler`` drives every step;
* ``group_geometry``: vLLM's spec classes (``dcpsim.engine.vllm.spec_classes``; validation
  stays the reference's);
* ``merge_across_ranks`` (``--attention``, ``--vllm-merge``): vLLM's combine wrappers on a
  sample of each merge's rows (``dcpsim.engine.vllm.merge_choice``), with the LSE base of the
  attention backend (``dcpsim.engine.vllm.backends``); the ranks' attention computes its
  LSEs in that base too (``Engine.lse_base``);
* ``kernel_block_table`` (``Bk < B``), ``local_seq_lens`` and ``query_local_bounds``
  (``dcpsim.engine.vllm.attention_metadata``).

vLLM's functions are looked up with their signatures checked when the engine is built, and an
exception raised inside vLLM's code is a ``VllmCallError`` naming the function
(``dcpsim.engine.vllm.functions``; the harness turns it into exit 3 naming the rank).
"""

from __future__ import annotations

import numpy as np

from dcpsim.engine.interface import EngineError
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.vllm import attention_metadata as metadata
from dcpsim.engine.vllm import slot_mapping
from dcpsim.engine.vllm.attention_metadata import (
    KERNEL_TABLE_ARGS,
    KERNEL_TABLE_FUNCTION,
    KERNEL_TABLE_MODULE,
    LENS_ARGS,
    LENS_FUNCTION,
    LENS_MODULE,
)
from dcpsim.engine.vllm.backends import DEFAULT_BACKEND, read_backend
from dcpsim.engine.vllm.core import load_with_core
from dcpsim.engine.vllm.functions import SUPPORTED_VERSIONS, VllmCallError, lookup
from dcpsim.engine.vllm.loader import SourceTree, source_dir
from dcpsim.engine.vllm.merge import DEFAULT_PROGRAMS, WRAPPERS, VllmCombine
from dcpsim.engine.vllm.merge_choice import COMBINE_MODULE, MERGE_MODULES, VLLM_MERGES, WRAPPER_ARGS, merge_decision, merge_with_vllm
from dcpsim.engine.vllm.scheduler_choice import VLLM_SCHEDULERS, runs_vllm_core, scheduler_class, scheduler_sides
from dcpsim.engine.vllm.slot_mapping import KERNELS, RUNNER_MODULES, V1_MODULE
from dcpsim.engine.vllm.sparse import SPARSE_ARGS, SPARSE_DECISIONS, SPARSE_FUNCTION, SPARSE_MODULE, filter_last_token
from dcpsim.engine.vllm.spec_classes import SPEC_MODULES, SPECS_MODULE, WIDTH_ARGS, WIDTH_FUNCTION, vllm_geometry, vllm_spec
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Storage

__all__ = ["SUPPORTED_VERSIONS", "VLLM_MERGES", "VLLM_SCHEDULERS", "VllmCallError", "VllmEngine"]


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
        if runner not in KERNELS:
            raise ConfigError(f"--vllm-runner must be v1 or v2, got {runner!r}")
        if scheduler not in VLLM_SCHEDULERS:
            raise ConfigError(f"--vllm-scheduler must be one of {', '.join(VLLM_SCHEDULERS)}, got {scheduler!r}")
        if merge not in VLLM_MERGES:
            raise ConfigError(f"--vllm-merge must be one of {', '.join(VLLM_MERGES)}, got {merge!r}")
        self.runner, self.merge, self.scheduler = runner, merge, scheduler
        self.tree = SourceTree(source_dir(vllm_source))
        self.version = self.tree.version
        self.backend = read_backend(str(self.tree.root), attention_backend)
        self.lse_base = self.backend.lse_base
        names = [*RUNNER_MODULES[runner], V1_MODULE, LENS_MODULE, *MERGE_MODULES, KERNEL_TABLE_MODULE, *SPEC_MODULES]
        self.core = None
        if runs_vllm_core(scheduler):
            mods, self.core = load_with_core(self.tree, names, scheduler=scheduler == "full")
        else:
            mods = self.tree.load(names)
        self._look_up(mods, merge_programs)
        self.decisions = self._decisions(merge_programs)
        """Decision -> what makes it; every other decision is the reference engine's."""

    def _look_up(self, mods: dict, merge_programs: int) -> None:
        """vLLM's functions this engine calls, their signatures checked (exit 2 otherwise)."""
        self._slot_kernel = lookup(self.tree, mods, *KERNELS[self.runner])
        self._specs = mods[SPECS_MODULE]
        for wrapper in WRAPPERS.values():
            lookup(self.tree, mods, COMBINE_MODULE, wrapper, WRAPPER_ARGS)
        self._combine = VllmCombine(mods[COMBINE_MODULE], self.backend.lse_base_on_e, merge_programs)
        self._kernel_table = lookup(self.tree, mods, KERNEL_TABLE_MODULE, KERNEL_TABLE_FUNCTION, KERNEL_TABLE_ARGS)
        self._local_lens = lookup(self.tree, mods, LENS_MODULE, LENS_FUNCTION, LENS_ARGS)
        self._table_width = lookup(self.tree, mods, V1_MODULE, WIDTH_FUNCTION, WIDTH_ARGS)

    def _decisions(self, merge_programs: int) -> dict:
        lens = f"{LENS_MODULE}.{LENS_FUNCTION}"
        decisions = {
            "group_geometry": f"vllm {SPECS_MODULE} spec classes (dcp_sharded, max_num_blocks_per_req, "
            "page_size_bytes, max_memory_usage_bytes); "
            "validation: reference",
            "write_slots": f"vllm {slot_mapping.kernel_name(self.runner)} (rings and Mamba states: reference)",
            "local_seq_lens": f"vllm {lens}",
            "query_local_bounds": f"vllm {lens}",
            "kernel_block_table": f"vllm {KERNEL_TABLE_MODULE}.{KERNEL_TABLE_FUNCTION} (when Bk < B)",
            "merge_across_ranks": merge_decision(self.merge, self.backend, merge_programs),
            "shard_lse": f"reference, in base {self.lse_base} (vllm {self.backend.describe()})",
        }
        decisions.update(SPARSE_DECISIONS)
        sides, self.scheduler_decisions = scheduler_sides(self.scheduler)
        """Each scheduler-side decision -> the vLLM function (and file) that makes it."""
        decisions.update(sides)
        return decisions

    # --- the scheduler: vLLM's KVCacheManager decides every block ------------------------

    def make_scheduler(self, scenario, geometries, connector=None):
        if self.core is None:
            return super().make_scheduler(scenario, geometries, connector=connector)
        return scheduler_class(self.scheduler)(scenario, self, geometries, connector=connector)

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

    # --- sparse attention: vLLM's DCP filter of the top-k ids ---------------------------

    def sparse_local_keys(self, geometry, selected, dcp_rank):
        local = super().sparse_local_keys(geometry, selected, dcp_rank)
        if not geometry.sharded or not len(local) or not local.shape[1]:
            return local
        if getattr(self, "_sparse_filter", None) is None:  # loaded on first use: dense models never need it
            mods = self.tree.load([*MERGE_MODULES[:2], SPARSE_MODULE])
            self._sparse_filter = lookup(self.tree, mods, SPARSE_MODULE, SPARSE_FUNCTION, SPARSE_ARGS)
        return filter_last_token(self._sparse_filter, geometry, selected, local, dcp_rank)

    # --- geometry through vLLM's spec classes ----------------------------------------

    def vllm_spec(self, spec):
        """vLLM's spec of the same class name as one of the scenario's layer specs."""
        return vllm_spec(self.tree, self._specs, spec)

    def group_geometry(self, group_id, group, config):
        g = super().group_geometry(group_id, group, config)  # validation, storage, retention
        return vllm_geometry(g, self.vllm_spec(group.representative), group, config, self._table_width)

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
        slots = slot_mapping.slot_mapping(self.runner, self._slot_kernel, geometry, indices, block_rows, dcp_rank)
        return list(zip(slots, indices))

    # --- the merge across ranks -----------------------------------------------------

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        """vLLM's combine wrapper of ``variant`` on a sample of the rows, the reference on the
        whole batch; vLLM's rows replace the reference's (``merge_choice.merge_with_vllm``)."""
        merged = super().merge_across_ranks(out, lse, group, variant=variant, base=base)
        if self.merge != "vllm" or group.world_size == 1 or not out.shape[0]:
            return merged
        return merge_with_vllm(self._combine, merged, out, lse, group, variant)

    # --- attention metadata ---------------------------------------------------------

    def kernel_block_table(self, geometry, block_row):
        return metadata.kernel_block_table(self._kernel_table, geometry, block_row)

    def local_seq_lens(self, geometry, seq_lens, dcp_rank):
        return metadata.local_seq_lens(self._local_lens, geometry, seq_lens, dcp_rank)

    def query_local_bounds(self, geometry, start, stop, dcp_rank):
        lens = np.arange(start, stop, dtype=np.int64) + 1
        if geometry.storage is Storage.RECORDS:  # records emitted at positions <= p
            lens = lens // geometry.tokens_per_state
        return self.local_seq_lens(geometry, lens, dcp_rank)
