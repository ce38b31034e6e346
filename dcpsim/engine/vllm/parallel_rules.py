"""Which parallel sizes a vLLM tree accepts (``vllm/config/parallel.py``, ``ParallelConfig``),
read from the tree and quoted.

dcpsim's own rule (``dcpsim.model.parallel.check_parallel_sizes``) is vLLM 0.33.0's: without PCP,
``tensor_parallel_size`` must be divisible by ``decode_context_parallel_size``; with PCP, DCP is off,
spans the PCP axis or spans the whole TP x PCP grid. Older trees hold only the first rule and apply
it whatever PCP is (vLLM 0.23.0..0.25.1: ``if self.tensor_parallel_size %
self.decode_context_parallel_size != 0``, no PCP branch), so a DCP group spanning the PCP axis
(``glm-pcp2-dcp2``: TP 1, PCP 2, DCP 2) is refused at start-up. Which rule a tree holds is found
by what the lines before its divisibility error test: ``pcp == 1`` (the PCP-aware rule) or nothing.

The same releases shard the KV cache over PCP too: their scheduler hands the KV cache manager
``pcp_world_size=self.pcp_world_size`` (``vllm/v1/core/sched/scheduler.py``), so a sharded group's
block spans ``B * dcp * pcp`` tokens, where later releases pass ``pcp_world_size=1`` and shard over
the DCP group alone, which is what dcpsim models. A run with PCP > 1 on such a tree is exit 2
saying so, not a run of another layout.
"""

from __future__ import annotations

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
    try:
        return PCP_SHARDS in (tree.root / SCHEDULER).read_text(encoding="utf-8")
    except OSError:
        return False


def check(engine, scenario) -> None:
    """``ConfigError`` (exit 2) for parallel sizes the tree refuses beyond dcpsim's own rule, or
    lays out otherwise than dcpsim models."""
    config = scenario.config
    tp, dcp, pcp = config.tp_size, config.decode_context_parallel_size, config.prefill_context_parallel_size
    if pcp == 1:
        return
    if tp % dcp and divisible_everywhere(engine.tree):  # vLLM's own start-up refusal comes first
        raise ConfigError(
            f"vLLM {engine.tree.version} refuses tensor_parallel_size={tp} with decode_context_parallel_size={dcp}: its "
            f"ParallelConfig requires TP divisible by DCP whatever prefill_context_parallel_size is ({pcp} here; "
            f"{quote(engine.tree, (FILE, DIVISIBLE))}); a DCP group spanning the PCP axis needs vLLM 0.26.0 or later"
        )
    if shards_over_pcp(engine.tree):
        raise ConfigError(
            f"vLLM {engine.tree.version} shards the KV cache over PCP x DCP ({pcp} x {dcp} ranks: its scheduler hands the "
            f"KV cache manager the PCP size, {quote(engine.tree, (SCHEDULER, PCP_SHARDS))}); dcpsim models PCP as vLLM "
            "0.26.0 and later run it (the manager sees pcp_world_size=1, the KV is sharded over the DCP group), so it "
            "cannot run prefill_context_parallel_size > 1 on this tree"
        )
