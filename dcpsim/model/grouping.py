"""Turn named layer specs into KV-cache groups, the way vLLM's KV-cache manager does.

Layers that may share a block table (same spec kind, block size, compression
and ``dcp_replicated``) form one group; replicated and sharded layers never
share a group, and Mamba states form groups of their own (equal specs only),
never mixed with attention. A group of identical specs gets the merged spec; a group of
one kind with differing page geometry gets ``UniformTypeKVCacheSpecs``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.config import SimConfig
from dcpsim.model.specs import (
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    is_dcp_replicated_spec,
    is_dcp_sharded_spec,
    iter_layer_specs,
)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: its layers and the spec that describes them all."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    @property
    def name(self) -> str:
        """A short readable name: the spec kind and the first layer."""
        kind = type(self.representative).__name__.removesuffix("Spec")
        more = f"+{len(self.layer_names) - 1}" if len(self.layer_names) > 1 else ""
        return f"{kind}[{self.layer_names[0]}{more}]"

    @property
    def representative(self) -> KVCacheSpec:
        return iter_layer_specs(self.kv_cache_spec)[0]

    @property
    def replicated(self) -> bool:
        return is_dcp_replicated_spec(self.kv_cache_spec)

    @property
    def sharded(self) -> bool:
        return is_dcp_sharded_spec(self.kv_cache_spec)


def _group_key(spec: KVCacheSpec) -> tuple:
    """Layers with equal keys may share a group (and its block table)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        raise ConfigError("group_layer_specs takes layer specs, not a UniformTypeKVCacheSpecs")
    if isinstance(spec, MambaSpec):
        return ("MambaSpec", spec)  # one state layout, one mode: equal specs only
    kind_fields = tuple(getattr(spec, name, None) for name in ("sliding_window", "extra_retained_tokens", "attention_chunk_size"))
    return (
        type(spec).__name__,
        spec.block_size,
        getattr(spec, "dcp_replicated", None),
        getattr(spec, "tokens_per_state", None),
        kind_fields,
    )


def group_layer_specs(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Group named layer specs, in order of first appearance. Remembers the groupings it
    made: the specs are frozen, and the matrix groups one model's layers for every cell."""
    try:
        return list(_grouped(tuple(layer_specs.items())))
    except TypeError:  # an unhashable spec (a plugin's): group it uncached
        return _group_layer_specs(layer_specs)


@functools.lru_cache(maxsize=256)
def _grouped(items: tuple) -> tuple[KVCacheGroupSpec, ...]:
    return tuple(_group_layer_specs(dict(items)))


def _group_layer_specs(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    if not layer_specs:
        raise ConfigError("a model needs at least one layer with a KV cache")
    buckets: dict[tuple, dict[str, KVCacheSpec]] = {}
    for name, spec in layer_specs.items():
        buckets.setdefault(_group_key(spec), {})[name] = spec
    groups = []
    for members in buckets.values():
        specs = list(members.values())
        if all(s == specs[0] for s in specs):
            group_spec = type(specs[0]).merge(specs)
        else:
            group_spec = UniformTypeKVCacheSpecs.from_specs(members)
            if group_spec is None:  # the key guarantees one kind; keep the check honest
                raise ConfigError(f"layers {sorted(members)} cannot share a KV-cache group")
        groups.append(KVCacheGroupSpec(tuple(members), group_spec))
    return groups


def check_draft_layout(groups: list[KVCacheGroupSpec], config: SimConfig) -> None:
    """A draft model at ``decode_context_parallel_size`` 1 writes and reads every position
    on every rank: its cache must be replicated. Against a sharded cache three of four ranks
    would attend to nothing (local-inference-lab/vllm#72)."""
    if config.draft_dcp_size != 1 or config.decode_context_parallel_size == 1:
        return
    draft = set(config.draft_layers)
    for group in groups:
        names = [n for n in group.layer_names if n in draft]
        if names and not group.replicated:
            raise ConfigError(
                f"group {group.name}: the draft runs at draft_decode_context_parallel_size 1 but its layer "
                f"{names[0]!r} is sharded over {config.decode_context_parallel_size} ranks; mark the draft's "
                "layers dcp_replicated (dcp_sharded = false), or run the draft at the target's size"
            )


def check_groups_for_dcp(groups: list[KVCacheGroupSpec], config: SimConfig) -> None:
    """Every group must be either DCP-sharded or DCP-replicated when ``W > 1``.

    Also evaluates each spec's memory bound, which refuses a sharded sliding
    window under DCP with the message telling the user to mark it replicated, and
    what the config fixes of a Mamba spec (``MambaSpec.check_config``).
    """
    for group in groups:
        for spec in iter_layer_specs(group.kv_cache_spec):
            if not isinstance(spec, (AttentionSpec, MambaSpec)):
                raise ConfigError(f"group {group.name}: {type(spec).__name__} is not simulated")
        try:
            for spec in iter_layer_specs(group.kv_cache_spec):
                if isinstance(spec, MambaSpec):
                    spec.check_config(config)
            group.kv_cache_spec.max_memory_usage_bytes(config)
        except ConfigError as exc:
            raise ConfigError(f"group {group.name} (layers {', '.join(group.layer_names)}): {exc}") from None
        if config.decode_context_parallel_size > 1 and not (group.sharded or group.replicated):
            raise ConfigError(
                f"group {group.name} (layers {', '.join(group.layer_names)}): under DCP "
                f"(decode_context_parallel_size={config.decode_context_parallel_size}) only "
                "full attention can be sharded; mark the spec dcp_replicated"
            )
