"""``VllmAscendEngine``: vllm-ascend's own DCP code (the Ascend NPU plugin) over the vLLM release
it runs on.

vllm-ascend's deciding code is plain torch over vLLM's core, so this engine is ``VllmEngine``
on the vLLM tree the plugin runs on (``--vllm-source``: vLLM 0.23.0 for 0.23.0.post1; its KV cache
manager, spec classes and combine wrappers decide as under ``--engine vllm``), with the plugin's
decisions in their place, each bound to the plugin's code by its table
(``dcpsim.engine.vllm_ascend.releases``):

* ``write_slots`` of a sharded paged group: ``vllm_ascend/worker/block_table.py``
  ``BlockTable._compute_pcp_dcp_slot_mapping`` on a stand-in block table holding what it reads
  (one physical block per kernel block: dcpsim's rows hold pages), over every write of a step;
  replicated, ring, record and state groups: as under ``--engine vllm``;
* ``local_seq_lens`` (and the per-token ``query_local_bounds``): ``worker/pcp_utils.py``
  ``PCPManager._get_cp_local_seq_lens`` (this rank's (PCP, DCP) column);
* the PCP split of a prefill row (``pcp_replicated``, ``pcp_chunks``, ``pcp_restore_offsets``):
  ``PCPManager.classify_decode_request_mask`` and ``update_tokens_for_pcp`` (DualChunkSwap).
* ``context_gather`` of a sharded MLA group: ``attention/context_parallel/mla_cp.py``
  ``AscendMlaCPMetadataBuilder.build_chunked_metadata`` (over its base's in ``attention/mla_v1.py``)
  on a stand-in builder: every request cut alike into pieces, piece ``i`` in chunk ``i``, each
  rank's rows of a piece the ones the attention keeps of its padded load (``_reorg_kvcache``).

The plugin's vLLM 0.23.0 shards the KV cache over PCP x DCP, shard ``pcp_rank * dcp + dcp_rank``
(``engine.vllm.parallel_rules``): a scenario with PCP runs where that is dcpsim's layout, ``W == P``,
i.e. the plugin's PCP ``P`` with DCP 1. Every plugin call is handed those sizes and this rank's
``(pcp_rank, dcp_rank)`` in them (``_cp``): dcpsim's DCP rank ``k`` of ``W`` is the plugin's
``(k // dcp, k % dcp)``.

An exception inside the plugin's code is a ``VllmCallError`` naming its function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types

import numpy as np
import torch

from dcpsim.engine.loading.bindings import bind, resolve
from dcpsim.engine.loading.interpreter import INTERPRETER_LOCK
from dcpsim.engine.loading.placeholders import StubModule
from dcpsim.engine.vllm import parallel_rules
from dcpsim.engine.vllm.adapter import VllmEngine
from dcpsim.engine.vllm.core import COORDINATOR_MODULE, MANAGER_MODULE
from dcpsim.engine.vllm.functions import VllmCallError, call, call_unlocked
from dcpsim.engine.vllm_ascend import platform_rules
from dcpsim.engine.vllm_ascend.loader import AscendTree, source_dir
from dcpsim.engine.vllm_ascend.merge import AscendMerge
from dcpsim.engine.vllm_ascend.releases import (
    ASCEND_RELEASES,
    ASCEND_TABLE,
    ATTENTION_UTILS,
    BLOCK_TABLE,
    COMMON_CP,
    COORDINATOR_SUPPORT,
    CP_UTILS,
    MERGE_DECISIONS,
    MLA_CP,
    MLA_V1,
    PATCH_COORDINATOR,
    PCP_UTILS,
    SCHEDULER_DECISIONS,
    VLLM_OF,
)
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.layout import PAD
from dcpsim.model.plan import ContextGather
from dcpsim.model.sparse import sparse_topk
from dcpsim.model.specs import MLAAttentionSpec

_WHAT_IT_DECIDES = {
    "pcp_query_keys": "the head and tail chunks' unmasked and masked key index lists; the mask causal",
    "sparse_local_keys": "sharded sparse groups: every id of every query token, compacted to the front",
    "context_gather": (
        "sharded MLA groups: its chunks and each rank's rows of them, the rank's own keys of its padded load as "
        "_reorg_kvcache keeps them; other groups: {before}"
    ),
}
"""``engine info``'s words on the groups or parts of a decision the plugin's code makes."""


class VllmAscendEngine(VllmEngine):
    name = "vllm-ascend"
    description = (
        "vllm-ascend's own DCP code (its slot mapping and local lengths) from a source tree, over the vLLM "
        "release it runs on (that release's KV cache manager, spec classes and combine wrappers)"
    )

    def __init__(self, ascend_source: str | None = None, vllm_source: str | None = None, partial: bool = False, **vllm_options):
        ascend_root = source_dir(ascend_source)
        super().__init__(vllm_source, partial=partial, **vllm_options)
        self.vllm_version = self.version
        self.ascend = AscendTree(ascend_root, self.tree)
        self.version = self.ascend.version
        release = self.version if self.version in ASCEND_RELEASES else None
        wanted = VLLM_OF.get(release or "")
        if wanted and self.vllm_version not in (wanted, "unknown"):
            raise ConfigError(
                f"vllm-ascend {release} runs on vLLM {wanted}; --vllm-source {self.tree.root} holds vLLM {self.vllm_version} "
                f"(get it with: python -m dcpsim engine fetch vllm=={wanted})"
            )
        self.plugin_bindings = bind(
            self.ascend.root, ASCEND_TABLE, release=release, label="vllm-ascend", flag="--vllm-ascend-source", partial=partial
        )
        """The plugin's decisions bound to its tree (``releases.ASCEND_TABLE``)."""
        names = self.plugin_bindings.modules()
        if self.plugin_bindings.bound["kv_cache_coordinator"].shape is not None:
            at = names.index(PATCH_COORDINATOR)
            names[at:at] = COORDINATOR_SUPPORT  # what its coordinator builds
        if self.plugin_bindings.bound["block_table_width"].shape is not None:
            self._cp_utils = self.tree.load([CP_UTILS])[CP_UTILS]  # the table's get_total_cp_world_size, vLLM's own
        if self.plugin_bindings.bound["context_gather"].shape is not None:
            names.insert(names.index(MLA_CP), MLA_V1)  # the builder the CP builder derives from
        with _torch_npu_placeholder():
            mods = self.ascend.load(names)
        self._block_table_module = mods.get(BLOCK_TABLE)
        self._pcp_manager = getattr(mods.get(PCP_UTILS), "PCPManager", None)
        self._mla_cp_builder = getattr(mods.get(MLA_CP), "AscendMlaCPMetadataBuilder", None)
        for name in (MLA_V1, MLA_CP):  # their torch.zeros(..., pin_memory=True): no pinned memory on the CPU
            if name in mods:
                mods[name].torch = _HostTorch()
        self._release_cp = (1, 1)
        """The plugin's ``(dcp, pcp)`` sizes of the run's layout (``parallel_rules.release_sizes``), set with its geometry."""
        self._decode_threshold = 1
        """``1 + num_speculative_tokens``: the most tokens of a row PCP leaves whole."""
        self._splits: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._ascend = {}
        for name, bound in self.plugin_bindings.bound.items():
            if bound.shape is not None:
                self._ascend[name] = resolve(self.ascend, mods, bound.shape, f"dcpsim knows vllm-ascend {', '.join(ASCEND_RELEASES)}")
        self._merge = None
        if all(name in self._ascend for name in MERGE_DECISIONS):
            self._merge = AscendMerge(mods[COMMON_CP], *(self._ascend[name] for name in MERGE_DECISIONS))
        self._install_scheduler_side()
        self._say_who_decides()

    def _say_who_decides(self) -> None:
        """``engine info``'s line for each decision the plugin's table binds."""
        for name, bound in self.plugin_bindings.bound.items():
            where = f"vllm-ascend {bound.shape.file}::{bound.shape.qualname}" if bound.shape else f"vLLM's ({bound.why})"
            if name in MERGE_DECISIONS or name in SCHEDULER_DECISIONS:
                continue
            if name == "write_slots":
                self.decisions[name] = f"{where} (sharded paged groups; the rest as --engine vllm: {self.decisions[name]})"
            elif name == "local_seq_lens":
                self.decisions["local_seq_lens"] = self.decisions["query_local_bounds"] = where
            elif name == "block_table_width":
                spec_classes = self.decisions["group_geometry"].split("; width: ")[0]
                self.decisions["group_geometry"] = (
                    f"{spec_classes}; width: {where} (BlockTable.max_num_blocks_per_req of paged and compressed groups; "
                    "rings and Mamba states as --engine vllm); validation: reference"
                )
            elif name == "pcp_split":
                for decision in ("pcp_chunks", "pcp_restore_offsets"):
                    self.decisions[decision] = f"{where} (a split row's chunks and the restore index of its gather)"
            elif name == "pcp_decode_rows":
                self.decisions["pcp_replicated"] = f"{where} (a decode row is left whole; every other row is split)"
            else:
                self.decisions[name] = f"{where} ({_WHAT_IT_DECIDES.get(name, 'sharded paged groups')})".replace(
                    "{before}", self.decisions.get(name) or "the reference"
                )

        if self._merge is not None:
            self.decisions["merge_across_ranks"] = (
                f"vllm-ascend {COMMON_CP}._process_attn_out_lse (all-to-all over heads, over the rank's group) and "
                "_npu_attention_update, whose torch_npu.npu_attention_update is the plugin's _update_out_and_lse; "
                "every row of its MLA and GQA groups (paged, dense), either --attention-merge (the plugin has one path); "
                "sparse and compressed groups, which it does not merge across ranks, by vLLM's path"
            )
            self.lse_base = "e"  # the plugin's NPU attention and its combine work in natural logs
            self.decisions["shard_lse"] = "reference, in base e (the plugin's merge combines natural-log LSEs)"

    def _install_scheduler_side(self) -> None:
        """The plugin's coordinator and block sizes in this engine's vLLM core, as its patch
        modules install them (set here by name, whatever the patch itself does at import): vLLM's
        ``KVCacheManager`` builds its coordinator through the plugin's ``get_kv_cache_coordinator``,
        and the scheduler's block sizes come from the plugin's ``resolve_kv_cache_block_sizes``."""
        if self.core is None:  # --vllm-scheduler dcpsim: dcpsim's scheduler, no KV cache manager
            return
        coordinator, sizes = (self._ascend.get(name) for name in SCHEDULER_DECISIONS)
        if coordinator is not None:
            self.core.around["KVCacheManager"] = self._importable  # its managers, built then, import lazily
            self.core.modules[MANAGER_MODULE].get_kv_cache_coordinator = coordinator
            if COORDINATOR_MODULE in self.core.modules:
                self.core.modules[COORDINATOR_MODULE].get_kv_cache_coordinator = coordinator
        if sizes is not None:
            self.core.utils.resolve_kv_cache_block_sizes = sizes
        said = []
        for name in SCHEDULER_DECISIONS:
            bound = self.plugin_bindings.bound[name]
            said.append(f"vllm-ascend {bound.shape.file}::{bound.shape.qualname}" if bound.shape else f"vLLM's ({bound.why})")
        self.scheduler_decisions = {
            **self.scheduler_decisions,
            "coordinator (prefix-cache hits of several groups)": said[0],
            "block sizes (scheduler, hash)": said[1],
        }
        if coordinator is not None:
            self.decisions["prefix_hit_tokens"] = (
                f"{said[0]} (AscendHybridKVCacheCoordinator.find_longest_cache_hit for several groups with caching on; "
                f"else {self.decisions['prefix_hit_tokens']})"
            )
        if sizes is not None:
            self.decisions["prefix_hash_block_size"] = said[1]

    @contextlib.contextmanager
    def _importable(self):
        """Both trees importable while vLLM's ``KVCacheManager`` builds the plugin's coordinator,
        whose ``get_manager_for_kv_cache_spec`` imports vLLM's spec registry and the plugin's
        spec classes at call time (nothing the manager calls later does: one swap per scheduler,
        not one per call). Importability swaps the process's modules, so ranks that are threads
        take turns (the interpreter lock: the construction runs no collective and no kernel)."""
        with INTERPRETER_LOCK, self.ascend.importable():
            yield

    def check_scenario(self, scenario) -> None:
        """The platform's rules on the interleave (``platform_rules``), then vLLM's core's."""
        platform_rules.check(self, scenario)
        super().check_scenario(scenario)

    # --- the geometry: the worker's block-table rows ----------------------------------

    def group_geometry(self, group_id, group, config):
        self._release_cp = parallel_rules.release_sizes(self.tree, config)
        self._decode_threshold = 1 + config.num_speculative_tokens
        g = super().group_geometry(group_id, group, config)
        if "block_table_width" not in self._ascend or g.storage not in (Storage.PAGED, Storage.RECORDS):
            return g  # rings and Mamba states: vLLM's rows
        return dataclasses.replace(g, block_table_width=self._plugin_row_width(g, config))

    def _plugin_row_width(self, g, config) -> int:
        """``BlockTable.max_num_blocks_per_req`` of the plugin's ``MultiGroupBlockTable`` built for
        this one group (one request, on the CPU), over the plugin's PCP x DCP sizes of ``W``. The
        table's block size is the group's states per page; a compressed group is a
        ``UniformTypeKVCacheSpecs`` of a spec with the group's ratio (what the plugin reads)."""
        dcp_size, pcp_size = self._release_cp
        spec = self.vllm_spec(g.spec)
        if g.storage is Storage.RECORDS and g.tokens_per_state > 1:
            uniform = self._block_table_module.UniformTypeKVCacheSpecs
            spec = object.__new__(uniform)  # only its kv_cache_specs is read
            object.__setattr__(spec, "kv_cache_specs", {g.layer_names[0]: types.SimpleNamespace(compress_ratio=g.tokens_per_state)})
        dcp = types.SimpleNamespace(world_size=dcp_size, rank_in_group=0)
        pcp = types.SimpleNamespace(world_size=pcp_size, rank_in_group=0)
        with INTERPRETER_LOCK:  # module globals: thread ranks take turns
            for module in (self._block_table_module, self._cp_utils):
                module.get_dcp_group, module.get_pcp_group = (lambda: dcp), (lambda: pcp)
            table = call_unlocked(  # under the lock already (not reentrant)
                f"{BLOCK_TABLE}.MultiGroupBlockTable",
                self._block_table_module.MultiGroupBlockTable,  # whose __init__ the table bound
                max_num_reqs=1,
                max_model_len=config.max_model_len,
                max_num_batched_tokens=1,
                pin_memory=False,
                device=torch.device("cpu"),
                block_sizes=[g.states_per_page],
                num_speculative_tokens=g.num_speculative_tokens,
                kernel_sizes=None,
                cp_kv_cache_interleave_size=g.interleave_size,
                kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec)],
            )
        return int(table.block_tables[0].max_num_blocks_per_req)

    # --- the write path -------------------------------------------------------------

    def step_write_slots(self, geometry, writes, block_rows, dcp_rank):
        g = geometry
        fn = self._ascend.get("write_slots")
        if fn is None or not writes or not g.sharded or g.storage is not Storage.PAGED:
            return super().step_write_slots(geometry, writes, block_rows, dcp_rank)
        positions = [np.arange(w.start, w.stop, dtype=np.int64) for w in writes]
        flat = ascend_slot_mapping(fn, g, positions, block_rows, self._cp(g, dcp_rank))
        cuts = np.cumsum([len(p) for p in positions])[:-1]
        return list(zip(np.split(flat, cuts), positions))

    # --- local lengths --------------------------------------------------------------

    def local_seq_lens(self, geometry, seq_lens, dcp_rank):
        fn = self._ascend.get("local_seq_lens")
        lens = np.asarray(seq_lens, dtype=np.int64)
        if fn is None or not geometry.sharded:
            return super().local_seq_lens(geometry, seq_lens, dcp_rank)
        what = "vllm_ascend.worker.pcp_utils.PCPManager._get_cp_local_seq_lens"
        dcp_size, pcp_size, dcp_at, pcp_at = self._cp(geometry, dcp_rank)
        out = call(what, fn, None, torch.from_numpy(lens), pcp_size, dcp_size, geometry.interleave_size)
        return out[:, pcp_at, dcp_at].numpy().astype(np.int64)

    def _cp(self, geometry, dcp_rank: int) -> tuple[int, int, int, int]:
        """``(dcp_size, pcp_size, dcp_rank, pcp_rank)`` in the plugin's terms of this sharded
        group's rank ``dcp_rank`` of ``W``: its PCP x DCP sizes of the run (PCP only where
        ``W == P``, ``parallel_rules``), shard ``pcp_rank * dcp + dcp_rank``."""
        dcp_size, pcp_size = self._release_cp
        if dcp_size * pcp_size != geometry.dcp_size:  # a group of another width (a draft, W = 1)
            dcp_size, pcp_size = geometry.dcp_size, 1
        return dcp_size, pcp_size, dcp_rank % dcp_size, dcp_rank // dcp_size

    # --- prefill context parallelism: the split of a row ---------------------------------

    def pcp_replicated(self, query_len, prefill, pcp, dcp):
        fn = self._ascend.get("pcp_decode_rows")
        if fn is None or pcp == 1:
            return super().pcp_replicated(query_len, prefill, pcp, dcp)
        stand_in = types.SimpleNamespace(pd_decode_recompute_scheduler_enabled=False)  # what the mask reads of a PCPManager
        computed = np.array([0 if prefill else 1])  # a prefill row: its prompt not done; a decode: context, prompt done
        what = "vllm_ascend.worker.pcp_utils.PCPManager.classify_decode_request_mask"
        decode = call(what, fn, stand_in, np.array([query_len]), computed, computed, self._decode_threshold)
        return bool(np.asarray(decode)[0])

    def pcp_chunks(self, query_len, pcp, pcp_rank):
        if "pcp_split" not in self._ascend:
            return super().pcp_chunks(query_len, pcp, pcp_rank)
        positions, real = self._pcp_split(query_len, pcp, pcp_rank)[:2]
        mine = positions[real[positions]]
        if not mine.size:
            return []
        cuts = np.flatnonzero(np.diff(mine) != 1) + 1
        return [(int(run[0]), len(run)) for run in np.split(mine, cuts)]

    def pcp_restore_offsets(self, query_len, pcp):
        if "pcp_split" not in self._ascend:
            return super().pcp_restore_offsets(query_len, pcp)
        _, real, restore = self._pcp_split(query_len, pcp, 0)
        targets = np.empty(len(restore), np.int64)
        targets[restore] = np.arange(len(restore))  # restore[j]: the gathered row the plugin puts at position j
        computed = np.concatenate([self._pcp_split(query_len, pcp, r)[0] for r in range(pcp)])  # rank-major
        return targets[real[computed]]  # the rows of real tokens, as pcp_chunks hands them to the gather

    def pcp_query_keys(self, query_len, pcp, pcp_rank):
        fn = self._ascend.get("pcp_query_keys")
        if fn is None or "pcp_split" not in self._ascend:
            return super().pcp_query_keys(query_len, pcp, pcp_rank)
        positions, real, _ = self._pcp_split(query_len, pcp, pcp_rank)
        per_rank = len(positions)
        manager = self._pcp_manager
        stand_in = types.SimpleNamespace(  # what generate_pcp_metadata reads of a PCPManager after the split
            pcp_world_size=pcp,
            pcp_world_rank=pcp_rank,
            dcp_world_size=self._release_cp[0],
            pcp_use_hybrid_attn=False,
            num_decode_reqs=0,
            num_reqs=1,
            query_lens_pcp_full=types.SimpleNamespace(cpu=torch.tensor([query_len], dtype=torch.int32)),
            vllm_config=types.SimpleNamespace(parallel_config=types.SimpleNamespace(cp_kv_cache_interleave_size=1)),
            pcp_unpad_mask_cpu=real,
            pcp_padded_tokens_length=len(real),
            pcp_padded_tokens_fla=0,
            pcp_allgather_restore_idx=types.SimpleNamespace(gpu=torch.zeros(per_rank * pcp, dtype=torch.int64)),
            speculative_config=None,
            device=torch.device("cpu"),
        )
        for method in ("_get_cp_local_seq_lens", "_list_to_tensor"):
            setattr(stand_in, method, types.MethodType(getattr(manager, method), stand_in))
        batch = types.SimpleNamespace(num_computed_tokens_cpu=np.zeros(1, np.int64))  # the row's context: read as any row's
        what = "vllm_ascend.worker.pcp_utils.PCPManager.generate_pcp_metadata"
        metadata = types.ModuleType(ATTENTION_UTILS)
        metadata.AscendPrefillContextParallelMetadata = types.SimpleNamespace  # it only holds fields
        scheduled = np.array([per_rank])
        with INTERPRETER_LOCK, _module_as(ATTENTION_UTILS, metadata):
            call_unlocked(what, fn, stand_in, per_rank, torch.tensor([per_rank]), batch, scheduled, None, 1, 1)
        return pcp_key_spans(stand_in, positions, real)

    def _pcp_split(self, query_len: int, pcp: int, pcp_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The plugin's split of one prefill row of ``query_len`` tokens over ``pcp`` ranks, as
        PCP rank ``pcp_rank`` runs ``update_tokens_for_pcp``: the positions (in the row padded to
        a multiple of ``2 * pcp``) it computes, which positions are real tokens (the unpad mask),
        and the restore index of the all-gather (position ``j`` takes the gathered row
        ``restore[j]``). Pure in its arguments: computed once each."""
        key = (query_len, pcp, pcp_rank)
        if key not in self._splits:
            padded = -(-query_len // (2 * pcp)) * 2 * pcp
            stand_in = types.SimpleNamespace(  # what update_tokens_for_pcp reads and writes of a PCPManager
                pcp_world_size=pcp,
                pcp_world_rank=pcp_rank,
                num_reqs=1,
                num_decode_reqs=0,
                num_decode_tokens=0,
                num_pcp_pads_cpu=np.zeros(1, np.int64),
                pcp_unpad_mask_cpu=np.ones(padded, bool),
                pcp_allgather_restore_idx=types.SimpleNamespace(np=np.zeros(padded, np.int64), copy_to_gpu=lambda n: None),
                pcp_tokens=np.zeros(1, np.int32),
                pcp_use_hybrid_attn=False,
            )
            stand_in._get_cumsum_and_arange = types.MethodType(self._pcp_manager._get_cumsum_and_arange, stand_in)
            what = "vllm_ascend.worker.pcp_utils.PCPManager.update_tokens_for_pcp"
            _, positions = call(what, self._ascend["pcp_split"], stand_in, np.array([query_len], np.int32), np.arange(padded + 1))
            restore = stand_in.pcp_allgather_restore_idx.np[:padded].copy()
            self._splits[key] = (np.asarray(positions, np.int64), stand_in.pcp_unpad_mask_cpu[:padded].copy(), restore)
        return self._splits[key]

    # --- the chunked context of an MLA prefill ---------------------------------------------

    def context_gather(self, geometry, writes, block_rows, dcp_rank):
        g = geometry
        fn = self._ascend.get("context_gather")
        mla = isinstance(g.spec, MLAAttentionSpec)
        paged_full = g.storage is Storage.PAGED and g.retention is Retention.FULL
        if fn is None or "local_seq_lens" not in self._ascend or not g.sharded or not mla or not paged_full:
            return super().context_gather(geometry, writes, block_rows, dcp_rank)
        if not g.chunked_prefill_workspace_size:
            return None
        prefills = [i for i, w in enumerate(writes) if w.stop - w.start > 1 + g.num_speculative_tokens]
        contexts = np.array([writes[i].start for i in prefills], dtype=np.int64)
        if not contexts.any():
            return None
        queries = np.array([writes[i].stop - writes[i].start for i in prefills], dtype=np.int64)
        dcp_size, pcp_size, dcp_at, pcp_at = self._cp(g, dcp_rank)
        every_rank = self._every_local_len(g, contexts, dcp_rank)  # [n, pcp, dcp]
        builder = self._chunked_stand_in(g, contexts, queries, (dcp_size, pcp_size, dcp_at, pcp_at))
        cp_metadata = types.SimpleNamespace(num_computed_tokens_of_pcp_dcp=every_rank.tolist())
        common = types.SimpleNamespace(num_reqs=len(prefills), prefill_context_parallel_metadata=cp_metadata)  # what it reads
        what = f"{MLA_CP}.AscendMlaCPMetadataBuilder.build_chunked_metadata"
        with INTERPRETER_LOCK, _host_tensor_methods():
            chunked = call_unlocked(what, fn, builder, 0, common)
        shard = pcp_at * dcp_size + dcp_at  # the plugin's rank in local_context_lens_allranks
        return self._gather_of(g, writes, block_rows, prefills, chunked, builder.max_context_chunk, shard)

    def _every_local_len(self, g, contexts: np.ndarray, dcp_rank: int) -> np.ndarray:
        """Every (PCP, DCP) rank's local length of each context, ``[n, pcp, dcp]``: the plugin's
        ``num_computed_tokens_of_pcp_dcp`` of the prefill rows (``pcp_utils.py:2006``), by the bound
        ``_get_cp_local_seq_lens``."""
        dcp_size, pcp_size, _, _ = self._cp(g, dcp_rank)
        what = "vllm_ascend.worker.pcp_utils.PCPManager._get_cp_local_seq_lens"
        out = call(what, self._ascend["local_seq_lens"], None, torch.from_numpy(contexts), pcp_size, dcp_size, g.interleave_size)
        return out.numpy().astype(np.int64)

    def _chunked_stand_in(self, g, contexts, queries, cp):
        """An ``AscendMlaCPMetadataBuilder`` holding what ``build_chunked_metadata`` and its base's
        read: the fields its ``__init__`` sets (``mla_cp.py:74-82``: the ranks, the interleave, the
        block size ``lcm(B, I * dcp * pcp)``) and ``build`` leaves before it (``mla_v1.py:430-467``:
        the step's prefill rows alone, no decode row before them, their lengths and query lengths),
        and the workspace the scenario gives (``chunked_prefill_workspace_size``)."""
        dcp_size, pcp_size, dcp_at, pcp_at = cp
        builder = object.__new__(self._mla_cp_builder)  # its __init__ builds vLLM's MLA builder: not run
        virtual = g.interleave_size * dcp_size * pcp_size
        vars(builder).update(
            pcp_size=pcp_size,
            pcp_rank=pcp_at,
            dcp_size=dcp_size,
            dcp_rank=dcp_at,
            cp_local_block_size=g.interleave_size,
            cp_virtual_block_size=virtual,
            block_size=g.block_size * virtual // np.gcd(g.block_size, virtual),
            chunked_prefill_enabled=True,
            chunked_prefill_workspace_size=g.chunked_prefill_workspace_size,
            chunked_prefill_workspace=None,
            device=torch.device("cpu"),
            num_decodes=0,
            num_prefills=len(contexts),
            seq_lens=torch.from_numpy(contexts + queries),
            query_lens=torch.from_numpy(queries),
        )
        return builder

    def _gather_of(self, g, writes, block_rows, prefills, chunked, piece: int, shard: int) -> ContextGather | None:
        """dcpsim's ``ContextGather`` of the builder's chunked metadata on plugin rank ``shard``:
        an entry per (chunk, request) with context tokens in the chunk (``chunk_seq_lens``),
        starting at ``chunk * piece`` (``mla_v1.py:518-521``); the rank's rows, from its local start
        of the piece (``starts``), are the ones the attention keeps of its padded load,
        ``min(max(0, local - chunk * chunk_size), padded)`` (``_reorg_kvcache``, ``mla_cp.py:834-837``)."""
        if chunked is None:
            return None
        lens = np.asarray(chunked.chunk_seq_lens, dtype=np.int64)  # [chunks, requests]
        local_starts = np.asarray(chunked.starts, dtype=np.int64)
        padded = np.asarray(chunked.padded_local_chunk_seq_lens, dtype=np.int64)
        local_context = np.asarray(chunked.local_context_lens_allranks, dtype=np.int64)[:, shard]
        chunk_of, req = np.nonzero(lens)  # row-major: chunk order, then batch order
        keep = np.minimum(np.maximum(0, local_context[req] - chunk_of * int(chunked.chunk_size)), padded[chunk_of, req])
        starts, ls = chunk_of * piece, local_starts[chunk_of, req]
        slots = [
            self._read_slots(g, np.asarray(block_rows[prefills[k]], dtype=np.int64), np.arange(a, a + n, dtype=np.int64))
            for k, a, n in zip(req.tolist(), ls.tolist(), keep.tolist())
        ]
        return ContextGather(
            group=g.group_id,
            workspace_size=g.chunked_prefill_workspace_size,  # the stand-in's chunked_prefill_workspace_size
            request_ids=tuple(writes[prefills[k]].request_id for k in req.tolist()),
            chunks=chunk_of.astype(np.int64),
            starts=starts.astype(np.int64),
            seq_lens=lens[chunk_of, req],
            local_starts=ls,
            local_seq_lens=keep.astype(np.int64),
            slots=np.concatenate(slots).astype(np.int64) if slots else np.zeros(0, np.int64),
        )

    # --- the merge across the DCP ranks -----------------------------------------------

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        if self._merge is None or group.world_size == 1 or not out.shape[0]:
            return super().merge_across_ranks(out, lse, group, variant=variant, base=base)
        return self._merge.merge(out, lse, group, base, pcp=self._release_cp[1])

    def merge_path(self, geometry):
        """The plugin's merge for the groups its MLA and GQA decode merge (``mla_cp.py``,
        ``attention_cp.py``: paged, dense); vLLM's path for the rest. Its sparse attention
        all-gathers the selected keys instead (``sfa_cp.py``), and it has no DCP merge of
        compressed records: a row no rank holds a key of (a compressed group's first
        ``R - 1`` queries) never reaches its combine, which would make NaN of it."""
        if geometry.storage is Storage.PAGED and not sparse_topk(geometry.group_spec):
            return self.merge_across_ranks
        return super().merge_across_ranks

    # --- sparse attention: the top-k ids on this rank --------------------------------

    def sparse_local_keys(self, geometry, selected, dcp_rank):
        fn = self._ascend.get("sparse_local_keys")
        selected = np.asarray(selected, dtype=np.int64)
        if fn is None or not geometry.sharded or geometry.dcp_size == 1 or not selected.size:
            return super().sparse_local_keys(geometry, selected, dcp_rank)
        k = selected.shape[1]
        stand_in = types.SimpleNamespace(  # what _remap_sparse_indices reads of an AscendSFADCPImpl
            dcp_size=geometry.dcp_size,
            dcp_rank=dcp_rank,
            _dcp_interleave_size=geometry.interleave_size,
            _dcp_index_topk=max(k, geometry.spec.index_topk),
            _remap_order=torch.arange(max(k, geometry.spec.index_topk), dtype=torch.float32),
            _remap_invalid_index=torch.tensor(-1.0),
        )
        what = "vllm_ascend.attention.context_parallel.sfa_cp.AscendSFADCPImpl._remap_sparse_indices"
        return call(what, fn, stand_in, torch.from_numpy(selected)).numpy().astype(np.int64)

    # --- the spec-decode mask -------------------------------------------------------

    def spec_decode_mask(self, geometry, context_lens, query_lens, dcp_rank):
        fn = self._ascend.get("spec_decode_mask")
        if fn is None or not geometry.sharded:
            return super().spec_decode_mask(geometry, context_lens, query_lens, dcp_rank)
        context, q = np.asarray(context_lens, np.int64), np.asarray(query_lens, np.int64)
        n = len(q)
        totals = context + q
        keys = self.local_seq_lens(geometry, totals, dcp_rank)
        # the plugin's buffer is max_model_len wide (True: masked); the attention reads a row's
        # local keys, so the columns past its local length are not read
        buffer = torch.zeros((n, int(q.max()), int(totals.max())), dtype=torch.bool)
        dcp_size, pcp_size, dcp_at, pcp_at = self._cp(geometry, dcp_rank)
        stand_in = types.SimpleNamespace(  # what generate_mtp_attention_mask_for_decode reads of a PCPManager
            pcp_world_rank=pcp_at,
            pcp_world_size=pcp_size,
            dcp_world_rank=dcp_at,
            dcp_world_size=dcp_size,
            num_decode_reqs=n,
            vllm_config=types.SimpleNamespace(parallel_config=types.SimpleNamespace(cp_kv_cache_interleave_size=geometry.interleave_size)),
            dcp_mtp_attn_mask=types.SimpleNamespace(cpu=buffer, gpu=buffer, np=buffer.numpy()),
        )
        what = "vllm_ascend.worker.pcp_utils.PCPManager.generate_mtp_attention_mask_for_decode"
        masked = call(what, fn, stand_in, context.tolist(), q.copy())
        masked = torch.as_tensor(masked).numpy().astype(bool)
        return [~masked[i, : q[i], : keys[i]] for i in range(n)]


def ascend_slot_mapping(fn, g, positions: list[np.ndarray], block_rows, cp: tuple[int, int, int, int]) -> np.ndarray:
    """vllm-ascend's slot of every position of ``positions`` (one array per request, its block
    row in ``block_rows``) on the rank ``cp`` (``(dcp_size, pcp_size, dcp_rank, pcp_rank)``, the
    plugin's): ``PAD`` where another rank owns it."""
    dcp_size, pcp_size, dcp_rank, pcp_rank = cp
    n = len(positions)
    width = max(1, max(len(r) for r in block_rows))
    table = torch.zeros((n, width), dtype=torch.int32)
    for i, row in enumerate(block_rows):
        table[i, : len(row)] = torch.as_tensor(np.asarray(row), dtype=torch.int32)
    total = sum(len(p) for p in positions)
    req = torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64), [len(p) for p in positions]))
    pos = torch.from_numpy(np.concatenate(positions)) if total else torch.zeros(0, dtype=torch.int64)
    out = torch.full((max(total, 1),), PAD, dtype=torch.int64)
    stand_in = types.SimpleNamespace(  # what _compute_pcp_dcp_slot_mapping reads of a BlockTable
        dcp_world_size=dcp_size,
        pcp_world_size=pcp_size,
        dcp_rank=dcp_rank,
        pcp_rank=pcp_rank,
        physical_block_size=g.states_per_page,
        block_size=g.states_per_page,
        blocks_per_phys_block=1,
        cp_kv_cache_interleave_size=g.interleave_size,
        max_num_blocks_per_req=width,
        block_table=types.SimpleNamespace(cpu=table, gpu=table),
        slot_mapping=types.SimpleNamespace(cpu=out, gpu=out),
    )
    call("vllm_ascend.worker.block_table.BlockTable._compute_pcp_dcp_slot_mapping", fn, stand_in, req, pos)
    got = out[:total].numpy().astype(np.int64)
    return np.where(got < 0, PAD, got)


def pcp_key_spans(manager, positions: np.ndarray, real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Engine.pcp_query_keys`` of one split row from what ``generate_pcp_metadata`` left on
    ``manager``: the row offsets of the rank's real query tokens (``positions`` of its local
    queries, the pads left out) and each one's key ranges, the unmasked index list of its chunk
    and the masked one up to its own place in the chunk (the NPU kernel's causal mask). Each index
    list is a range of the gathered row; one that is not is an error naming it."""
    names = manager.kv_idx_names
    queries, spans = [], []

    def span(name: str) -> tuple[int, int]:
        rows = names[name].numpy().astype(np.int64)
        if rows.size and not np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size)):
            raise VllmCallError(f"vLLM vllm_ascend.worker.pcp_utils.PCPManager.generate_pcp_metadata: {name} is not one range: {rows[:8]}")
        return (int(rows[0]), int(rows[0]) + rows.size) if rows.size else (0, 0)

    for chunk, rows in (("head", manager.q_head_idx_tensor), ("tail", manager.q_tail_idx_tensor)):
        rows = rows.numpy().astype(np.int64)
        lo0, hi0 = span(f"kv_with_q_{chunk}_nomask_idx_tensor")
        lo1, _ = span(f"kv_with_q_{chunk}_mask_idx_tensor")
        inside = np.arange(len(rows), dtype=np.int64)
        keep = real[positions[rows]]
        queries.append(positions[rows][keep])
        ends = lo1 + inside + 1
        spans.append(np.stack([np.full(len(rows), lo0), np.full(len(rows), hi0), np.full(len(rows), lo1), ends], axis=1)[keep])
    return np.concatenate(queries), np.concatenate(spans).astype(np.int64)


class _HostTorch(types.ModuleType):
    """``torch`` for the MLA builders' modules: ``torch.zeros(..., pin_memory=True)`` allocates
    plain memory (the CPU build has no pinned allocator); every other name is torch's."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, pin_memory=False, **kwargs):
        return torch.zeros(*args, **kwargs)


@contextlib.contextmanager
def _host_tensor_methods():
    """``Tensor.pin_memory()`` and ``Tensor.npu()`` as the tensor itself, for the block (the
    builder pins its CPU tensors and copies them to the NPU; here both stay on the CPU). Under
    the interpreter lock: thread ranks share torch."""
    torch.Tensor.pin_memory = torch.Tensor.npu = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        del torch.Tensor.pin_memory, torch.Tensor.npu


@contextlib.contextmanager
def _torch_npu_placeholder():
    """A placeholder ``torch.npu`` while the plugin's modules load (``mla_v1.py`` names
    ``torch.npu.Event`` as a class default); removed after, unless torch had one."""
    had = hasattr(torch, "npu")
    if not had:
        torch.npu = StubModule("torch.npu", None)
    try:
        yield
    finally:
        if not had:
            del torch.npu


@contextlib.contextmanager
def _module_as(name: str, module):
    """``sys.modules[name]`` is ``module`` for the block (under the interpreter lock: thread ranks share it)."""
    before = sys.modules.get(name)
    sys.modules[name] = module
    try:
        yield
    finally:
        if before is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = before
