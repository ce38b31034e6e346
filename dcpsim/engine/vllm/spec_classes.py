"""Group geometry through vLLM's own spec classes (``vllm/v1/kv_cache_interface.py``), built from
the scenario's specs: whether a group is sharded (``dcp_sharded``; a replicated spec becomes
``dcp_sharded=False``, or ``dcp_replicated=True`` on a fork that has that field), the manager
block size that follows from it, the block-table width (``max_num_blocks_per_req`` widened by
``get_block_table_width``), ``page_size_bytes`` and ``max_memory_usage_bytes``."""

from __future__ import annotations

import dataclasses
import types

import torch

from dcpsim.engine.loading.placeholders import is_placeholder
from dcpsim.engine.vllm.functions import call, where
from dcpsim.engine.vllm.slot_mapping import V1_MODULE
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Storage
from dcpsim.model.specs import MambaSpec

SPECS_MODULE = "vllm.v1.kv_cache_interface"
SPEC_MODULES = ("vllm.utils.math_utils", "vllm.v1.kv_cache_layout", "vllm.v1.kv_cache_spec_registry", SPECS_MODULE)
WIDTH_FUNCTION, WIDTH_ARGS = "get_block_table_width", ("max_num_blocks", "block_size")
"""The worker's block-table row width: max_num_blocks_per_req aligned to the spec's tokens."""
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
            where(tree, SPECS_MODULE, type(spec).__name__, f"refused {sorted(values)}: {type(exc).__name__}: {exc}")
        ) from None


def vllm_geometry(g, vspec, group, config, table_width):
    """The reference's geometry ``g`` (validation, storage, retention) with what vLLM's spec
    ``vspec`` says of the group; ``table_width``: vLLM's ``get_block_table_width``."""
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
    width = call(f"{cls}.max_num_blocks_per_req", vspec.max_num_blocks_per_req, vllm_config, config.max_model_len)
    width = call(f"{V1_MODULE}.{WIDTH_FUNCTION}", table_width, width, vspec.block_size, token_alignment=vspec.block_table_token_alignment)
    memory = call(f"{cls}.max_memory_usage_bytes", vspec.max_memory_usage_bytes, vllm_config)
    return dataclasses.replace(
        g,
        sharded=sharded,
        block_table_width=int(width),
        page_size_bytes=int(vspec.page_size_bytes),
        max_memory_usage_bytes=int(memory),
        manager_block_size=g.block_size * (config.decode_context_parallel_size if sharded else 1),
    )
