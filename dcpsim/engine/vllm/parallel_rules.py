"""Which parallel sizes a vLLM tree accepts (``vllm/config/parallel.py``, ``ParallelConfig``),
read from the tree and quoted.

dcpsim's own rule (``dcpsim.model.parallel.check_parallel_sizes``) is vLLM 0.33.0's: without PCP,
``tensor_parallel_size`` must be divisible by ``decode_context_parallel_size``; with PCP, DCP is off,
spans the PCP axis or spans the whole TP x PCP grid. Older trees hold only the first rule and apply
it whatever PCP is (vLLM 0.23.0..0.25.1: ``if self.tensor_parallel_size %
self.decode_context_parallel_size != 0``, no PCP branch): a user of those releases who states
``glm-pcp2-dcp2``'s sizes as written (TP 1, PCP 2, DCP 2) is refused at start-up, and states its
layout as PCP 2, DCP 1 (below). Which rule a tree holds is found by what the lines before its
divisibility error test: ``pcp == 1`` (the PCP-aware rule) or nothing; it is judged on the sizes
the tree is handed.

The same releases shard the KV cache over PCP x DCP: their scheduler hands the KV cache manager
``pcp_world_size=self.pcp_world_size`` (``vllm/v1/core/sched/scheduler.py``), a sharded group's
block spans ``B * dcp * pcp`` tokens and a rank's shard is ``pcp_rank * dcp + dcp_rank``, where
later releases pass ``pcp_world_size=1`` and shard over the DCP group alone (which spans the PCP
axis: W is 1, P or T * P). The two layouts coincide where a later release's DCP group is the PCP
axis (``W == P``): that is the older release's ``prefill_context_parallel_size=P`` with
``decode_context_parallel_size=1`` (shard = ``pcp_rank`` in both), so such a scenario runs with
those sizes handed to the tree (``release_sizes``), and the tree's own TP % DCP rule is judged on
them. The others are exit 2 saying why: ``W == 1`` (replicated PCP) has no counterpart (the older
releases always shard over PCP), and ``W == T * P`` with T > 1 orders the shards PCP-major
(``pcp_rank * T + tp_rank``) where dcpsim's DCP group over the grid is TP-major.
"""

from __future__ import annotations

import functools
import pathlib

from dcpsim.engine.loading.quote import quote
from dcpsim.errors import ConfigError

FILE = "vllm/config/parallel.py"
DIVISIBLE = "must be divisible by"
"""The divisibility error's words, in every release's message (``tp_size=... must be divisible by dcp_size=...``)."""
PCP_BRANCH = "if pcp == 1"
"""The test the PCP-aware rule puts before it."""
LOOK_BACK = 6
"""Lines before the error searched for the PCP branch (it sits two or three lines above)."""


def divisible_everywhere(tree) -> bool:
    """Whether the tree requires ``tp % dcp == 0`` whatever PCP is (no PCP branch before the
    error). A tree without the file or the error says False: dcpsim's rule stands."""
    try:
        lines = (tree.root / FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    for n, line in enumerate(lines):
        if DIVISIBLE in line and ("dcp_size" in line or "dcp_size" in " ".join(lines[n : n + 2])):
            return not any(PCP_BRANCH in before for before in lines[max(0, n - LOOK_BACK) : n])
    return False


SCHEDULER = "vllm/v1/core/sched/scheduler.py"
PCP_SHARDS = "pcp_world_size=self.pcp_world_size"
"""What a scheduler that shards the KV cache over PCP hands its KV cache manager."""


def shards_over_pcp(tree) -> bool:
    """Whether the tree's scheduler hands the KV cache manager the PCP size (vLLM 0.23.0..0.25.1)."""
    return _reads(str(tree.root / SCHEDULER), PCP_SHARDS)


@functools.lru_cache(maxsize=64)
def _reads(path: str, text: str) -> bool:
    try:
        return text in pathlib.Path(path).read_text(encoding="utf-8")
    except OSError:
        return False


def release_sizes(tree, config) -> tuple[int, int]:
    """``(decode_context_parallel_size, prefill_context_parallel_size)`` as the tree's own
    config states the scenario's layout: ``(W / P, P)`` on a tree that shards over PCP x DCP,
    the scenario's ``(W, P)`` elsewhere."""
    dcp, pcp = config.decode_context_parallel_size, config.prefill_context_parallel_size
    if pcp > 1 and shards_over_pcp(tree):
        return dcp // pcp, pcp
    return dcp, pcp


def check(engine, scenario) -> None:
    """``ConfigError`` (exit 2) for parallel sizes the tree refuses beyond dcpsim's own rule, or
    lays out otherwise than dcpsim models."""
    config = scenario.config
    tp, dcp, pcp = config.tp_size, config.decode_context_parallel_size, config.prefill_context_parallel_size
    if pcp == 1:
        return
    if shards_over_pcp(engine.tree):
        _check_pcp_shards(engine, tp, dcp, pcp)
        dcp = dcp // pcp  # the tree's own sizes for this layout
    if tp % dcp and divisible_everywhere(engine.tree):  # vLLM's own start-up refusal
        raise ConfigError(
            f"vLLM {engine.tree.version} refuses tensor_parallel_size={tp} with decode_context_parallel_size={dcp}: its "
            f"ParallelConfig requires TP divisible by DCP whatever prefill_context_parallel_size is ({pcp} here; "
            f"{quote(engine.tree, (FILE, DIVISIBLE))}); a DCP group spanning the PCP axis needs vLLM 0.26.0 or later"
        )


def _check_pcp_shards(engine, tp: int, dcp: int, pcp: int) -> None:
    """The older layout (shards over PCP x DCP) is run only where it is dcpsim's (``W == P``)."""
    if dcp == pcp:
        return
    where = quote(engine.tree, (SCHEDULER, PCP_SHARDS))
    if dcp == 1:
        why = "it has no replicated PCP (decode_context_parallel_size=1 with PCP shards the KV over the PCP ranks)"
    else:
        why = (
            f"its shards over PCP x DCP are ordered PCP-major (shard pcp_rank * {dcp // pcp} + dcp_rank), where dcpsim's DCP "
            f"group of {dcp} ranks over the TP x PCP grid is ordered TP-major"
        )
    raise ConfigError(
        f"vLLM {engine.tree.version} shards the KV cache over PCP x DCP (its scheduler hands the KV cache manager the PCP "
        f"size, {where}); dcpsim runs it where that is the layout of decode_context_parallel_size == "
        f"prefill_context_parallel_size ({pcp}: the release's prefill_context_parallel_size={pcp}, "
        f"decode_context_parallel_size=1), not decode_context_parallel_size={dcp}: {why}"
    )
