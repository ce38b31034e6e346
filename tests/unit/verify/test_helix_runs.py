"""Helix's layout end to end, in process: the reference passes the built-in ``helix-decode``
at every W (with ``--attention`` too); engines that lay Helix out wrongly are caught by the
checker's own Helix derivation (``verify.helix``)."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.faults.registry import get_fault
from dcpsim.engine.reference import HelixGeometry, ReferenceEngine
from dcpsim.errors import ConfigError
from dcpsim.model.layout import slot_mapping
from dcpsim.scenarios.load import load_scenario
from support.helpers import run


class VllmLayoutUnderHelix(ReferenceEngine):
    """Writes vLLM's layout with I = B (owner (p // B) % W) although the run is Helix's: the two
    agree on the prompt's blocks and differ from the first decode block on."""

    def _helix_write_slots(self, g, write, block_row, dcp_rank):
        slots = slot_mapping(
            range(write.start, write.stop),
            block_row,
            block_size=g.block_size,
            dcp_size=g.dcp_size,
            dcp_rank=dcp_rank,
            interleave_size=g.block_size,
        )
        return slots, np.arange(write.start, write.stop, dtype=np.int64)


class LastPageFull(ReferenceEngine):
    """Metadata that reads the rank's newest block whole (``kv_last_page_len = B``)."""

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        if isinstance(geometry, HelixGeometry):
            meta.kv_last_page_len[:] = np.where(meta.kv_last_page_len > 0, geometry.block_size, 0)
        return meta


def helix(W: int, name: str = "helix-decode", **changes):
    from dcpsim.model.scenario import ScenarioOverrides

    return load_scenario(name).with_overrides(ScenarioOverrides(decode_context_parallel_size=W, **changes))


HELIX_RUNS = [("helix-decode", W) for W in (1, 2, 3, 4, 8)] + [("helix-spec-decode", W) for W in (1, 2, 3, 4)]
"""The Helix built-ins and the sizes the reference passes them at (``helix-spec-decode``: verify
rows of ``1 + d`` tokens, ``d`` per request; test_helix_spec_runs has its faults)."""


@pytest.mark.parametrize("name, W", HELIX_RUNS)
def test_reference_passes_the_helix_builtins(name, W):
    report = run(helix(W, name))
    assert report.passed, report.failure


@pytest.mark.parametrize("name", ["helix-decode", "helix-spec-decode"])
@pytest.mark.parametrize("W", [2, 4])
def test_reference_passes_the_helix_builtins_with_attention_and_kernel_blocks(name, W):
    report = run(helix(W, name, kernel_block_size=4), attention=True)
    assert report.passed and report.attention_checks > 0, report.failure


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("engine", [VllmLayoutUnderHelix])
def test_wrong_decode_layouts_are_caught(W, engine):
    report = run(helix(W), engine=engine())
    assert not report.passed and report.failure.kind == "wrong-content"


def test_metadata_reading_unfilled_slots_is_caught():
    report = run(helix(2), engine=LastPageFull())
    assert not report.passed and report.failure.kind == "attention-metadata"


@pytest.mark.parametrize("W", [2, 4])
def test_unclamped_decode_owner_fault_is_caught(W):
    report = run(helix(W), engine=get_fault("helix-decode-owner-unclamped"))
    assert not report.passed and report.failure.kind == "wrong-content"
    assert report.failure.expected_owner == 0  # the first decode token belongs to rank 0


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("prefill_context_parallel_size", 2, "prefill_context_parallel_size"),
        ("enable_prefix_caching", True, "enable_prefix_caching"),
        ("max_cudagraph_capture_size", 8, "max_cudagraph_capture_size"),
    ],
)
def test_what_helix_cannot_express_is_refused(field, value, named):
    import dataclasses

    sc = load_scenario("helix-decode")
    with pytest.raises(ConfigError, match=f'kv_cache_layout = "helix" needs {named}'):
        dataclasses.replace(
            sc.config, **{field: value, **({"tensor_parallel_size": 2} if field == "prefill_context_parallel_size" else {})}
        )


@pytest.mark.parametrize("W", [2, 4])
def test_a_small_workspace_is_aligned_to_helix_blocks_and_a_run_ends(W):
    """Helix places a prompt a block per rank (I = B whatever the config says): the context
    gather's workspace is aligned to lcm(B, W * B), the checker's rule. Aligned to the config's
    I = 1 it was B rows (4 at W = 2, B = 4), a budget of 2 per rank that one rank's block of 4
    keys never fits: the fuzz drew it and the gather's walk looped for ever."""
    sc = helix(W, block_size=4, cp_kv_cache_interleave_size=1, chunked_prefill_workspace_size=4)
    geometries = ReferenceEngine().geometries(sc.layers, sc.config)
    assert all(g.chunked_prefill_workspace_size % (4 * W) == 0 for g in geometries if g.sharded)
    assert run(sc).passed


def test_helix_is_refused_to_an_adapter_that_subclasses_the_reference():
    """vLLM's, SGLang's and vllm-ascend's adapters subclass the reference engine but lay out their
    own caches: Helix is the reference's and its faults' only (the fuzz under vllm-ascend drew it
    and failed with a KeyError before)."""
    from dcpsim.engine.reference import check_kv_cache_layout

    class Adapter(ReferenceEngine):
        name = "some-adapter"

    sc = helix(2)
    with pytest.raises(ConfigError, match="helix"):
        check_kv_cache_layout(Adapter(), sc)
    check_kv_cache_layout(ReferenceEngine(), sc)
    check_kv_cache_layout(get_fault("helix-decode-owner-unclamped"), sc)
