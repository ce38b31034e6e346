"""Group geometry through vLLM's own spec classes (``vllm/v1/kv_cache_interface.py``), built from
the scenario's specs: whether a group is sharded (``dcp_sharded``; a replicated spec becomes
``dcp_sharded=False``, or ``dcp_replicated=True`` on a fork that has that field; a release
without either field shards every attention group, and a replicated group is refused), the
manager block size that follows from it, the block-table width (``max_num_blocks_per_req``
widened by ``get_block_table_width`` where the tree has it: ``releases.TABLE_WIDTH``),
``page_size_bytes`` and ``max_memory_usage_bytes``."""

from __future__ import annotations

import dataclasses
import types

import torch

from dcpsim.engine.loading.placeholders import is_placeholder
from dcpsim.engine.vllm.functions import call, where
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Storage
from dcpsim.model.specs import MambaSpec

SPECS_MODULE = "vllm.v1.kv_cache_interface"
SPEC_HELPERS = ("vllm.utils.math_utils", "vllm.v1.kv_cache_layout", "vllm.v1.kv_cache_spec_registry")
"""Modules the spec classes import, run for real where the tree has them."""
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def vllm_spec(tree, specs: types.ModuleType, spec):
    """vLLM's spec (of the loaded ``specs`` module) of the same class name as one of the scenario's
    layer specs, or of its nearest base vLLM has (``SparseMLAAttentionSpec`` and ``IndexerSpec``:
    vLLM stores both caches as ``MLAAttentionSpec``)."""
    known = (getattr(specs, c.__name__, None) for c in type(spec).__mro__)
    cls = next((c for c in known if c is not None and not is_placeholder(c)), None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise ConfigError(where(tree, SPECS_MODULE, type(spec).__name__, "is missing"))
    names = {f.name for f in dataclasses.fields(cls)}
    values = {
        f.name: getattr(spec, f.name)
        for f in dataclasses.fields(spec)
        if f.name in names and f.name not in ("dtype", "dtypes", "mamba_type", "dcp_replicated")
    }
    no_flag = not any(f.name in ("dcp_sharded", "dcp_replicated") for f in dataclasses.fields(cls))
    if no_flag and getattr(spec, "dcp_replicated", False) and not isinstance(spec, MambaSpec):  # no release shards a state
        raise ConfigError(
            f"vLLM {tree.version} at {tree.root}: {SPECS_MODULE}.{cls.__name__} has no dcp_sharded field: that release "
            f"shards every attention group under DCP, so a {type(spec).__name__} marked dcp_replicated cannot run there "
            "(vLLM 0.31.0 and later, and the reference engine, can)"
        )
    if isinstance(spec, MambaSpec):
        # torch dtypes; mamba_type (a backend enum the loader stubs) keeps vLLM's default,
        # which no geometry reads; dcp_sharded keeps vLLM's default for a state (False)
        values["dtypes"] = tuple(_TORCH_DTYPES.get(d, torch.uint8) for d in spec.dtypes)
    else:
        values["dtype"] = _TORCH_DTYPES.get(spec.dtype, torch.uint8)  # fp8 caches: one byte
        if "dcp_replicated" in names:  # a fork with the seed's flag
            values["dcp_replicated"] = spec.dcp_replicated
        elif "dcp_sharded" in names:
            values["dcp_sharded"] = not spec.dcp_replicated
    try:
        return cls(**values)
    except Exception as exc:  # a spec class vLLM changed
        raise ConfigError(
            where(tree, SPECS_MODULE, type(spec).__name__, f"refused {sorted(values)}: {type(exc).__name__}: {exc}")
        ) from None


def vllm_geometry(g, vspec, group, config, table_width, width_shape, cp_sizes):
    """The reference's geometry ``g`` (validation, storage, retention) with what vLLM's spec
    ``vspec`` says of the group; ``table_width``: vLLM's ``get_block_table_width`` (of the
    ``Shape`` ``width_shape``), or None where the tree has none (rows ``max_num_blocks_per_req``
    wide)."""
    replicated = getattr(vspec, "dcp_replicated", None)
    if replicated is not None:
        sharded = not replicated
    elif hasattr(vspec, "dcp_sharded"):
        sharded = bool(vspec.dcp_sharded)
    else:  # before dcp_sharded: every attention group is sharded, a state never
        sharded = g.storage is not Storage.STATE
    sharded = sharded and config.decode_context_parallel_size > 1 and g.storage is not Storage.RING
    vllm_config = types.SimpleNamespace(  # what the spec methods read of a VllmConfig
        parallel_config=types.SimpleNamespace(
            decode_context_parallel_size=cp_sizes[0],  # as the tree states the layout (parallel_rules.release_sizes)
            prefill_context_parallel_size=cp_sizes[1],  # read before 0.26.0
        ),
        model_config=types.SimpleNamespace(max_model_len=config.max_model_len),
        cache_config=types.SimpleNamespace(mamba_cache_mode=getattr(group.representative, "mamba_cache_mode", "none")),
        max_in_flight_tokens=config.max_in_flight_tokens,
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=config.max_num_batched_tokens),
    )
    cls = f"{SPECS_MODULE}.{type(vspec).__name__}"
    if hasattr(vspec, "max_num_blocks_per_req"):
        width = call(f"{cls}.max_num_blocks_per_req", vspec.max_num_blocks_per_req, vllm_config, config.max_model_len)
    else:  # before 0.26.0 the spec classes do not say; the worker sizes rows as the reference does
        width = g.block_table_width
    if table_width is not None:
        alignment = {} if not hasattr(vspec, "block_table_token_alignment") else dict(token_alignment=vspec.block_table_token_alignment)
        width = call(f"{width_shape.module}.{width_shape.qualname}", table_width, width, vspec.block_size, **alignment)
    memory = call(f"{cls}.max_memory_usage_bytes", vspec.max_memory_usage_bytes, vllm_config)
    return dataclasses.replace(
        g,
        sharded=sharded,
        block_table_width=int(width),
        page_size_bytes=int(vspec.page_size_bytes),
        max_memory_usage_bytes=int(memory),
        manager_block_size=g.block_size * (config.decode_context_parallel_size if sharded else 1),
    )
