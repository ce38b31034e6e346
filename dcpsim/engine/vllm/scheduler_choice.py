"""``--vllm-scheduler``: who schedules under ``--engine vllm``. ``manager`` (the default): vLLM's
``KVCacheManager`` decides every block in dcpsim's step loop (``dcpsim.engine.vllm.scheduler``);
``full``: vLLM's v1 ``Scheduler`` drives every step on it (``dcpsim.engine.vllm.full_scheduler``);
``dcpsim``: dcpsim's own scheduler (only vLLM's worker-side code runs). Each names who makes
every scheduler-side decision (``engine info``, reports)."""

from __future__ import annotations

from dcpsim.engine.vllm.full_scheduler import FULL_SCHEDULER_DECISIONS, VllmFullScheduler
from dcpsim.engine.vllm.scheduler import MANAGER, SCHEDULER_DECISIONS, VllmScheduler

VLLM_SCHEDULERS = ("manager", "full", "dcpsim")
"""``--vllm-scheduler``: vLLM's ``KVCacheManager`` decides every block in dcpsim's step loop
(``manager``, the default), vLLM's v1 ``Scheduler`` drives the steps (``full``), or
dcpsim's own scheduler does (``dcpsim``: only the worker side runs vLLM's code)."""
_MANAGER = f"vllm {MANAGER}"
SCHEDULER_SIDE = {
    "make_scheduler": f"{_MANAGER} in dcpsim's step loop (dcpsim.engine.vllm.scheduler)",
    "blocks_needed": f"{_MANAGER}.allocate_slots (its coordinator's get_num_blocks_to_allocate; None: preempt)",
    "first_needed_position": f"{_MANAGER}.allocate_slots (remove_skipped_blocks, lazily at the next allocation)",
    "num_released_blocks": f"{_MANAGER}.allocate_slots (remove_skipped_blocks)",
    "prefix_block_tokens": f"{_MANAGER}.get_computed_blocks (find_longest_cache_hit)",
    "prefix_hash_unit": f"{_MANAGER}.get_computed_blocks (find_longest_cache_hit)",
    "prefix_hit_tokens": f"{_MANAGER}.get_computed_blocks (its coordinator's find_longest_cache_hit; use_eagle: the EAGLE drop)",
    "prefix_hash_block_size": "vllm vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes",
    "prefix_key_position": "vllm vllm.v1.core.kv_cache_utils.get_request_block_hasher (vLLM's block hashes)",
    "max_admissible_tokens": f"not made: {_MANAGER}.allocate_slots admits by its free blocks (not judged)",
}
"""Who makes the scheduler-side decisions under ``--vllm-scheduler manager``."""
_SCHEDULER = "vllm vllm.v1.core.sched.scheduler.Scheduler"
FULL_SCHEDULER_SIDE = {
    **SCHEDULER_SIDE,
    "make_scheduler": f"{_SCHEDULER}.schedule and .update_from_output drive every step (dcpsim.engine.vllm.full_scheduler)",
}
"""Who makes the scheduler-side decisions under ``--vllm-scheduler full``."""


def runs_vllm_core(mode: str) -> bool:
    """Whether ``mode`` loads vLLM's KV cache core (``dcpsim.engine.vllm.core``)."""
    return mode in ("manager", "full")


def scheduler_sides(mode: str) -> tuple[dict, dict]:
    """(the engine's decisions, the scheduler decisions) ``mode`` gives to vLLM's code."""
    if mode == "full":
        return FULL_SCHEDULER_SIDE, FULL_SCHEDULER_DECISIONS
    if mode == "manager":
        return SCHEDULER_SIDE, SCHEDULER_DECISIONS
    return {"make_scheduler": "reference (--vllm-scheduler dcpsim)"}, {}


def scheduler_class(mode: str):
    return VllmFullScheduler if mode == "full" else VllmScheduler
