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

import logging

import numpy as np

from dcpsim.engine.interface import EngineError
from dcpsim.engine.loading.bindings import bind, resolve
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.vllm import attention_metadata as metadata
from dcpsim.engine.vllm import parallel_rules, slot_mapping
from dcpsim.engine.vllm.backends import DEFAULT_BACKEND, read_backend
from dcpsim.engine.vllm.core import engine_error, load_with_core
from dcpsim.engine.vllm.functions import KNOWN, VllmCallError
from dcpsim.engine.vllm.hybrid_layout import ENV, FLAG, Layout, has_chunk, manager_on, read_rule
from dcpsim.engine.vllm.loader import SourceTree, source_dir
from dcpsim.engine.vllm.merge import DEFAULT_PROGRAMS, VllmCombine
from dcpsim.engine.vllm.merge_choice import MERGE_HELPERS, VLLM_MERGES, merge_decision, merge_with_vllm
from dcpsim.engine.vllm.nixl_scheduler import PD_CONNECTOR_DECISION, nixl_decision_text
from dcpsim.engine.vllm.releases import VLLM_RELEASES, vllm_table
from dcpsim.engine.vllm.scheduler_choice import VLLM_SCHEDULERS, runs_vllm_core, scheduler_class, scheduler_sides
from dcpsim.engine.vllm.slot_mapping import RUNNER_MODULES
from dcpsim.engine.vllm.sparse import SPARSE_DECISIONS, filter_last_token
from dcpsim.engine.vllm.spec_classes import SPEC_HELPERS, SPECS_MODULE, vllm_geometry, vllm_spec
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Storage

__all__ = ["VLLM_MERGES", "VLLM_RELEASES", "VLLM_SCHEDULERS", "VllmCallError", "VllmEngine"]

RUNNERS = ("v2", "v1")
LENS_ANSWERS_KEPT = 4096
"""How many of vLLM's local-length answers an engine keeps (``VllmEngine.local_seq_lens``)."""
FULL_SCHEDULER_RELEASES = ("0.31.0", "0.32.0", "0.33.0", "0.34.0")
"""The releases whose v1 ``Scheduler`` dcpsim's stand-in ``VllmConfig`` (``sched_config``) covers,
measured; elsewhere ``--vllm-scheduler full`` is exit 2 naming the attribute the stand-in lacks."""
STAND_IN_GAP = "which dcpsim's stand-in does not set"


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
        partial: bool = False,
        allow_chunked_local_hybrid: bool = False,
    ):
        """``allow_chunked_local_hybrid``: run as vLLM runs with
        ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1`` (``hybrid_layout``)."""
        if runner not in RUNNERS:
            raise ConfigError(f"--vllm-runner must be v1 or v2, got {runner!r}")
        if scheduler not in VLLM_SCHEDULERS:
            raise ConfigError(f"--vllm-scheduler must be one of {', '.join(VLLM_SCHEDULERS)}, got {scheduler!r}")
        if merge not in VLLM_MERGES:
            raise ConfigError(f"--vllm-merge must be one of {', '.join(VLLM_MERGES)}, got {merge!r}")
        self.runner, self.merge, self.scheduler = runner, merge, scheduler
        self.allow_chunked_local_hybrid = bool(allow_chunked_local_hybrid)
        self.tree = SourceTree(source_dir(vllm_source))
        self.version = self.tree.version
        release = self.version if self.version in VLLM_RELEASES else None
        self.bindings = bind(self.tree.root, vllm_table(runner), release=release, label="vLLM", flag="--vllm-source", partial=partial)
        """Each decision's code shape in this tree (``releases.vllm_table``)."""
        if runner == "v1" and not self.bindings.has("write_slots") and "write_slots" not in self.bindings.partial:
            raise ConfigError(f"--vllm-runner v1: {self.bindings.why('write_slots')}")  # asked for by name: never the reference's
        if runs_vllm_core(scheduler) and not self.bindings.has("kv_cache_manager"):
            raise ConfigError(
                f"--vllm-scheduler {scheduler} needs vLLM's KVCacheManager, which {self.bindings.why('kv_cache_manager')}; "
                "use --vllm-scheduler dcpsim"
            )
        self.backend = read_backend(str(self.tree.root), attention_backend)
        self.lse_base = self.backend.lse_base
        helpers = [*(RUNNER_MODULES[runner] if self.bindings.has("write_slots") else ()), *SPEC_HELPERS, *MERGE_HELPERS]
        names = [*[m for m in helpers if self.tree.exists(m)], *self.bindings.modules(), SPECS_MODULE]
        rule_module = self.bindings.bound["hybrid_manager_rule"].shape
        skip = ("vllm.v1.core.kv_cache_manager", rule_module.module if rule_module else "")  # the rule is read, not run
        names = list(dict.fromkeys(n for n in names if n not in skip))
        self.core = None
        if runs_vllm_core(scheduler):
            mods, self.core = load_with_core(self.tree, names, scheduler=scheduler == "full")
        else:
            mods = self.tree.load(names)
        self._look_up(mods, merge_programs)
        self.decisions = self._decisions(merge_programs)
        """Decision -> what makes it; every other decision is the reference engine's."""

    def _function(self, mods: dict, decision: str):
        """The function bound to ``decision``, its signature checked again on the loaded code
        (exit 2 otherwise), or None where the reference decides."""
        bound = self.bindings.bound[decision].shape
        if bound is None:
            return None
        return resolve(self.tree, mods, bound, KNOWN)

    def _look_up(self, mods: dict, merge_programs: int) -> None:
        """vLLM's functions this engine calls, their signatures checked (exit 2 otherwise)."""
        b = self.bindings
        self._slot_kernel = self._function(mods, "write_slots")
        self._specs = mods[SPECS_MODULE]
        self._combine = None
        if b.has("merge_allgather") and b.has("merge_alltoall"):
            self._function(mods, "merge_allgather")
            self._function(mods, "merge_alltoall")
            ag, a2a = (mods[b.bound[d].shape.module] for d in ("merge_allgather", "merge_alltoall"))
            self._combine = VllmCombine(ag, a2a, self.backend.lse_base_on_e, merge_programs)
        self._kernel_table = self._function(mods, "kernel_block_table")
        self._local_lens = self._function(mods, "local_seq_lens")
        self._lens_answers: dict = {}
        """vLLM's local lengths by their arguments (``local_seq_lens``)."""
        self._table_width = self._function(mods, "block_table_width")
        self._unify = self._function(mods, "kv_cache_layout")
        self._rule = read_rule(str(self.tree.root)) if b.has("hybrid_manager_rule") else None

    def _said(self, decision: str, text: str) -> str:
        """``text`` where the tree holds ``decision``, else the reference and why."""
        b = self.bindings.bound[decision]
        return text if b.shape is not None else f"reference ({b.why})"

    def _decisions(self, merge_programs: int) -> dict:
        b = self.bindings
        lens = b.bound["local_seq_lens"].shape
        lens_text = self._said("local_seq_lens", f"vllm {lens.module}.{lens.qualname}" if lens else "")
        write = b.bound["write_slots"].shape
        table = b.bound["kernel_block_table"].shape
        width = b.bound["block_table_width"].shape
        width_text = f"; width: vllm {width.module}.{width.qualname}" if width else f"; width: reference ({b.why('block_table_width')})"
        decisions = {
            "group_geometry": f"vllm {SPECS_MODULE} spec classes (dcp_sharded, max_num_blocks_per_req, "
            f"page_size_bytes, max_memory_usage_bytes){width_text}; "
            "validation: reference",
            "write_slots": self._said(
                "write_slots", f"vllm {write.module}.{write.qualname} (rings and Mamba states: reference)" if write else ""
            ),
            "local_seq_lens": lens_text,
            "query_local_bounds": lens_text,
            "spec_decode_mask": f"its query bounds ({lens_text}): vLLM's kernels bound each token by its local length",
            "kernel_block_table": self._said("kernel_block_table", f"vllm {table.module}.{table.qualname} (when Bk < B)" if table else ""),
            "merge_across_ranks": merge_decision(self.merge, self.backend, merge_programs, self._merge_modules())
            if self._combine is not None
            else f"reference ({b.why('merge_allgather') or b.why('merge_alltoall')})",
            "shard_lse": f"reference, in base {self.lse_base} (vllm {self.backend.describe()})",
        }
        decisions.update(SPARSE_DECISIONS)
        if not b.has("sparse_local_keys"):
            decisions["sparse_local_keys"] = f"reference ({b.why('sparse_local_keys')})"
        sides, scheduler_decisions = scheduler_sides(self.scheduler)
        connector = {PD_CONNECTOR_DECISION: nixl_decision_text(self.tree.root)}  # who answers a P/D decode instance's loads
        self.scheduler_decisions = (
            {**scheduler_decisions, **connector, "manager layout": self._layout_rule()} if scheduler_decisions else {}
        )
        """Each scheduler-side decision -> the vLLM function (and file) that makes it."""
        decisions.update(sides)
        return decisions

    # --- the manager layout vLLM picks (hybrid or unified) ------------------------------

    def _layout_rule(self) -> str:
        """What decides the manager layout, as ``engine info`` says it (no scenario)."""
        r, unify = self._rule, self.bindings.bound["kv_cache_layout"].shape
        if r is None:
            return f"vLLM's hybrid KV cache manager ({self.version}'s VllmConfig.__post_init__ has no rule for chunked local attention)"
        env = f"on ({FLAG} sets {ENV}=1)" if self.allow_chunked_local_hybrid else f"off unless {ENV}=1 (line {r.env_line}; {FLAG})"
        drafter = f", off beside an EAGLE-style drafter (line {r.drafter_line})" if r.drafter else ""
        off = (
            f"; with it off, vllm {unify.module}.{unify.qualname} decides which layers are stored as full attention "
            "(a scenario it changes is exit 2: dcpsim does not run that layout)"
            if unify
            else ""
        )
        return (
            f"vllm vllm.config.vllm.VllmConfig.__post_init__ ({r.where()}): for a model with chunked local attention the "
            f"hybrid KV cache manager is {env}{drafter}{off}; else the hybrid KV cache manager"
        )

    def manager_layout(self, scenario) -> Layout:
        """The KV cache manager layout vLLM picks for ``scenario``: its hybrid manager, or, with
        it off, what ``unify_hybrid_kv_cache_specs`` makes of the layers' specs (``hybrid_layout``).
        A ``ConfigError`` where that function refuses them (vLLM's words)."""
        on, why = manager_on(
            self._rule,
            self.version,
            chunk=has_chunk(scenario.layers),
            eagle=scenario.config.eagle_drop,
            allow=self.allow_chunked_local_hybrid,
        )
        if on or self._unify is None:
            return Layout(True, why)
        specs = {name: self.vllm_spec(spec) for name, spec in scenario.layers.items()}
        before = dict(specs)
        quiet = logging.getLogger(self._unify.__module__)  # its warning that the manager is off: the report says it
        was, quiet.disabled = quiet.disabled, True
        try:
            self._unify(specs)
        except Exception as exc:  # vLLM refuses the layers at start-up
            err = engine_error(exc, self.tree, "unify_hybrid_kv_cache_specs")
            raise ConfigError(
                f"vLLM {self.version} refuses this configuration (its hybrid KV cache manager {why}): {err.function} "
                f"({err.file}:{err.line}): {err.message}"
            ) from None
        finally:
            quiet.disabled = was
        promoted = tuple(n for n in specs if specs[n] != before[n])
        into = ", ".join(sorted({f"{type(specs[n]).__name__}(block_size={specs[n].block_size})" for n in promoted}))
        return Layout(False, why, promoted, into)

    def _merge_modules(self) -> dict:
        return {v: self.bindings.bound[f"merge_{v}"].shape.module for v in ("allgather", "alltoall")}

    # --- the scheduler: vLLM's KVCacheManager decides every block ------------------------

    def make_scheduler(self, scenario, geometries, connector=None):
        if self.core is None:
            return super().make_scheduler(scenario, geometries, connector=connector)
        return scheduler_class(self.scheduler)(scenario, self, geometries, connector=connector)

    def check_scenario(self, scenario) -> None:
        """Build the run's scheduler once, in the parent: a configuration vLLM refuses (an
        assertion or error of its KV cache manager, or of its v1 Scheduler under ``full``) is
        exit 2 quoting vLLM's own words. Under ``--vllm-scheduler dcpsim`` only the group
        geometries are built: a spec class that refuses the scenario is exit 2 here, not a
        rank's error. Parallel sizes the tree's ``ParallelConfig`` refuses come first
        (``parallel_rules``)."""
        parallel_rules.check(self, scenario)
        layout = self.manager_layout(scenario)
        if layout.promoted:
            unify = self.bindings.bound["kv_cache_layout"].shape
            line = self._unify.__code__.co_firstlineno
            raise ConfigError(
                f"vLLM {self.version} runs this model without its hybrid KV cache manager ({layout.why}), and its "
                f"{unify.qualname} ({unify.file}:{line}, called by get_kv_cache_groups) then stores the layers "
                f"{', '.join(layout.promoted)} as {layout.into}: "
                "dcpsim does not run that unified layout (its groups and checker keep each layer's own kind); "
                f"{FLAG} runs vLLM as with {ENV}=1, on the hybrid manager"
                + (" (not beside an EAGLE-style drafter, where vLLM turns it off regardless)" if scenario.config.eagle_drop else "")
            )
        if self.core is None:
            self.geometries(scenario.layers, scenario.config)
            return
        try:
            self.make_scheduler(scenario, self.geometries(scenario.layers, scenario.config))
        except EngineError as exc:
            if STAND_IN_GAP in exc.message:  # dcpsim's stand-in config, not vLLM, is short of something
                raise ConfigError(
                    f"--vllm-scheduler {self.scheduler}: dcpsim's stand-in VllmConfig does not cover vLLM {self.tree.version}'s "
                    f"scheduler ({exc.function}, {exc.file}:{exc.line}: {exc.message}); it is known to run vLLM "
                    f"{', '.join(FULL_SCHEDULER_RELEASES)}; use --vllm-scheduler manager"
                ) from None
            raise ConfigError(
                f"vLLM {self.tree.version} refuses this configuration: {exc.function} ({exc.file}:{exc.line}): {exc.message}"
            ) from None

    # --- sparse attention: vLLM's DCP filter of the top-k ids ---------------------------

    def sparse_local_keys(self, geometry, selected, dcp_rank):
        local = super().sparse_local_keys(geometry, selected, dcp_rank)
        if not geometry.sharded or not len(local) or not local.shape[1]:
            return local
        shape = self.bindings.bound["sparse_local_keys"].shape
        if shape is None:
            return local
        if getattr(self, "_sparse_filter", None) is None:  # loaded on first use: dense models never need it
            mods = self.tree.load([*[m for m in MERGE_HELPERS if self.tree.exists(m)], shape.module])
            self._sparse_filter = resolve(self.tree, mods, shape, KNOWN)
        return filter_last_token(self._sparse_filter, geometry, selected, local, dcp_rank)

    # --- geometry through vLLM's spec classes ----------------------------------------

    def vllm_spec(self, spec):
        """vLLM's spec of the same class name as one of the scenario's layer specs."""
        return vllm_spec(self.tree, self._specs, spec)

    def group_geometry(self, group_id, group, config):
        g = super().group_geometry(group_id, group, config)  # validation, storage, retention
        return vllm_geometry(
            g,
            self.vllm_spec(group.representative),
            group,
            config,
            self._table_width,
            self.bindings.bound["block_table_width"].shape,
            parallel_rules.release_sizes(self.tree, config),
        )

    # --- the write path -------------------------------------------------------------

    def write_slots(self, geometry, write, block_row, dcp_rank):
        return self.step_write_slots(geometry, [write], [block_row], dcp_rank)[0]

    def step_write_slots(self, geometry, writes, block_rows, dcp_rank):
        # rings: no vLLM kernel here; Mamba states: vLLM maps none (SlotMappingMode.NONE, the
        # block table is the state index)
        if geometry.storage in (Storage.RING, Storage.STATE) or not writes or self._slot_kernel is None:
            return [super(VllmEngine, self).write_slots(geometry, w, r, dcp_rank) for w, r in zip(writes, block_rows)]
        if geometry.storage is Storage.RECORDS:
            R = geometry.tokens_per_state
            indices = [np.arange(w.start // R, w.stop // R, dtype=np.int64) for w in writes]
        else:
            indices = [np.arange(w.start, w.stop, dtype=np.int64) for w in writes]
        shape = self.bindings.bound["write_slots"].shape
        slots = slot_mapping.slot_mapping(shape, self._slot_kernel, geometry, indices, block_rows, dcp_rank)
        return list(zip(slots, indices))

    # --- the merge across ranks -----------------------------------------------------

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        """vLLM's combine wrapper of ``variant`` on a sample of the rows, the reference on the
        whole batch; vLLM's rows replace the reference's (``merge_choice.merge_with_vllm``)."""
        merged = super().merge_across_ranks(out, lse, group, variant=variant, base=base)
        if self.merge != "vllm" or self._combine is None or group.world_size == 1 or not out.shape[0]:
            return merged
        return merge_with_vllm(self._combine, merged, out, lse, group, variant)

    # --- attention metadata ---------------------------------------------------------

    def kernel_block_table(self, geometry, block_row):
        if self._kernel_table is None:
            return super().kernel_block_table(geometry, block_row)
        return metadata.kernel_block_table(self._kernel_table, geometry, block_row)

    def local_seq_lens(self, geometry, seq_lens, dcp_rank):
        if self._local_lens is None:
            return super().local_seq_lens(geometry, seq_lens, dcp_rank)
        lens = np.asarray(seq_lens, dtype=np.int64)
        if not geometry.sharded:
            return lens
        # vLLM's get_dcp_local_seq_lens is a function of its arguments alone, and about half of a
        # run's calls repeat an earlier call's (the metadata and the checker ask alike): a repeat
        # takes the answer vLLM gave for the same bytes
        key = (lens.shape, lens.tobytes(), geometry.dcp_size, dcp_rank, geometry.interleave_size)
        found = self._lens_answers.get(key)
        if found is None:
            found = metadata.local_seq_lens(self._local_lens, geometry, lens, dcp_rank)
            if len(self._lens_answers) >= LENS_ANSWERS_KEPT:
                self._lens_answers.clear()
            self._lens_answers[key] = found
        return found.copy()

    def query_local_bounds(self, geometry, start, stop, dcp_rank):
        lens = np.arange(start, stop, dtype=np.int64) + 1
        if geometry.storage is Storage.RECORDS:  # records emitted at positions <= p
            lens = lens // geometry.tokens_per_state
        return self.local_seq_lens(geometry, lens, dcp_rank)
