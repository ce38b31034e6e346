"""Which parallel-size rule a vLLM tree's ``ParallelConfig`` holds, read from its source."""

from __future__ import annotations

import types

import pytest

from dcpsim.engine.vllm import parallel_rules
from dcpsim.errors import ConfigError
from support.helpers import builtin

OLD = """        # tp_size needs to be divisible by dcp_size
        if self.tensor_parallel_size % self.decode_context_parallel_size != 0:
            raise ValueError(
                f"tp_size={self.tensor_parallel_size} must be divisible by"
                f"dcp_size={self.decode_context_parallel_size}."
            )
"""
NEW = """        tp = self.tensor_parallel_size
        pcp = self.prefill_context_parallel_size
        dcp = self.decode_context_parallel_size
        if pcp == 1:
            # DCP reuses the TP ranks when PCP is disabled.
            if tp % dcp != 0:
                raise ValueError(f"tp_size={tp} must be divisible by dcp_size={dcp}.")
        elif dcp not in (1, pcp, tp * pcp):
            raise ValueError("When PCP is enabled, DCP must be disabled, span the PCP axis, ...")
"""


def _engine(tmp_path, body: str | None):
    if body is not None:
        (tmp_path / "vllm" / "config").mkdir(parents=True)
        (tmp_path / "vllm" / "config" / "parallel.py").write_text("class ParallelConfig:\n    def _verify_args(self):\n" + body)
    return types.SimpleNamespace(tree=types.SimpleNamespace(root=tmp_path, version="x.y"))


@pytest.mark.parametrize("body, blind", [(OLD, True), (NEW, False), (None, False)], ids=["pcp-blind", "pcp-aware", "no-file"])
def test_the_rule_is_read_off_the_tree(tmp_path, body, blind):
    assert parallel_rules.divisible_everywhere(_engine(tmp_path, body).tree) is blind


def test_a_dcp_group_spanning_the_pcp_axis_is_refused_by_a_pcp_blind_tree_quoting_it(tmp_path):
    sc = builtin("glm-pcp2-dcp2", 2)
    assert (sc.config.tp_size, sc.config.prefill_context_parallel_size, sc.config.decode_context_parallel_size) == (1, 2, 2)
    with pytest.raises(ConfigError, match=r'vllm/config/parallel.py:6: f"tp_size=\{self.tensor_parallel_size\} must be divisible by"'):
        parallel_rules.check(_engine(tmp_path, OLD), sc)


def test_a_pcp_aware_tree_and_sizes_without_pcp_pass(tmp_path):
    parallel_rules.check(_engine(tmp_path / "new", NEW), builtin("glm-pcp2-dcp2", 2))
    parallel_rules.check(_engine(tmp_path / "old", OLD), builtin("dsv3", 2))  # TP 2, DCP 2: divisible


def _with_scheduler(tmp_path, body: str, pcp_size: str):
    engine = _engine(tmp_path, body)
    sched = tmp_path / "vllm" / "v1" / "core" / "sched"
    sched.mkdir(parents=True)
    call = f"        self.kv_cache_manager = KVCacheManager(\n            pcp_world_size={pcp_size},\n        )\n"
    (sched / "scheduler.py").write_text(call)
    return engine


def test_a_tree_whose_scheduler_shards_over_pcp_runs_the_layout_it_shares_and_refuses_the_rest(tmp_path):
    # vLLM 0.23.0..0.25.1 hand the manager the PCP size (KV over PCP x DCP, shard pcp_rank * dcp + dcp_rank)
    engine = _with_scheduler(tmp_path, NEW, "self.pcp_world_size")
    spanning = builtin("glm-pcp2-dcp2", 2)  # DCP over the PCP axis: the release's PCP 2, DCP 1
    parallel_rules.check(engine, spanning)
    assert parallel_rules.release_sizes(engine.tree, spanning.config) == (1, 2)
    with pytest.raises(ConfigError, match=r"scheduler.py:2: pcp_world_size=self.pcp_world_size,\).*no replicated PCP"):
        parallel_rules.check(engine, builtin("glm-pcp2-dcp2", 1))
    with pytest.raises(ConfigError, match=r"not decode_context_parallel_size=4: .*PCP-major \(shard pcp_rank \* 2 \+ dcp_rank\)"):
        parallel_rules.check(engine, builtin("glm-pcp2-dcp2", 4, tensor_parallel_size=2))
    parallel_rules.check(engine, builtin("dsv3", 2))  # no PCP: the same layout
    assert parallel_rules.release_sizes(engine.tree, builtin("dsv3", 2).config) == (2, 1)
    later = _with_scheduler(tmp_path / "later", NEW, "1")
    assert parallel_rules.release_sizes(later.tree, spanning.config) == (2, 2)


def test_a_pcp_blind_tree_judges_the_sizes_it_is_handed(tmp_path):
    # stated as the older release states it (PCP 2, DCP 1), TP 1 is divisible: no start-up refusal
    parallel_rules.check(_with_scheduler(tmp_path, OLD, "self.pcp_world_size"), builtin("glm-pcp2-dcp2", 2))
