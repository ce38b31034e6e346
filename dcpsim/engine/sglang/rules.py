"""What SGLang refuses, or lays out otherwise than a scenario asks, under DCP: exit 2 quoting
SGLang's own rule, its file and line, read from the source tree.

* the interleave: SGLang has no knob for it; its CUDA/HIP/XPU path deals tokens one by one
  (``I = 1``: the write kernel's owner rule ``loc % W``), its NPU path whole pages (``I = P``);
* prefill context parallelism with DCP is refused (``srt/arg_groups/parallel_hook.py``);
* a compressed cache whose record spans several positions (a pooled DSA index key) is refused
  (``srt/arg_groups/model_overrides/deepseek_v2.py``);
* a W that is not a power of two with a sharded MLA group: its all-gather merge
  ``correct_attn_out`` loads the LSEs with ``tl.arange(0, W)`` (``N_ROUNDED = N``, not rounded);
* what SGLang replicates (``dcp_replicated`` in dcpsim): sliding-window pools (never widened),
  Mamba state, and the draft model (a replicated draft indexes the allocator's widened ids
  raw, ``srt/mem_cache/kv_cache_configurator.py``): a draft the scenario shards with the
  target is laid out otherwise by SGLang; and the DSA indexer's K cache (semantics section 14),
  replicated in the global slot space (``srt/model_executor/pool_configurator.py``): an indexer
  the scenario shards (vLLM's choice) is laid out otherwise by SGLang (``dcp_replicated = true``
  on the indexer layers is SGLang's).
"""

from __future__ import annotations

import ast

from dcpsim.engine.loading.quote import quote
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Storage
from dcpsim.model.sparse import is_indexer
from dcpsim.model.specs import MLAAttentionSpec

WRITE_RULE = ("sglang/kernels/ops/kvcache/mla_buffer.py", "loc % DCP_WORLD_SIZE == DCP_RANK")
NPU_RULE = ("sglang/srt/hardware_backend/npu/attention/ascend_backend.py", "interleave_size=self.page_size")
PCP_RULE = ("sglang/srt/arg_groups/parallel_hook.py", '"--dcp-size > 1 does not support --enable-prefill-cp."')
RECORDS_RULE = ("sglang/srt/arg_groups/model_overrides/deepseek_v2.py", "a pooled index key spans")
INDEXER_RULE = ("sglang/srt/model_executor/pool_configurator.py", "The index-K buffer is replicated under DCP")
POW2_RULE = ("sglang/kernels/ops/attention/dcp_kernels.py", '"N_ROUNDED": N,')
DRAFT_RULE = ("sglang/srt/mem_cache/kv_cache_configurator.py", "A replicated draft indexes the allocator's virtual locs raw")


def _refuse(engine, what: str, rule) -> ConfigError:
    return ConfigError(f"SGLang {engine.version} cannot run this: {what} (SGLang's rule: {quote(engine.tree, rule)})")


def check(engine, scenario) -> None:
    """Raise ``ConfigError`` (exit 2) for a scenario SGLang cannot run as the scenario says."""
    config = scenario.config
    W, I = config.decode_context_parallel_size, config.cp_kv_cache_interleave_size
    if W <= 1:
        return
    if config.prefill_context_parallel_size > 1:
        raise _refuse(engine, f"prefill context parallelism (pcp={config.prefill_context_parallel_size}) with DCP", PCP_RULE)
    for g in engine.geometries(scenario.layers, config):
        _check_group(engine, g, W, I)


def _check_group(engine, g, W: int, I: int) -> None:
    label = f"group {g.name} (layers {', '.join(g.layer_names[:3])}{', ...' if len(g.layer_names) > 3 else ''})"
    if g.sharded and is_indexer(g.group_spec):
        raise _refuse(
            engine, f"{label} is the DSA indexer's K cache, sharded by DCP (dcp_replicated = true is SGLang's layout)", INDEXER_RULE
        )
    if g.storage is Storage.RECORDS and g.sharded:
        raise _refuse(engine, f"{label} stores one record per {g.tokens_per_state} positions, sharded by DCP", RECORDS_RULE)
    if g.draft and not g.draft_only and g.sharded:
        raise _refuse(engine, f"{label} holds draft layers the scenario shards with the target; SGLang replicates the draft", DRAFT_RULE)
    if not g.sharded:
        return
    if engine.platform == "npu" and I != g.block_size:
        raise _refuse(
            engine,
            f"{label}: cp_kv_cache_interleave_size={I}; SGLang's NPU path deals whole pages (I = block_size = {g.block_size})",
            NPU_RULE,
        )
    if isinstance(g.spec, MLAAttentionSpec) and W & (W - 1):
        raise _refuse(
            engine,
            f"{label}: decode_context_parallel_size={W}; SGLang's MLA merge correct_attn_out loads the W ranks' LSEs with "
            "tl.arange(0, N_ROUNDED), N_ROUNDED = W not rounded up, which needs a power of two",
            POW2_RULE,
        )
    if engine.platform == "cuda" and I != 1:
        raise _refuse(engine, f"{label}: cp_kv_cache_interleave_size={I}; SGLang's CUDA path deals tokens one by one (I = 1)", WRITE_RULE)


LSE_BASE_FILE = "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mla.py"
LSE_BASE_FUNCTION = "is_mla_dcp_lse_base_on_e"


def base_e_backends(tree) -> tuple[frozenset[str], str]:
    """The MLA backends whose DCP merge SGLang runs in base e (``is_mla_dcp_lse_base_on_e``:
    ``return attention_backend in {...}``; every other backend's LSEs are base 2), read from
    the tree's text, with ``file:line`` of the function; ``ConfigError`` if it is not there."""
    path = tree.root / LSE_BASE_FILE
    try:
        module = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as exc:
        raise ConfigError(f"SGLang source {tree.root}: cannot read {LSE_BASE_FILE}: {exc}") from None
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and node.name == LSE_BASE_FUNCTION:
            ret = node.body[-1]
            if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Compare) and isinstance(ret.value.comparators[0], ast.Set):
                names = frozenset(ast.literal_eval(ret.value.comparators[0]))
                return names, f"{LSE_BASE_FILE}:{node.lineno}"
    raise ConfigError(f"SGLang source {tree.root}: {LSE_BASE_FILE} has no {LSE_BASE_FUNCTION} returning 'backend in {{...}}'")
