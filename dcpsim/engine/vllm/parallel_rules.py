"""Which parallel sizes a vLLM tree accepts (``vllm/config/parallel.py``, ``ParallelConfig``),
read from the tree and quoted.

dcpsim's own rule (``dcpsim.model.parallel.check_parallel_sizes``) is vLLM 0.33.0's: without PCP,
``tensor_parallel_size`` must be divisible by ``decode_context_parallel_size``; with PCP, DCP is off,
spans the PCP axis or spans the whole TP x PCP grid. Older trees hold only the first rule and apply
it whatever PCP is (vLLM 0.23.0..0.25.1: ``if self.tensor_parallel_size %
self.decode_context_parallel_size != 0``, no PCP branch), so a DCP group spanning the PCP axis
(``glm-pcp2-dcp2``: TP 1, PCP 2, DCP 2) is refused at start-up. Which rule a tree holds is found
by what the lines before its divisibility error test: ``pcp == 1`` (the PCP-aware rule) or nothing.
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


def check(engine, scenario) -> None:
    """``ConfigError`` (exit 2) for parallel sizes the tree refuses beyond dcpsim's own rule."""
    config = scenario.config
    tp, dcp, pcp = config.tp_size, config.decode_context_parallel_size, config.prefill_context_parallel_size
    if pcp == 1 or tp % dcp == 0 or not divisible_everywhere(engine.tree):
        return
    raise ConfigError(
        f"vLLM {engine.tree.version} refuses tensor_parallel_size={tp} with decode_context_parallel_size={dcp}: its "
        f"ParallelConfig requires TP divisible by DCP whatever prefill_context_parallel_size is ({pcp} here; "
        f"{quote(engine.tree, (FILE, DIVISIBLE))}); a DCP group spanning the PCP axis needs vLLM 0.26.0 or later"
    )
