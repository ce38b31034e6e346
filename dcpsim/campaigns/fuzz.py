"""Random schedules: a Hypothesis strategy for scenarios, and a shrinking search for failures.

``scenarios()`` draws small but complete scenarios: a layout family (full
attention, MLA with compressed records, a replicated sliding window beside
sharded full attention, replicated chunked local, the V4.1-like ring hybrid),
W, B, I and a kernel block size, speculative tokens, a token budget (and often a
``long_prefill_token_threshold`` cutting prefills into short chunks), a pool
tight enough to preempt, and requests with shared prefixes, acceptance
patterns, late arrivals and forced preemptions a few steps after arrival (so
often inside a prefill, inside a prefix hash unit), a context-gather workspace
small enough that prefills over a cached context gather it in several chunks
(semantics section 10), and CUDA-graph padding of uniform decode steps. Every other example with
three requests or more is a *revisit*: the first request computes the shared
prefix and leaves, the middle ones fill a pool hardly larger than the longest
request (so its cached blocks are handed out again), and the last one comes
back late for the prefix.

Each example runs through the same write and check code as the real harness,
with the ranks as threads of this process (``run_in_threads``) because that
is much faster than starting worlds. ``find_failure`` shrinks a failing
example to a minimal one; the CLI writes it out as a scenario file and
reruns it on a real gloo world.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from pathlib import Path

import numpy as np

from dcpsim.cache import cache_dir
from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.errors import ConfigError
from dcpsim.harness.dry_run import dry_run
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.config import SimConfig
from dcpsim.model.kinds import Storage
from dcpsim.model.plan import EventKind
from dcpsim.model.scenario import RequestSpec, Scenario
from dcpsim.model.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from dcpsim.plural import plural

IN_PROCESS = WorldOptions(in_process=True)

FAMILIES = ("full", "compressed", "window", "chunked", "ring-hybrid")
PREFIX_CACHED_FAMILIES = ("full", "compressed")
"""The families whose groups all keep every position, so the prefix cache is on."""


def require_hypothesis():
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise ConfigError("random schedules need Hypothesis: pip install 'dcpsim[test]'") from None


def _layers(family: str, B: int, k: int) -> dict:
    full = FullAttentionSpec(block_size=B, num_kv_heads=2, head_size=16)
    if family == "full":
        return {"attn.0": full, "attn.1": full}
    if family == "compressed":
        return {
            "main.0": MLAAttentionSpec(block_size=2 * B, head_size=32, tokens_per_state=2),
            "attn.1": MLAAttentionSpec(block_size=B, head_size=32),
        }
    if family == "window":
        window = SlidingWindowSpec(block_size=B, num_kv_heads=2, head_size=16, sliding_window=2 * B + 3, dcp_replicated=True)
        return {"attn.0": full, "swa.1": window}
    if family == "chunked":
        chunk = ChunkedLocalAttentionSpec(block_size=B, num_kv_heads=2, head_size=16, attention_chunk_size=3 * B, dcp_replicated=True)
        return {"attn.0": full, "chunk.1": chunk}
    ring_c = max(8, 1 << (k + 1).bit_length())
    return {
        "swa.0": SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=16, sliding_window=B + 5, dcp_replicated=True),
        "main.0": MLAAttentionSpec(block_size=2 * B, head_size=32, tokens_per_state=2),
        "ring.0": CircularBufferSpec(block_size=ring_c, num_kv_heads=1, head_size=16, dcp_replicated=True),
    }


def _longer_prefix(request: RequestSpec, tokens: int) -> RequestSpec:
    """``request`` with ``tokens`` more of its shared prefix (and of its prompt)."""
    return dataclasses.replace(request, prompt_len=request.prompt_len + tokens, shared_prefix_len=request.shared_prefix_len + tokens)


def scenarios(max_requests: int = 5):
    """A Hypothesis strategy of valid scenarios (``ConfigError`` ones are filtered out)."""
    require_hypothesis()
    from hypothesis import strategies as st

    @st.composite
    def build(draw) -> Scenario:
        n = draw(st.integers(1, max_requests))
        # revisit: the first request computes the shared prefix and leaves, the middle ones
        # fill a tight pool (reallocating its cached blocks), the last asks for it again
        revisit = n >= 3 and draw(st.booleans())
        family = draw(st.sampled_from(PREFIX_CACHED_FAMILIES if revisit else FAMILIES))
        W = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 8]))
        B = draw(st.sampled_from([4, 8, 16]))
        I = draw(st.sampled_from([i for i in (1, 2, 4, 8, 16) if i <= B]))
        k = draw(st.integers(0, 3))
        bk = draw(st.sampled_from([None] + [d for d in (2, 4) if d < B and family != "ring-hybrid"]))
        budget = draw(st.integers(max(k + 1, 4), 96))
        # short chunks (below the hash unit) admit sharers beside a prefill inside a unit
        threshold = draw(st.integers(max(k + 1, 4), budget)) if draw(st.booleans()) else 0
        unit = B * W * (2 if family == "compressed" else 1)  # the prefix hash unit
        prefix_len = draw(st.integers(unit, 2 * unit) if revisit else st.integers(0, 3 * B * W))
        requests = []
        for j in range(n):
            returning = revisit and j in (0, n - 1)
            prompt = prefix_len + draw(st.integers(1, 16)) if returning else draw(st.integers(1, 160))
            shared = min(prompt, prefix_len) if returning or draw(st.booleans()) else 0
            arrival = draw(st.integers(7, 24)) if revisit and j == n - 1 else 0 if returning else draw(st.integers(0, 6))
            # preemptions a few steps after arrival land inside the prefill more often than not
            preempt = draw(st.lists(st.integers(1, 24), max_size=2))
            requests.append(
                RequestSpec(
                    request_id=f"r{j}",
                    prompt_len=prompt,
                    output_len=draw(st.integers(1, 24)),
                    arrival_step=arrival,
                    prefix="shared" if shared else None,
                    shared_prefix_len=shared,
                    acceptance=tuple(draw(st.lists(st.integers(0, k), max_size=4))),
                    preempt_at_steps=tuple(sorted({arrival + d for d in preempt})),
                )
            )
        longest = max(r.prompt_len + r.output_len for r in requests)
        if revisit:  # hardly more than the longest request: the middle ones must evict
            pool_tokens = draw(st.integers(longest + k, longest + k + 2 * B * W))
        else:
            pool_tokens = draw(st.integers(longest + k + 2 * B * W, 4 * longest + 4 * B * W))
        # a workspace of one or a few aligned units splits the contexts of chunked prefills and
        # prefix hits into several gather chunks; None is vLLM's (64K rows: never split here)
        workspace = draw(st.sampled_from([None, 1, B * W, 4 * B * W]))
        config = SimConfig(
            max_model_len=longest + k + 1,
            chunked_prefill_workspace_size=workspace,
            max_cudagraph_capture_size=draw(st.sampled_from([0, 16, 64])),
            max_num_batched_tokens=budget,
            long_prefill_token_threshold=threshold,
            decode_context_parallel_size=W,
            cp_kv_cache_interleave_size=I,
            num_speculative_tokens=k,
            kernel_block_size=bk,
            enable_prefix_caching=revisit or draw(st.booleans()),
        )
        seed = draw(st.integers(0, 2**16))
        if k and draw(st.booleans()):  # drawn last, so the draws above stay what they were
            # an EAGLE drafter drops the hit's last block: a revisited prefix one unit longer keeps a hit
            config = dataclasses.replace(config, speculative_method="eagle")
            if revisit:
                requests = [_longer_prefix(r, unit) if r.shared_prefix_len else r for r in requests]
                config = dataclasses.replace(config, max_model_len=config.max_model_len + unit)
                pool_tokens += unit
        if family == "full" and not revisit and draw(st.integers(0, 4)) == 0:  # drawn last, as the drafter
            # Helix's layout (semantics section 15), with what it cannot express switched off; pools
            # for every request at once (a recomputation after a pressure preemption is not modelled)
            # (drafts kept: verify rows of 1 + d tokens straddle Helix's decode blocks, class 51)
            config = dataclasses.replace(
                config,
                kv_cache_layout="helix",
                speculative_method="ngram",
                enable_prefix_caching=False,
                max_cudagraph_capture_size=0,
            )
            requests = [dataclasses.replace(r, preempt_at_steps=(), prefix=None, shared_prefix_len=0) for r in requests]
            pool_tokens = None
        return Scenario(
            name=f"fuzz-{family}",
            description=f"random schedule ({family} layout)",
            source="fuzz",
            layers=_layers(family, B, k),
            config=config,
            requests=tuple(requests),
            seed=seed,
            kv_cache_tokens=pool_tokens,
        )

    return build().filter(is_valid)


def situations(scenario: Scenario) -> set[str]:
    """What a drawn scenario exercises, from the reference schedule: ``gather`` (a prefill over
    a cached context gathers it), ``gather-split`` (a context gathered in more than one piece),
    ``preemption``, ``padded`` (a uniform decode step padded to a CUDA-graph size) and
    ``padded-after-preemption`` (such a step after a preemption), ``eagle-hit`` (a prefix-cache
    hit of an EAGLE drafter's run, which drops the hit's last block) and ``helix`` (Helix's layout
    with a request that decodes past a prompt whose length is not a multiple of ``B * W``, where it
    differs from vLLM's), ``helix-verify`` (Helix with drafts: verify rows of ``1 + d`` tokens). Measured over many draws by
    ``tests/unit/campaigns/test_fuzz_situations.py`` and ``benchmarks/bench_fuzz_situations.py``."""
    engine = ReferenceEngine()
    geometries = engine.geometries(scenario.layers, scenario.config)
    found: set[str] = set()
    if scenario.config.kv_cache_layout == "helix":
        span = min(g.block_size for g in geometries) * scenario.config.decode_context_parallel_size
        if any(r.prompt_len % span and r.output_len > 1 for r in scenario.requests):
            found.add("helix")
        if scenario.config.num_speculative_tokens and any(r.output_len > 1 for r in scenario.requests):
            found.add("helix-verify")
    for plan in Scheduler(scenario, engine, geometries).plans():
        if any(e.kind is EventKind.PREEMPTED for e in plan.events):
            found.add("preemption")
        if scenario.config.eagle_drop and any(e.kind is EventKind.ADMITTED and e.prefix_hit for e in plan.events):
            found.add("eagle-hit")
        q_lens = np.array([w.stop - w.start for w in plan.writes], np.int64)
        for g in geometries:
            rows = [plan.rows_before[g.group_id].get(w.req_index, np.zeros(0, np.int64)) for w in plan.writes]
            gather = engine.context_gather(g, list(plan.writes), rows, 0)
            if gather is not None:
                found.add("gather")
                if (gather.starts > 0).any() or len(set(gather.chunks.tolist())) > 1:
                    found.add("gather-split")
            if g.storage in (Storage.PAGED, Storage.RECORDS) and engine.cudagraph_dummies(g, q_lens)[0]:
                found.add("padded")
                if "preemption" in found:
                    found.add("padded-after-preemption")
    return found


SITUATIONS = ("gather", "gather-split", "preemption", "padded", "padded-after-preemption", "eagle-hit", "helix", "helix-verify")


def situation_fractions(examples: int, seed: int = 0, pd: bool = False) -> dict[str, float]:
    """The fraction of ``examples`` drawn scenarios (as ``find_failure`` draws them, nothing
    run) that exercise each of ``SITUATIONS`` (``pd``: of ``fuzz_pd.PD_SITUATIONS``, over the
    P/D strategy)."""
    require_hypothesis()
    from hypothesis import HealthCheck, find, settings
    from hypothesis.errors import NoSuchExample

    if pd:
        from dcpsim.campaigns.fuzz_pd import PD_SITUATIONS, pd_scenarios, pd_situations

        names, strategy, classify = PD_SITUATIONS, pd_scenarios(), pd_situations
    else:
        names, strategy, classify = SITUATIONS, scenarios(), situations
    counts = dict.fromkeys(names, 0)
    drawn = [0]

    def tally(scenario: Scenario) -> bool:
        drawn[0] += 1
        for name in classify(scenario):
            counts[name] += 1
        return False

    with hypothesis_storage(cache_dir("hypothesis")), contextlib.suppress(NoSuchExample):
        find(
            strategy,
            tally,
            settings=settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck)),
            random=random.Random(seed),
        )
    return {name: n / max(drawn[0], 1) for name, n in counts.items()}


def is_valid(scenario: Scenario) -> bool:
    try:
        dry_run(scenario)
    except ConfigError:
        return False
    return True


def accepted_by(engine: EngineChoice | None):
    """A filter of the scenarios the engine under test can run (``EngineChoice.refusal``);
    the reference runs every valid scenario."""
    if engine is None:
        return lambda scenario: True
    return lambda scenario: engine.refusal(scenario) is None


def describe(scenario: Scenario) -> str:
    """One drawn scenario in a line: ``fuzz-window W=3 I=2 k=1: 2 requests, 143 tokens``; a P/D
    one with its connector and instances: ``fuzz-pd-mla nixl W=2 PCP=2->4 k=1: ...``."""
    c = scenario.config
    tokens = sum(r.prompt_len + r.output_len for r in scenario.requests)
    pd = scenario.disaggregated
    what = f"{plural(len(scenario.requests), 'request')}, {plural(tokens, 'token')}"
    if pd is not None:
        pcp = pd.prefill.prefill_context_parallel_size
        sizes = f"W={pd.prefill.decode_context_parallel_size}{f' PCP={pcp}' if pcp > 1 else ''}->{pd.decode.decode_context_parallel_size}"
        return f"{scenario.name} {pd.kv_connector} {sizes} k={c.num_speculative_tokens}: {what}"
    return f"{scenario.name} W={c.decode_context_parallel_size} I={c.cp_kv_cache_interleave_size} k={c.num_speculative_tokens}: {what}"


def check(scenario: Scenario, inject: str | None = None, engine: EngineChoice | None = None):
    """Run the scenario in-process (ranks as threads); returns the merged report."""
    job = Job(scenario, engine=engine or EngineChoice(), inject=inject, world=IN_PROCESS)
    (report,) = run_jobs([job])
    return report


@contextlib.contextmanager
def hypothesis_storage(directory: Path):
    """Hypothesis keeps its files (a cache of constants, even without an example database) in
    ``directory`` instead of ``.hypothesis/`` in the working directory, until the block ends."""
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(directory)
    try:
        yield directory
    finally:
        set_hypothesis_home_dir(None)  # back to $HYPOTHESIS_STORAGE_DIRECTORY or ./.hypothesis


def find_failure(
    inject: str | None = None,
    *,
    max_examples: int = 200,
    seed: int = 0,
    engine: EngineChoice | None = None,
    storage: Path | None = None,
    on_example=None,
    pd: bool = False,
) -> Scenario | None:
    """The minimal scenario whose run fails (with ``inject`` on), or None if none was found.
    ``pd``: draw disaggregated prefill/decode runs (``fuzz_pd``; ``inject`` a P/D fault).

    ``storage``: where Hypothesis keeps its files (default ``$DCPSIM_CACHE/hypothesis``).
    ``on_example(scenario, report, seconds)`` is called after every example's run: the
    search, then (after the first failure) each attempt to shrink it.
    """
    require_hypothesis()
    from hypothesis import HealthCheck, find, settings
    from hypothesis.errors import NoSuchExample

    searched, failing = [0], [False]
    if pd:  # P/D runs: drawn by their own strategy, each on a gloo world
        from dcpsim.campaigns.fuzz_pd import check_pd, pd_scenarios

        strategy, run = pd_scenarios(engine=engine, inject=inject), check_pd
    else:
        strategy, run = scenarios().filter(accepted_by(engine)), check

    def fails(scenario: Scenario) -> bool:
        if not failing[0] and searched[0] >= max_examples:
            return False  # the search runs at most max_examples schedules, whatever Hypothesis asks
        start = time.perf_counter()
        report = run(scenario, inject, engine)
        searched[0] += not failing[0]
        failing[0] = failing[0] or not report.passed
        if on_example is not None:
            on_example(scenario, report, time.perf_counter() - start)
        return not report.passed

    with hypothesis_storage(storage or cache_dir("hypothesis")):
        try:
            return find(
                strategy,
                fails,
                settings=settings(
                    max_examples=max_examples,
                    database=None,
                    deadline=None,
                    suppress_health_check=list(HealthCheck),
                ),
                random=random.Random(seed),
            )
        except NoSuchExample:
            return None
