"""``SglangEngine``: an ``Engine`` whose decisions run SGLang's own DCP code from a source tree.

SGLang's layout (``docs/dcp-semantics.md`` section 13): one widened allocator with pages of
``P * W`` ids; each token's id ``loc`` in ``req_to_token`` is ``page * P * W + pos % (P * W)``
(pages aligned and filled in order), its owner ``loc % W`` and its row on the owner
``loc // W``. With dcpsim's block table holding the widened page ids, that is vLLM's layout
with ``B = P`` and ``I = 1`` (CUDA, HIP, XPU); SGLang's NPU path deals pages whole
(``I = P``). Decisions made by SGLang's code (``decisions`` names each; the rest are the
reference engine's):

* ``write_slots`` of a sharded MHA group: its Triton backend's ``_set_kv_buffer`` over its
  pool's ``set_kv_buffer`` (``dcpsim.engine.sglang.mha_writes``);
* ``write_slots`` of a sharded MLA group: SGLang's write kernels
  (``kernels/ops/kvcache/mla_buffer.py``: ``set_mla_kv_buffer_dcp_sharded_triton``, the rope
  and no-rope Triton kernels, on a sample; ``set_mla_kv_buffer_naive`` for the rest), run on
  the widened ids (``dcpsim.engine.sglang.writes``); on NPU ``localize_dcp_indices``;
* ``local_seq_lens``: ``get_dcp_lens`` and ``query_local_bounds``: ``get_dcp_chain_spec_lens``
  (``srt/layers/dcp/layout.py``), with ``I`` of the platform;
* ``attention_metadata`` of a sharded paged group (the slots a rank's attention reads):
  ``create_triton_kv_indices_for_dcp_triton``, and the kernel pages of
  ``build_attention_metadata``: ``create_mla_kv_page_table_for_dcp``
  (``kernels/ops/attention/dcp_kernels.py``) on a sample of each step's requests
  (``dcpsim.engine.sglang.reads``);
* ``merge_across_ranks``: ``dcp_lse_combine_triton`` (``alltoall``) or ``correct_attn_out``
  (``allgather``, as ``cp_lse_ag_out_rs_mla`` calls it), on a sample of each merge's rows
  (``dcpsim.engine.sglang.merge``);
* ``check_scenario``: what SGLang refuses or lays out otherwise is exit 2 quoting its rule
  (``dcpsim.engine.sglang.rules``).

An exception raised inside SGLang's code is a ``SglangCallError`` naming the function (the
harness turns it into exit 3 naming the rank).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dcpsim.engine.interface import MergedBy
from dcpsim.engine.loading.bindings import bind, resolve
from dcpsim.engine.loading.interpreter import INTERPRETER_LOCK, evenly_spaced
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.sglang import mha_writes, reads, releases, rules
from dcpsim.engine.sglang.loader import SourceTree, source_dir
from dcpsim.engine.sglang.merge import COMBINE, CORRECT, MERGE_PROGRAMS, combine_rows, correct_rows
from dcpsim.engine.sglang.reads import PAGE_TABLE, TOKEN_INDICES
from dcpsim.engine.sglang.writes import TORCH_WRITE, TRITON_WRITE, probe_slots
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Storage
from dcpsim.model.layout import PAD
from dcpsim.model.specs import MLAAttentionSpec

PLATFORMS = ("cuda", "npu")
"""``--sglang-platform``: CUDA (HIP, XPU alike) deals tokens one by one (``I = 1``), NPU deals
whole pages (``I = P``)."""
DEFAULT_WRITE_PROGRAMS = 4
DEFAULT_READ_PROGRAMS = 1
LAYOUT_MODULE, WRITE_MODULE, MERGE_MODULE = releases.LAYOUT, releases.WRITES, releases.KERNELS
FUNCTIONS = {
    "get_dcp_lens": "local_seq_lens",
    "get_dcp_chain_spec_lens": "query_local_bounds",
    "localize_dcp_indices": "npu_localize",
    TRITON_WRITE: "mla_write",
    TORCH_WRITE: "mla_write_rest",
    COMBINE: "merge_alltoall",
    CORRECT: "merge_allgather",
    TOKEN_INDICES: "attention_metadata",
    PAGE_TABLE: "build_attention_metadata",
}
"""The SGLang functions the engine calls, each with the decision of ``releases.SGLANG_TABLE``
that binds it (its module and parameters, in the shape the tree holds)."""


class SglangCallError(RuntimeError):
    """SGLang's code raised inside a rank."""


def _file(module: str) -> str:
    return module.replace(".", "/") + ".py"


MERGE_BACKEND = "flashinfer"
"""The MLA attention backend whose LSE base the ranks compute and merge in: FlashInfer MLA
(base 2; SGLang's merge is base e only for the backends ``is_mla_dcp_lse_base_on_e`` names)."""


class SglangEngine(ReferenceEngine):
    name = "sglang"
    description = "SGLang's own DCP code from a source tree: its writes, lengths, read indices and merges, on its widened ids"
    lse_base = "2"

    def __init__(
        self,
        sglang_source: str | None = None,
        platform: str = "cuda",
        write_programs: int = DEFAULT_WRITE_PROGRAMS,
        read_programs: int = DEFAULT_READ_PROGRAMS,
        partial: bool = False,
    ):
        if platform not in PLATFORMS:
            raise ConfigError(f"--sglang-platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
        self.platform = platform
        self.write_programs = write_programs
        self.read_programs = read_programs
        self.tree = SourceTree(source_dir(sglang_source))
        self.version = self.tree.version
        release = self.version if self.version in releases.SGLANG_RELEASES else None
        self.bindings = bind(
            self.tree.root, releases.SGLANG_TABLE, release=release, label="SGLang", flag="--sglang-source", partial=partial
        )
        """Each decision's code shape in this tree (``releases.SGLANG_TABLE``)."""
        if platform == "npu" and not self.bindings.has("npu_localize"):
            raise ConfigError(f"--sglang-platform npu: SGLang {self.bindings.why('npu_localize')}")
        lazy = {mha_writes.POOL_MODULE, mha_writes.BACKEND_MODULE}
        mods = self.tree.load([m for m in self.bindings.modules() if m not in lazy])
        self._mla_buffer = mods.get(WRITE_MODULE)
        self._mha: dict | None = None
        on_e, where = rules.base_e_backends(self.tree)
        self.lse_base = "e" if MERGE_BACKEND in on_e else "2"
        self.lse_base_source = f"{where}: is_mla_dcp_lse_base_on_e({MERGE_BACKEND!r}) is {MERGE_BACKEND in on_e}"
        self._fn = {name: self._function(mods, decision) for name, decision in FUNCTIONS.items()}
        lens = f"sglang {_file(LAYOUT_MODULE)}"
        rest = (
            f"::{TORCH_WRITE} on the rest"
            if self._fn[TORCH_WRITE]
            else f"the reference on the rest ({self.bindings.why('mla_write_rest')})"
        )
        writes = (
            f"sglang {_file(WRITE_MODULE)}::{TRITON_WRITE} (the rope and no-rope Triton kernels) on at most "
            f"{write_programs} tokens of each write, {rest}, at the widened ids "
            "page * P * W + pos % (P * W); MHA groups: sglang srt/layers/attention/triton_backend.py::"
            f"{mha_writes.BACKEND_WRITE} over srt/mem_cache/memory_pool.py::{mha_writes.POOL_WRITE} (its "
            f"masked_set_kv_buffer_kernel on at most {write_programs} tokens of each write, the backend's loc and mask "
            "for the rest); replicated groups: reference"
        )
        if not self._fn[TRITON_WRITE]:
            writes = f"MLA groups: reference ({self.bindings.why('mla_write')}); MHA groups: " + writes.split("MHA groups: ", 1)[1]
        if platform == "npu":
            writes = f"sglang {_file(LAYOUT_MODULE)}::localize_dcp_indices (I = P) and the page table of ascend_backend.py"
        self.decisions = {
            "check_scenario": "sglang's rules (dcpsim.engine.sglang.rules): interleave of the platform, what it replicates, "
            "what it refuses under DCP",
            "write_slots": writes,
            "local_seq_lens": f"{lens}::get_dcp_lens (interleave_size={'P' if platform == 'npu' else 1})",
            "query_local_bounds": f"{lens}::get_dcp_chain_spec_lens (per-token frontiers of a chain)"
            if self._fn["get_dcp_chain_spec_lens"]
            else f"reference ({self.bindings.why('query_local_bounds')})",
            "spec_decode_mask": "its query bounds (query_local_bounds): SGLang's kernels bound each token by its local length",
            "merge_across_ranks": f"sglang {_file(MERGE_MODULE)}::{COMBINE} (alltoall: the combine of the received partial "
            f"states) and ::{CORRECT} (allgather: as cp_lse_ag_out_rs_mla calls it, srt/layers/dcp/comm.py), on at most "
            f"{MERGE_PROGRAMS} row x head programs of each merge (the reference merges the other rows), in base "
            f"{self.lse_base} ({self.lse_base_source})",
            "shard_lse": f"reference, in base {self.lse_base} ({self.lse_base_source})",
        }
        if platform == "cuda":
            self.decisions["attention_metadata"] = (
                f"sglang {_file(MERGE_MODULE)}::{TOKEN_INDICES} (the slots a sharded paged group's attention reads, "
                "every request; the visibility mask from query_local_bounds); replicated groups: reference"
            )
            self.decisions["build_attention_metadata"] = (
                f"sglang {_file(MERGE_MODULE)}::{PAGE_TABLE} (kv_indices: the rank's kernel pages, static pool, on at most "
                f"{read_programs} requests of each step, evenly spaced; SGLang has no torch path for it, the reference "
                "builds the other requests' pages); the rest: reference with SGLang's local lengths"
            )
        else:  # SGLang's NPU page table (ascend_backend.py) is a method of its backend: not loaded
            self.decisions["attention_metadata"] = "reference (SGLang's NPU reads, ascend_backend.py, are not loaded)"
            self.decisions["build_attention_metadata"] = "reference, with SGLang's local lengths"
        """Decision -> what makes it; every other decision is the reference engine's."""

    def _function(self, mods, decision: str):
        """SGLang's function bound to ``decision``, its signature checked again on the loaded
        code; None where the reference makes the decision."""
        shape = self.bindings.bound[decision].shape
        if shape is None:
            return None
        return resolve(self.tree, mods, shape, f"dcpsim knows SGLang {releases.SGLANG_RELEASES[0]}..{releases.NEWEST}")

    def _call(self, name: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``; a write runs with the tree importable (its dispatcher imports
        ``sglang.srt.platforms`` when called) and Triton's interpreter to itself."""
        try:
            if name in (TRITON_WRITE, TORCH_WRITE, COMBINE, CORRECT, TOKEN_INDICES, PAGE_TABLE, *mha_writes.CALLS):
                with INTERPRETER_LOCK, self.tree.importable():
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        except Exception as exc:  # reported with the function's name
            raise SglangCallError(f"SGLang {name} raised {type(exc).__name__}: {exc}") from exc

    def _mha_modules(self) -> dict:
        """SGLang's Triton backend and memory pool modules, loaded on first need (a run without
        a sharded MHA group never pays for them)."""
        if self._mha is None:
            self._mha = self.tree.load([mha_writes.POOL_MODULE, mha_writes.BACKEND_MODULE])
        return self._mha

    def interleave_size(self, geometry) -> int:
        """SGLang's interleave on the platform: 1 on CUDA, the page size on NPU."""
        return geometry.block_size if self.platform == "npu" else 1

    # --- what SGLang runs ------------------------------------------------------------

    def check_scenario(self, scenario) -> None:
        rules.check(self, scenario)
        geometries = self.geometries(scenario.layers, scenario.config)
        if any(g.sharded and g.storage is Storage.PAGED and not isinstance(g.spec, MLAAttentionSpec) for g in geometries):
            self._mha_modules()  # a tree whose MHA write does not load: exit 2 here, before any rank

    # --- the write path -------------------------------------------------------------

    def write_slots(self, geometry, write, block_row, dcp_rank):
        return self.step_write_slots(geometry, [write], [block_row], dcp_rank)[0]

    def step_write_slots(self, geometry, writes, block_rows, dcp_rank):
        g = geometry
        if not g.sharded or g.storage is not Storage.PAGED or not writes:
            return [super(SglangEngine, self).write_slots(g, w, r, dcp_rank) for w, r in zip(writes, block_rows)]
        positions = [np.arange(w.start, w.stop, dtype=np.int64) for w in writes]
        if self.platform == "npu":
            slots = [self._npu_slots(g, p, row, dcp_rank) for p, row in zip(positions, block_rows)]
            return list(zip(slots, positions))
        loc = np.concatenate([widened_ids(p, row, g.block_size, g.dcp_size) for p, row in zip(positions, block_rows)])
        if isinstance(g.spec, MLAAttentionSpec):
            if self._fn[TRITON_WRITE] is None:  # releases.MLA_WRITE: absent in this tree
                return [super(SglangEngine, self).write_slots(g, w, r, dcp_rank) for w, r in zip(writes, block_rows)]
            base = None
            if self._fn[TORCH_WRITE] is None:  # the tokens the Triton kernel does not run on: the reference's slots
                base = np.concatenate([super(SglangEngine, self).write_slots(g, w, r, dcp_rank)[0] for w, r in zip(writes, block_rows)])
            self.tree.set_parallel(g.dcp_size, dcp_rank)
            flat = probe_slots(
                self._mla_buffer,
                loc,
                base=base,
                rope=g.spec.qk_rope_head_dim > 0,
                dcp_size=g.dcp_size,
                dcp_rank=dcp_rank,
                programs=self.write_programs,
                call=lambda name, fn, *a, **k: self._call(name, fn, *a, **k),
            )
        else:  # SGLang's Triton backend's MHA write over its pool's masked kernel
            flat = mha_writes.probe_mha_slots(
                self._mha_modules(),
                loc,
                np.concatenate(positions),
                dcp_size=g.dcp_size,
                dcp_rank=dcp_rank,
                programs=self.write_programs,
                call=lambda name, fn, *a: self._call(name, fn, *a),
            )
        cuts = np.cumsum([len(p) for p in positions])[:-1]
        return list(zip(np.split(flat, cuts), positions))

    def _npu_slots(self, g, positions, block_row, dcp_rank) -> np.ndarray:
        local = self._call(
            "localize_dcp_indices",
            self._fn["localize_dcp_indices"],
            torch.from_numpy(positions),
            g.dcp_size,
            dcp_rank,
            interleave_size=g.block_size,
        ).numpy()
        row = np.asarray(block_row, dtype=np.int64)
        page = np.where(local >= 0, local // g.block_size, 0)
        inside = (local >= 0) & (page < len(row))
        return np.where(inside, row[np.minimum(page, max(len(row) - 1, 0))] * g.block_size + local % g.block_size, PAD)

    # --- the read indices ---------------------------------------------------------

    def _reads_sglang(self, g) -> bool:
        """Whether SGLang's index builders say what ``g`` reads: a sharded paged group on
        CUDA whose kernel page is the page (SGLang has no smaller kernel block)."""
        return (
            self.platform == "cuda"
            and g.sharded
            and g.storage is Storage.PAGED
            and (g.kernel_block_size or g.states_per_page) == g.states_per_page
        )

    def attention_metadata(self, geometry, start, stop, block_row, dcp_rank, rows):
        if not self._reads_sglang(geometry):
            return super().attention_metadata(geometry, start, stop, block_row, dcp_rank, rows)
        local, mask, merged = self._attention_keys(geometry, start, stop, dcp_rank, rows)
        slots = self._call(
            TOKEN_INDICES,
            reads.token_slots,
            self._fn[TOKEN_INDICES],
            np.asarray(block_row, dtype=np.int64),
            len(local),
            block_size=geometry.block_size,
            dcp_size=geometry.dcp_size,
            dcp_rank=dcp_rank,
        )
        return np.where(slots >= 0, slots, PAD), mask, merged

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        g = geometry
        if not self._reads_sglang(g) or not writes:
            return meta
        chosen = evenly_spaced(len(writes), self.read_programs)
        if not len(chosen):
            return meta
        pages = self._call(
            PAGE_TABLE,
            reads.page_table,
            self._fn[PAGE_TABLE],
            [np.asarray(block_rows[i], dtype=np.int64) for i in chosen],
            meta.dcp_local_seq_lens[chosen],
            shape=self.bindings.shape("build_attention_metadata"),
            block_size=g.block_size,
            dcp_size=g.dcp_size,
            dcp_rank=dcp_rank,
        )
        per_request = np.split(meta.kv_indices, meta.kv_indptr[1:-1])
        for i, got in zip(chosen, pages):
            per_request[i] = got  # all of SGLang's pages, whatever the row holds
        lengths = [len(p) for p in per_request]
        return dataclasses.replace(
            meta,
            kv_indices=np.concatenate(per_request).astype(np.int64),
            kv_indptr=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        )

    # --- the merge across ranks -----------------------------------------------------

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        """SGLang's merge of ``variant`` on a sample of the rows (``dcpsim.engine.sglang.merge``):
        ``dcp_lse_combine_triton`` (``alltoall``) or ``correct_attn_out`` (``allgather``); its
        rows replace the reference's."""
        ref_out, ref_lse, c = super().merge_across_ranks(out, lse, group, variant=variant, base=base)
        W = group.world_size
        if W == 1 or not out.shape[0] or (variant == "allgather" and W & (W - 1)):
            # correct_attn_out cannot launch at a W not a power of two (rules.POW2_RULE): only an
            # MHA model gets here, whose SGLang merge (cp_lse_ag_out_rs_mha) is not loaded
            return ref_out, ref_lse, c
        if variant == "alltoall":
            combine = lambda *args: self._call(COMBINE, self._fn[COMBINE], *args)
            rows, got, merged = combine_rows(combine, out, lse, group, base=base)
            code = COMBINE
        else:
            correct = lambda o, l, r, new, on_e: self._call(CORRECT, self._fn[CORRECT], o, l, r, None, new, is_lse_base_on_e=on_e)
            rows, sglang_c, got, merged = correct_rows(correct, out, lse, group, base=base)
            if sglang_c != c:
                raise SglangCallError(f"dcpsim: SGLang's merged slice {sglang_c} is not the reference's {c}")
            code = CORRECT
        ref_out, ref_lse = ref_out.clone(), ref_lse.clone()
        picked = torch.from_numpy(rows)
        ref_out[picked], ref_lse[picked] = got.to(ref_out.dtype), merged.to(ref_lse.dtype)
        return ref_out, ref_lse, c, MergedBy(f"{MERGE_MODULE}.{code}", len(rows), out.shape[0])

    # --- local lengths --------------------------------------------------------------

    def local_seq_lens(self, geometry, seq_lens, dcp_rank):
        lens = np.asarray(seq_lens, dtype=np.int64)
        if not geometry.sharded:
            return lens
        fn = self._fn["get_dcp_lens"]
        if self.bindings.shape("local_seq_lens") == "token":  # no interleave_size: tokens one by one (CUDA's I = 1)
            out = self._call("get_dcp_lens", fn, torch.from_numpy(lens), geometry.dcp_size, dcp_rank)
            return np.asarray(out, dtype=np.int64)
        I = self.interleave_size(geometry)
        out = self._call("get_dcp_lens", fn, torch.from_numpy(lens), geometry.dcp_size, dcp_rank, interleave_size=I)
        return np.asarray(out, dtype=np.int64)

    def query_local_bounds(self, geometry, start, stop, dcp_rank):
        fn = self._fn["get_dcp_chain_spec_lens"]
        if not geometry.sharded or geometry.storage is not Storage.PAGED or stop <= start or fn is None:
            return super().query_local_bounds(geometry, start, stop, dcp_rank)
        I = self.interleave_size(geometry)
        out = self._call("get_dcp_chain_spec_lens", fn, torch.tensor([stop]), stop - start, geometry.dcp_size, dcp_rank, interleave_size=I)
        return np.asarray(out, dtype=np.int64)


def widened_ids(positions: np.ndarray, block_row, block_size: int, dcp_size: int) -> np.ndarray:
    """SGLang's ``req_to_token`` ids of ``positions``: pages of ``P * W`` ids, aligned and
    filled in order (``kv_cache_configurator.py:2928-2936``), the page ids dcpsim's block
    table holds."""
    span = block_size * dcp_size
    row = np.asarray(block_row, dtype=np.int64)
    return row[positions // span] * span + positions % span
