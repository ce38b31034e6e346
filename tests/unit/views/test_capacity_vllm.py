"""The capacity planner's page bytes and per-request memory against vLLM 0.33.0's own spec
classes (``--engine vllm`` derives group geometry through them), for every built-in at
W = 1, 2, 4 and 8. Skipped only when vLLM's source cannot be fetched."""

from __future__ import annotations

import pytest

from dcpsim.engine.registry import build_engine
from dcpsim.errors import ConfigError
from dcpsim.model.grouping import KVCacheGroupSpec
from dcpsim.views import capacity as cap
from support.helpers import builtin, builtin_names_at, geometries


@pytest.mark.parametrize("W", [1, 2, 4, 8])
def test_planner_page_bytes_and_max_memory_match_vllms_spec_classes(vllm_source_or_skip, W):
    engine = build_engine("vllm", vllm_source=str(vllm_source_or_skip))
    checked = 0
    for name in builtin_names_at(W):  # gqa-pcp2-heads's heads are refused at W = 4 and 8
        sc = builtin(name, W)
        try:
            vgeoms = geometries(sc, engine)
        except ConfigError:
            continue
        col = cap.column(sc, None)
        for g, vg in zip(col.groups, vgeoms, strict=True):
            assert (g.name, g.sharded) == (vg.name, vg.sharded), name
            assert g.layer_page_size_bytes == vg.page_size_bytes, (name, g.name)
            assert g.layer_max_memory_usage_bytes == vg.max_memory_usage_bytes, (name, g.name)
            # the group: every layer through vLLM's spec class on its own
            per_layer = {}
            for layer in vg.layer_names:
                spec = sc.layers[layer]
                if spec not in per_layer:
                    one = engine.group_geometry(0, KVCacheGroupSpec((layer,), spec), sc.config)
                    per_layer[spec] = (one.page_size_bytes, one.max_memory_usage_bytes)
            values = [per_layer[sc.layers[layer]] for layer in vg.layer_names]
            assert g.page_size_bytes == sum(p for p, _ in values), (name, g.name)
            assert g.max_memory_usage_bytes == sum(m for _, m in values), (name, g.name)
            checked += 1
    assert checked >= 10
