"""Random disaggregated prefill/decode runs (``dcpsim fuzz --pd``): a Hypothesis strategy of
scenarios with a ``[disaggregated]`` table, and their check on a gloo world.

``pd_scenarios()`` draws what P/D runs take (semantics section 14, ``harness.pd_job``): one
sharded paged group (full attention or MLA) at one block size ``B``, a connector (``nixl``:
block matching, the interleave the instance's block size; ``resharding``: any interleave), a
prefill and a decode instance of their own ``W``, speculative tokens with acceptance patterns,
late arrivals, and prompts that are often shorter than one ``B * W`` stripe of the decode
instance, so that a decode rank owns none of a prompt (sglang#32837's situation: that rank must
still be told the transfer is complete). ``pd_situations`` names what a drawn scenario
exercises; ``check_pd`` runs it as ``dcpsim run`` does (P/D runs need a gloo world: an instance
pair shares it through process subgroups, which the threads of ``--in-process`` do not have).
"""

from __future__ import annotations

from dcpsim.engine.choice import EngineChoice
from dcpsim.errors import ConfigError
from dcpsim.harness.pd import run_pd_batch
from dcpsim.harness.pd_job import PDJob, prepare_pd
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.config import SimConfig
from dcpsim.model.scenario import RequestSpec, Scenario
from dcpsim.model.specs import FullAttentionSpec, MLAAttentionSpec
from dcpsim.scenarios.pd import Disaggregation, Instance

PD_FAMILIES = ("full", "mla")
PD_SITUATIONS = ("pd-empty-decode-rank", "pd-resharding", "pd-partial-last-page")
PD_WORLD = WorldOptions(timeout=60.0)
"""A drawn run's world: a rank that waits for a peer (a transfer never completed) fails in a minute."""


def _layers(family: str, B: int) -> dict:
    if family == "full":
        spec = FullAttentionSpec(block_size=B, num_kv_heads=2, head_size=16)
        return {"attn.0": spec, "attn.1": spec}
    return {"mla.0": MLAAttentionSpec(block_size=B, head_size=32)}


def pd_scenarios(max_requests: int = 4, engine: EngineChoice | None = None, inject: str | None = None):
    """A Hypothesis strategy of valid P/D scenarios that ``engine`` (default: the reference)
    runs on both instances, and where the P/D fault ``inject`` applies (its connector): the
    ``ConfigError`` ones are filtered out."""
    from dcpsim.campaigns.fuzz import require_hypothesis

    require_hypothesis()
    from hypothesis import strategies as st

    @st.composite
    def build(draw) -> Scenario:
        connector = draw(st.sampled_from(("nixl", "resharding")))
        family = draw(st.sampled_from(PD_FAMILIES))
        B = draw(st.sampled_from([4, 8, 16]))
        prefill_w = draw(st.sampled_from([1, 2, 4]))
        decode_w = draw(st.sampled_from([1, 2, 3, 4, 8]))
        k = draw(st.integers(0, 2))
        stripe = B * decode_w
        requests = []
        for j in range(draw(st.integers(1, max_requests))):
            # half the prompts within one stripe of the decode instance: its later ranks own none of them
            short = draw(st.booleans())
            prompt = draw(st.integers(1, stripe) if short else st.integers(stripe + 1, 3 * stripe + B))
            requests.append(
                RequestSpec(
                    request_id=f"r{j}",
                    prompt_len=prompt,
                    output_len=draw(st.integers(1, 12)),
                    arrival_step=draw(st.integers(0, 4)),
                    acceptance=tuple(draw(st.lists(st.integers(0, k), max_size=3))),
                )
            )
        longest = max(r.prompt_len + r.output_len for r in requests)
        instances = {}
        for role, w in (("prefill", prefill_w), ("decode", decode_w)):
            # nixl: the interleave left out is the instance's block size (vLLM refuses another one);
            # resharding: each instance its own, so the transfer must move entries between layouts
            interleave = None if connector == "nixl" else draw(st.sampled_from([i for i in (1, 2, 4, B) if i <= B]))
            # a NIXL producer's PCP spans its DCP group (W == pcp at TP 1, vLLM 0.33.0's rule)
            pcp = w if role == "prefill" and connector == "nixl" and w > 1 and draw(st.booleans()) else 1
            instances[role] = Instance(
                decode_context_parallel_size=w,
                prefill_context_parallel_size=pcp,
                cp_kv_cache_interleave_size=interleave,
                tensor_parallel_size=1 if pcp > 1 else None,
            )
        interleave = instances["decode"].cp_kv_cache_interleave_size or B
        config = SimConfig(
            max_model_len=longest + k + 1,
            max_num_batched_tokens=draw(st.integers(max(k + 1, 8), 128)),
            decode_context_parallel_size=decode_w,
            cp_kv_cache_interleave_size=interleave,
            num_speculative_tokens=k,
            enable_prefix_caching=False,
        )
        return Scenario(
            name=f"fuzz-pd-{family}",
            description=f"random P/D run ({family} layout, {connector})",
            source="fuzz",
            layers=_layers(family, B),
            config=config,
            requests=tuple(requests),
            seed=draw(st.integers(0, 2**16)),
            disaggregated=Disaggregation(instances["prefill"], instances["decode"], connector),
        )

    return build().filter(lambda scenario: is_valid_pd(scenario, engine, inject))


def is_valid_pd(scenario: Scenario, engine: EngineChoice | None = None, inject: str | None = None) -> bool:
    try:
        prepare_pd(PDJob(scenario, inject=inject, engine=engine or EngineChoice()))
    except ConfigError:
        return False
    return True


def pd_situations(scenario: Scenario) -> set[str]:
    """What a drawn P/D scenario exercises: ``pd-empty-decode-rank`` (a decode rank that holds
    none of a prompt), ``pd-resharding`` (the resharding connector) and ``pd-partial-last-page``
    (a decode rank whose last page of a prompt is partly filled)."""
    found = set()
    if scenario.disaggregated.kv_connector == "resharding":
        found.add("pd-resharding")
    notices = PDJob(scenario).notices()  # [decode rank, request, (entries, entries on the final page)]
    if (notices[:, :, 0] == 0).any():
        found.add("pd-empty-decode-rank")
    block = min(spec.block_size for spec in scenario.layers.values())
    if ((notices[:, :, 1] > 0) & (notices[:, :, 1] < block)).any():
        found.add("pd-partial-last-page")
    return found


def check_pd(scenario: Scenario, inject: str | None = None, engine: EngineChoice | None = None):
    """Run the P/D scenario on a gloo world of both instances; returns its report."""
    (report,) = run_pd_batch([PDJob(scenario, inject=inject, engine=engine or EngineChoice())], world=PD_WORLD)
    return report
