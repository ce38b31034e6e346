"""A scenario: the model's layer specs, the engine config and the workload.

Plain frozen data; ``dcpsim.scenarios.load`` reads it from TOML, the CLI
applies overrides (``with_overrides``), and the scheduler consumes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dcpsim.errors import ConfigError
from dcpsim.model.config import KV_CACHE_LAYOUTS, SimConfig
from dcpsim.model.grouping import check_draft_layout, group_layer_specs
from dcpsim.model.heads import check_head_layouts
from dcpsim.model.helix import check_helix_scenario
from dcpsim.model.kinds import retention_of, storage_of
from dcpsim.model.sparse import check_sparse_layout
from dcpsim.model.specs import MAMBA_CACHE_MODES, CircularBufferSpec, KVCacheSpec, MambaSpec
from dcpsim.options import option


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload.

    ``acceptance`` lists how many of the ``num_speculative_tokens`` drafts each
    speculative step accepts (cycled); empty means a seeded pseudo-random
    pattern. ``preempt_at_steps`` forces a preemption (free all blocks,
    recompute later) at those steps if the request is running then.
    """

    request_id: str
    prompt_len: int
    output_len: int
    arrival_step: int = 0
    prefix: str | None = None
    shared_prefix_len: int = 0
    acceptance: tuple[int, ...] = ()
    preempt_at_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        where = f"request {self.request_id!r}"
        if self.prompt_len < 1:
            raise ConfigError(f"{where}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_len < 1:
            raise ConfigError(f"{where}: output_len must be >= 1, got {self.output_len}")
        if self.arrival_step < 0:
            raise ConfigError(f"{where}: arrival_step must be >= 0, got {self.arrival_step}")
        if not 0 <= self.shared_prefix_len <= self.prompt_len:
            raise ConfigError(f"{where}: shared_prefix_len must be in [0, prompt_len={self.prompt_len}], got {self.shared_prefix_len}")
        if self.shared_prefix_len and not self.prefix:
            raise ConfigError(f"{where}: shared_prefix_len needs a prefix name")
        if any(a < 0 for a in self.acceptance):
            raise ConfigError(f"{where}: acceptance counts must be >= 0")
        if any(s < 0 for s in self.preempt_at_steps):
            raise ConfigError(f"{where}: preempt_at_steps must be steps >= 0, got {list(self.preempt_at_steps)}")


@dataclass(frozen=True)
class Scenario:
    name: str
    layers: dict[str, KVCacheSpec]
    config: SimConfig
    requests: tuple[RequestSpec, ...]
    description: str = ""
    source: str = ""
    seed: int = 0
    verify_every: int = 1
    num_gpu_blocks: int | None = None
    """Blocks in each group's pool (besides the null block); None sizes the
    pools so that every request fits at once."""
    kv_cache_tokens: int | None = None
    """Alternative to ``num_gpu_blocks``: the token capacity of every paged
    group's pool (``cdiv(kv_cache_tokens, B * W)`` blocks for a sharded group,
    ``cdiv(kv_cache_tokens, B)`` for a replicated one), at least the largest
    request's need; rings get one block per request."""
    max_steps: int = 100_000
    aliases: dict[str, str] = field(default_factory=dict)
    """Reader layers that use another layer's cache (vLLM's ``kv_sharing_target_layer_name``).

    Metadata: a reader has no cache of its own, so it adds no group, store or write. The
    loader checks that every target is a layer with a cache, and reports and replays
    carry the aliases; nothing else reads them."""
    disaggregated: object = None
    """A ``scenarios.pd.Disaggregation`` (the ``[disaggregated]`` table): a prefill and a
    decode instance joined by a KV connector; None: one instance (``run`` runs it as given)."""

    def __post_init__(self) -> None:
        if self.config.draft_layers:  # a draft at W = 1 needs a replicated cache
            check_draft_layout(group_layer_specs(self.layers), self.config)
        check_sparse_layout(self.layers)  # sparse layers need their indexer group
        check_head_layouts(self.layers, self.config)  # gathered queries find their KV heads
        check_helix_scenario(_group_kinds(self.layers), self.config, self.requests, self.disaggregated)  # what Helix lays out
        if not self.requests:
            raise ConfigError(f"scenario {self.name!r}: needs at least one request")
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"scenario {self.name!r}: request ids must be unique")
        for r in self.requests:
            total = r.prompt_len + r.output_len
            if total > self.config.max_model_len:
                raise ConfigError(
                    f"request {r.request_id!r}: prompt_len + output_len = {total} exceeds max_model_len {self.config.max_model_len}"
                )
            late = [s for s in r.preempt_at_steps if s >= self.max_steps]
            if late:
                raise ConfigError(
                    f"request {r.request_id!r}: preempt_at_steps {late[0]} is never reached "
                    f"(a schedule has at most max_steps = {self.max_steps} steps, 0-{self.max_steps - 1})"
                )
            if any(a > self.config.num_speculative_tokens for a in r.acceptance):
                raise ConfigError(
                    f"request {r.request_id!r}: an acceptance count exceeds num_speculative_tokens {self.config.num_speculative_tokens}"
                )
        if self.verify_every < 1:
            raise ConfigError(f"verify_every must be >= 1, got {self.verify_every}")
        if self.num_gpu_blocks is not None and self.kv_cache_tokens is not None:
            raise ConfigError("set num_gpu_blocks or kv_cache_tokens, not both")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ConfigError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ConfigError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")

    def with_overrides(self, overrides: ScenarioOverrides) -> Scenario:
        """The same scenario with ``overrides`` (the command line's, or a fault's config)
        applied; see ``ScenarioOverrides`` for what each one changes."""
        o = overrides
        config_changes = {
            name: value
            for name, value in (
                ("decode_context_parallel_size", o.decode_context_parallel_size),
                ("cp_kv_cache_interleave_size", o.cp_kv_cache_interleave_size),
                ("kernel_block_size", o.kernel_block_size),
                ("max_cudagraph_capture_size", o.max_cudagraph_capture_size),
                ("chunked_prefill_workspace_size", o.chunked_prefill_workspace_size),
                ("async_scheduling", o.async_scheduling),
                ("block_size", o.block_size),  # vLLM's --block-size: the cache block size
                ("prefill_context_parallel_size", o.prefill_context_parallel_size),
                ("tensor_parallel_size", o.tensor_parallel_size),
                ("kv_cache_layout", o.kv_cache_layout),
            )
            if value is not None
        }
        if o.tensor_parallel_size is None and (o.decode_context_parallel_size is not None or o.prefill_context_parallel_size is not None):
            config_changes["tensor_parallel_size"] = None  # follows the new sizes unless given
        config = dataclasses.replace(self.config, **config_changes)
        layers = self.layers
        if o.mamba_cache_mode is not None:
            layers = with_mamba_cache_mode(layers, o.mamba_cache_mode, config)
        if o.block_size is not None:
            layers = {name: _with_block_size(spec, o.block_size) for name, spec in layers.items()}
        changes = {"config": config, "layers": layers}
        if o.seed is not None:
            changes["seed"] = o.seed
        if o.verify_every is not None:
            changes["verify_every"] = o.verify_every
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ScenarioOverrides:
    """What the command line (or a fault's config) changes of a scenario; None leaves the
    scenario's own value. Flags follow vLLM's names (``dcpsim.options``)."""

    decode_context_parallel_size: int | None = option(
        None, "DCP world size (default: the scenario's; for worker: the torchrun world size)", aliases=("--dcp",), metavar="W"
    )
    prefill_context_parallel_size: int | None = option(
        None,
        "prefill context parallel size: prefills are split over P ranks and their KV all-gathered; the world is "
        "P x TP processes (default: the scenario's, else 1)",
        aliases=("--pcp",),
        metavar="P",
    )
    tensor_parallel_size: int | None = option(
        None,
        "tensor parallel size (default: the scenario's, else W without PCP and the smallest that fits with it)",
        aliases=("--tp",),
        metavar="T",
    )
    cp_kv_cache_interleave_size: int | None = option(
        None, "positions per rank before moving to the next one", aliases=("--interleave",), metavar="I"
    )
    block_size: int | None = option(
        None,
        "states per page of every paged layer: B tokens for plain layers, B*R tokens for a compressed layer "
        "(tokens_per_state = R), so that one interleave size fits every group; ring capacities stay (a property "
        "of the model), and an align-mode Mamba layer follows it as vLLM's mamba_block_size follows the cache "
        "block size",
        metavar="B",
    )
    kernel_block_size: int | None = option(None, "attention-kernel block size in states (must divide B)", metavar="Bk")
    max_cudagraph_capture_size: int | None = option(
        None,
        "pad uniform decode steps of at most N tokens to a captured CUDA-graph size (dummy requests that must "
        "write nothing; default: the scenario's, 0 = off)",
        metavar="N",
    )
    chunked_prefill_workspace_size: int | None = option(
        None,
        "rows of the workspace a prefill gathers its cached context into, chunk by chunk (default: the "
        "scenario's, else vLLM's rule min(max(8 * max_model_len, 4 * max_num_seqs * B), 65536)); rounded up "
        "to a multiple of lcm(B, W * I)",
        aliases=("--context-chunk",),
        metavar="S",
    )
    async_scheduling: bool | None = option(None, "two batches in flight: sliding-window and chunked-local caps reserve for both")
    mamba_cache_mode: str | None = option(
        None,
        "every Mamba layer's state layout: none (one block holds the state) or align (position-indexed state "
        "blocks of the cache block size); see with_mamba_cache_mode",
        choices=MAMBA_CACHE_MODES,
    )
    kv_cache_layout: str | None = option(
        None,
        "where a sharded group's tokens live: vllm (by position) or helix (TensorRT-LLM's Helix: the prompt's "
        "blocks round-robin, then each decode block of B tokens on the next rank; default: the scenario's, else vllm)",
        choices=KV_CACHE_LAYOUTS,
    )
    seed: int | None = option(None, "changes token contents and acceptance patterns")
    verify_every: int | None = option(None, "verify every N steps (and at the end)", metavar="N")


def _with_block_size(spec: KVCacheSpec, block_size: int) -> KVCacheSpec:
    """``spec`` with ``block_size`` states per page (rings and none-mode Mamba states keep theirs)."""
    if isinstance(spec, CircularBufferSpec) or (isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "align"):
        return spec
    return dataclasses.replace(spec, block_size=block_size * _compression(spec))


def _group_kinds(layers: dict[str, KVCacheSpec]) -> list[tuple]:
    """``(name, storage, retention, shardable, block_size)`` of each KV-cache group (``check_helix_scenario``)."""
    return [
        (g.name, storage_of(g.representative), retention_of(g.representative), g.sharded, g.representative.block_size)
        for g in group_layer_specs(layers)
    ]


def _compression(spec: KVCacheSpec) -> int:
    """Tokens per stored record: ``R`` for a compressed cache, else 1."""
    tps = getattr(spec, "tokens_per_state", 1)
    return tps if isinstance(tps, int) and tps > 1 else 1


def with_mamba_cache_mode(layers: dict[str, KVCacheSpec], mode: str, config: SimConfig) -> dict[str, KVCacheSpec]:
    """Every Mamba layer switched to ``mamba_cache_mode = mode`` with the block size vLLM
    gives that mode: ``max_model_len`` for ``none``; for ``align`` the cache block size,
    here the smallest block size of the model's uncompressed attention layers (a Mamba
    layer already in ``align`` mode keeps its own)."""
    if mode not in MAMBA_CACHE_MODES:
        raise ConfigError(f"mamba_cache_mode must be one of {list(MAMBA_CACHE_MODES)}, got {mode!r}")
    attention = [s.block_size for s in layers.values() if not isinstance(s, (MambaSpec, CircularBufferSpec)) and _compression(s) == 1]
    out = {}
    for name, spec in layers.items():
        if isinstance(spec, MambaSpec) and spec.mamba_cache_mode != mode:
            size = config.max_model_len if mode == "none" else min(attention, default=spec.block_size)
            spec = dataclasses.replace(spec, mamba_cache_mode=mode, block_size=size)
        out[name] = spec
    return out
