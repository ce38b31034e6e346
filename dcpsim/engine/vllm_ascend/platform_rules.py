"""What vllm-ascend's platform does to the interleave before anything runs
(``vllm_ascend/platform.py``, ``NPUPlatform.check_and_update_config``), quoted from the tree.

Under DCP or PCP it demands ``cp_kv_cache_interleave_size == block_size`` in a P/D or KV-pool
deployment (an assertion) and overrides the interleave to the block size for sparse attention
(with a warning). dcpsim follows neither silently: a scenario with ``I != B`` in either case is
exit 2 quoting the platform's line, so the user reruns it at ``--interleave B``, the layout
vllm-ascend would really use.
"""

from __future__ import annotations

from dcpsim.engine.loading.quote import quote
from dcpsim.errors import ConfigError
from dcpsim.model.sparse import sparse_topk

PD_RULE = ("vllm_ascend/platform.py", "needs to be equal if use pcp or dcp > 1 in P/D disaggregate and kv pool scenario")
SPARSE_RULE = ("vllm_ascend/platform.py", "Override cp_kv_cache_interleave_size to")


def check(engine, scenario) -> None:
    """``ConfigError`` for an interleave vllm-ascend's platform would refuse or override."""
    config = scenario.config
    W, I = config.decode_context_parallel_size * config.prefill_context_parallel_size, config.cp_kv_cache_interleave_size
    if W == 1:
        return
    pages = sorted({getattr(spec, "block_size", None) for spec in scenario.layers.values()} - {None})
    B = config.block_size or (pages[0] if pages else None)
    if B is None or I == B:
        return
    if scenario.disaggregated is not None:
        raise ConfigError(
            f"vllm-ascend {engine.version} refuses cp_kv_cache_interleave_size={I} with block_size={B} in a P/D run "
            f"(its platform asserts they are equal: {quote(engine.ascend, PD_RULE)}); run it with --interleave {B}"
        )
    if any(sparse_topk(spec) for spec in scenario.layers.values()):
        raise ConfigError(
            f"vllm-ascend {engine.version} runs sparse attention under DCP at cp_kv_cache_interleave_size = block_size = {B}, "
            f"not {I} (its platform overrides it: {quote(engine.ascend, SPARSE_RULE)}); run it with --interleave {B}"
        )
