"""Helpers shared by the test packages (also offered as fixtures by ``conftest.py``)."""

from __future__ import annotations

import functools
import json

from dcpsim.campaigns.faults import FAULTS
from dcpsim.cli import main
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.harness.batch import merge_rank_reports
from dcpsim.harness.collectives import run_in_threads
from dcpsim.harness.job import Job
from dcpsim.harness.rank import run_rank
from dcpsim.scenarios.load import load_scenario

WRITE_PATH_FAULTS = [name for name, fault in FAULTS.items() if name != "none" and not fault.needs.get("attention")]
"""The registered faults that show without the attention check (scheduler and write path)."""


def builtin(name: str, W: int, I: int = 1, **overrides):
    """A built-in scenario at ``W`` ranks and interleave ``I`` (plus ``with_overrides``)."""
    return load_scenario(name).with_overrides(
        decode_context_parallel_size=W, cp_kv_cache_interleave_size=I, **overrides)


def geometries(scenario, engine=None):
    """The (reference, or ``engine``'s) group geometries of a scenario."""
    return (engine or ReferenceEngine()).geometries(scenario.layers, scenario.config)


def scheduler(scenario, engine=None) -> Scheduler:
    """A fresh scheduler of the reference engine (or of ``engine``)."""
    engine = engine or ReferenceEngine()
    return Scheduler(scenario, engine, geometries(scenario, engine))


def run(scenario, *, engine=None, **job):
    """Run in process (ranks as threads); every rank must reach the same verdict. Returns the
    merged report. ``engine``: an engine variant to run instead of the job's."""
    W = scenario.config.decode_context_parallel_size
    reports = run_in_threads(functools.partial(run_rank, engine=engine), Job(scenario, **job), W)
    verdicts = {(r.passed, r.failure.kind if r.failure else None, r.steps, r.attention_checks) for r in reports}
    assert len(verdicts) == 1, f"ranks disagree: {verdicts}"
    return merge_rank_reports(reports)


def run_json(capsys, *argv) -> tuple[int, dict]:
    """``python -m dcpsim ARGV --json``: the exit code and the one JSON document on stdout."""
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


# --- hand-made scenarios: layer specs, requests, a scenario around them -------------------


def mla_spec(B=16, **kw):
    """A DCP-sharded MLA layer (``B`` tokens per page)."""
    from dcpsim.model.specs import MLAAttentionSpec

    return MLAAttentionSpec(block_size=B, head_size=64, **kw)


def full_rep_spec(B=16):
    """A replicated (``dcp_replicated``) full-attention layer."""
    from dcpsim.model.specs import FullAttentionSpec

    return FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dcp_replicated=True)


def swa_spec(B=8, window=20, extra=0, rep=True):
    """A sliding-window layer (replicated unless ``rep=False``)."""
    from dcpsim.model.specs import SlidingWindowSpec

    return SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=8, sliding_window=window,
                             extra_retained_tokens=extra, dcp_replicated=rep)


def chunked_spec(B=8, size=24, rep=True):
    """A chunked-local-attention layer (replicated unless ``rep=False``)."""
    from dcpsim.model.specs import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(block_size=B, num_kv_heads=1, head_size=8,
                                     attention_chunk_size=size, dcp_replicated=rep)


def ring_spec(C=8):
    """A replicated compressor ring of capacity ``C``."""
    from dcpsim.model.specs import CircularBufferSpec

    return CircularBufferSpec(block_size=C, num_kv_heads=1, head_size=8, dcp_replicated=True)


def mamba_spec(B=2048, k=0, mode="none"):
    """A Mamba state layer (replicated by nature): ``B`` tokens a block (``max_model_len`` in
    ``none`` mode), ``k`` speculative state blocks, ``mode`` none or align."""
    from dcpsim.model.specs import MambaSpec

    return MambaSpec(block_size=B, shapes=((3, 16), (2, 4, 4)), dtypes=("bfloat16", "float32"),
                     mamba_cache_mode=mode, num_speculative_blocks=k)


def request_spec(rid, P, O, **kw):
    """A request of ``P`` prompt and ``O`` output tokens (``RequestSpec`` fields in ``kw``)."""
    from dcpsim.scenarios.scenario import RequestSpec

    return RequestSpec(request_id=rid, prompt_len=P, output_len=O, **kw)


def make_scenario(layers, requests, *, W=1, I=1, k=0, budget=64, max_len=2048, prefix=True,
                  num_gpu_blocks=None, kv_cache_tokens=None, seed=0, name="t", max_steps=10_000):
    """A scenario of named layer specs and requests; ``W``, ``I``, ``k`` drafts, token
    ``budget`` per step, ``max_len`` (max_model_len), ``prefix`` caching on or off."""
    from dcpsim.model.config import SimConfig
    from dcpsim.scenarios.scenario import Scenario

    cfg = SimConfig(max_model_len=max_len, max_num_batched_tokens=budget,
                    decode_context_parallel_size=W, cp_kv_cache_interleave_size=I,
                    num_speculative_tokens=k, enable_prefix_caching=prefix)
    return Scenario(name=name, layers=dict(layers), config=cfg, requests=tuple(requests),
                    num_gpu_blocks=num_gpu_blocks, kv_cache_tokens=kv_cache_tokens, seed=seed,
                    max_steps=max_steps)
