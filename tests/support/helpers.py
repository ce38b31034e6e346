"""Helpers shared by the test packages (also offered as fixtures by ``conftest.py``)."""

from __future__ import annotations

import functools
import json

from dcpsim.campaigns.selftest_options import apply_options
from dcpsim.cli import main
from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.errors import ConfigError
from dcpsim.harness.collectives import run_in_threads
from dcpsim.harness.dry_run import dry_run
from dcpsim.harness.job import Job
from dcpsim.harness.rank_run import run_rank
from dcpsim.harness.runner import merge_rank_reports
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names
from dcpsim.verify.geometry import ExpectedGroup

WRITE_PATH_FAULTS = [name for name, fault in FAULTS.items() if name != "none" and not fault.needs.get("attention")]
"""The registered faults that show without the attention check (scheduler and write path)."""


def builtin(name: str, W: int, I: int = 1, **overrides):
    """A built-in scenario at ``W`` ranks and interleave ``I`` (plus ``with_overrides``)."""
    return load_scenario(name).with_overrides(ScenarioOverrides(decode_context_parallel_size=W, cp_kv_cache_interleave_size=I, **overrides))


def builtin_names_at(W: int, *, helix: bool = False) -> list[str]:
    """The built-ins that can run at ``W``: every one but those whose stated head layout the head
    rule refuses there (``gqa-pcp2-heads`` at W = 4 and 8; semantics section 12, "Heads"), and
    but those in Helix's layout (``helix-decode``), which only the reference engine lays out,
    unless ``helix`` (semantics section 15)."""
    names = []
    for name in builtin_scenario_names():
        try:
            sc = builtin(name, W)
        except ConfigError as exc:
            if "KV heads do not follow its queries" not in str(exc):
                raise
            continue
        if sc.config.kv_cache_layout == "helix" and not helix:
            continue
        names.append(name)
    return names


def expected_group(name="g", *, W=2, I=1, B=16, Bk=None, R=1, sharded=True, storage=Storage.PAGED, retention=Retention.FULL, **fields):
    """The checker's view of one group (``verify.geometry.ExpectedGroup``), paged and full by
    default, for tests that judge a group without a scenario."""
    return ExpectedGroup(
        name=name,
        layer_names=(name,),
        storage=storage,
        retention=retention,
        sharded=sharded,
        dcp_size=W,
        interleave_size=I,
        tokens_per_state=R,
        block_size=B,
        kernel_block_size=Bk,
        **fields,
    )


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
    world = scenario.config.world_size  # W without PCP (or a larger TP)
    # a timeout, so a run whose collectives diverge fails instead of waiting forever
    reports = run_in_threads(functools.partial(run_rank, engine=engine), Job.from_options(scenario, **job), world, timeout=120)
    verdicts = {(r.passed, r.failure.kind if r.failure else None, r.steps, r.attention_checks) for r in reports}
    assert len(verdicts) == 1, f"ranks disagree: {verdicts}"
    return merge_rank_reports(reports)


def fault_scenario(name: str, **options):
    """A built-in with a fault's config options applied (``apply_options``: scenario
    overrides and ``SimConfig`` fields only; a ``Job`` option here is a mistake of the test)."""
    scenario, job = apply_options(load_scenario(name), options)
    assert not job, job
    return scenario


def run_fault(scenario, fault=None):
    """Validate (and dry-run) ``scenario``, then ``run`` it in process with the named fault
    injected (None: the reference engine)."""
    dry_run(scenario)
    return run(scenario, inject=fault)


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

    return SlidingWindowSpec(
        block_size=B, num_kv_heads=1, head_size=8, sliding_window=window, extra_retained_tokens=extra, dcp_replicated=rep
    )


def chunked_spec(B=8, size=24, rep=True):
    """A chunked-local-attention layer (replicated unless ``rep=False``)."""
    from dcpsim.model.specs import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, attention_chunk_size=size, dcp_replicated=rep)


def ring_spec(C=8):
    """A replicated compressor ring of capacity ``C``."""
    from dcpsim.model.specs import CircularBufferSpec

    return CircularBufferSpec(block_size=C, num_kv_heads=1, head_size=8, dcp_replicated=True)


def mamba_spec(B=2048, k=0, mode="none"):
    """A Mamba state layer (replicated by nature): ``B`` tokens a block (``max_model_len`` in
    ``none`` mode), ``k`` speculative state blocks, ``mode`` none or align."""
    from dcpsim.model.specs import MambaSpec

    return MambaSpec(
        block_size=B, shapes=((3, 16), (2, 4, 4)), dtypes=("bfloat16", "float32"), mamba_cache_mode=mode, num_speculative_blocks=k
    )


def request_spec(rid, P, O, **kw):
    """A request of ``P`` prompt and ``O`` output tokens (``RequestSpec`` fields in ``kw``)."""
    from dcpsim.model.scenario import RequestSpec

    return RequestSpec(request_id=rid, prompt_len=P, output_len=O, **kw)


def make_scenario(
    layers,
    requests,
    *,
    W=1,
    I=1,
    k=0,
    budget=64,
    max_len=2048,
    prefix=True,
    num_gpu_blocks=None,
    kv_cache_tokens=None,
    seed=0,
    name="t",
    max_steps=10_000,
):
    """A scenario of named layer specs and requests; ``W``, ``I``, ``k`` drafts, token
    ``budget`` per step, ``max_len`` (max_model_len), ``prefix`` caching on or off."""
    from dcpsim.model.config import SimConfig
    from dcpsim.model.scenario import Scenario

    cfg = SimConfig(
        max_model_len=max_len,
        max_num_batched_tokens=budget,
        decode_context_parallel_size=W,
        cp_kv_cache_interleave_size=I,
        num_speculative_tokens=k,
        enable_prefix_caching=prefix,
    )
    return Scenario(
        name=name,
        layers=dict(layers),
        config=cfg,
        requests=tuple(requests),
        num_gpu_blocks=num_gpu_blocks,
        kv_cache_tokens=kv_cache_tokens,
        seed=seed,
        max_steps=max_steps,
    )


# --- trace files (--trace) -------------------------------------------------------------------

TRACE_KEYS = {
    "X": ("name", "cat", "ts", "dur", "pid", "tid"),
    "i": ("name", "cat", "ts", "pid", "tid", "s"),
    "C": ("name", "ts", "pid", "args"),
    "M": ("name", "pid", "tid", "args"),
}
"""The keys every event of a phase must have (Trace Event Format, as Perfetto reads it)."""


def trace_problems(doc) -> list[str]:
    """What is wrong with a trace document: a missing key for its ``ph``, a negative
    timestamp or duration, slices of one thread that overlap without nesting or start
    at the same time (Perfetto may drop or misnest those), an event whose process or
    thread no metadata event names, a list among an event's top-level values (Perfetto's
    JSON tokenizer refuses the whole file for one), a ``displayTimeUnit`` (Perfetto reads
    it as the unit of ``ts``)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["no traceEvents list"]
    problems, slices = [], {}
    if "displayTimeUnit" in doc:
        problems.append("a displayTimeUnit")
    names = trace_names(doc)
    for k, e in enumerate(doc["traceEvents"]):
        problems += _event_problems(k, e, names)
        if e.get("ph") == "X" and all(key in e for key in TRACE_KEYS["X"]):
            slices.setdefault((e["pid"], e["tid"]), []).append(e)
    for (pid, tid), events in slices.items():
        problems += _slice_problems(pid, tid, events)
    return problems


def _event_problems(k: int, e: dict, names: tuple[dict, dict]) -> list[str]:
    """One event's problems: its ``ph``, its keys, its values, and who names its process and thread."""
    keys = TRACE_KEYS.get(e.get("ph"))
    if keys is None:
        return [f"event {k}: unknown ph {e.get('ph')!r}"]
    problems = []
    if any(isinstance(v, list) for v in e.values()):
        problems.append(f"event {k} ({e.get('name')}): a list at the top level")
    missing = [key for key in keys if key not in e]
    if missing:
        return [*problems, f"event {k} ({e.get('name')}): no {missing}"]
    if e["ph"] == "M":
        if e["name"] in ("process_name", "thread_name") and not e["args"].get("name"):
            problems.append(f"event {k}: {e['name']} without a name")
        return problems
    if not (isinstance(e["ts"], (int, float)) and e["ts"] >= 0):
        problems.append(f"event {k} ({e['name']}): ts {e['ts']!r}")
    if e["ph"] == "X" and not (isinstance(e["dur"], (int, float)) and e["dur"] >= 0):
        problems.append(f"event {k} ({e['name']}): dur {e['dur']!r}")
    if e["ph"] == "i" and e["s"] not in ("t", "p", "g"):
        problems.append(f"event {k}: instant scope {e['s']!r}")
    if e["ph"] == "C" and not all(isinstance(v, (int, float)) for v in e["args"].values()):
        problems.append(f"event {k}: counter values {e['args']}")
    processes, threads = names
    if e["pid"] not in processes:
        problems.append(f"event {k} ({e['name']}): process {e['pid']} has no process_name")
    if (e["pid"], e["tid"]) not in threads:
        problems.append(f"event {k} ({e['name']}): thread {e['tid']} of {e['pid']} has no thread_name")
    return problems


def _slice_problems(pid, tid, events: list[dict]) -> list[str]:
    """One thread's slices: no two start together, and each nests in the one still open."""
    problems = []
    slack = 0.002  # timestamps are rounded to the nanosecond
    open_ends = []
    starts = [e["ts"] for e in events]
    if len(set(starts)) != len(starts):
        problems.append(f"thread {tid} of {pid}: two slices start at the same ts")
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while open_ends and open_ends[-1][0] <= e["ts"] + slack:
            open_ends.pop()
        end = e["ts"] + e["dur"]
        if open_ends and end > open_ends[-1][0] + slack:
            problems.append(f"thread {tid} of {pid}: {e['name']} at {e['ts']} overlaps {open_ends[-1][1]} without nesting in it")
        open_ends.append((end, e["name"]))
    return problems


def trace_names(doc) -> tuple[dict, dict]:
    """``({pid: process name}, {(pid, tid): thread name})`` from a trace's metadata events."""
    processes, threads = {}, {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return processes, threads


# --- prefill context parallelism -----------------------------------------------------------


def allowed_parallel_sizes(max_world: int = 8) -> list[tuple[int, int, int]]:
    """Every ``(pcp, tp, dcp)`` vLLM 0.33.0 allows with ``pcp * tp <= max_world``: without
    PCP every divisor of TP, with PCP 1, ``pcp`` and ``tp * pcp``."""
    out = []
    for pcp in range(1, max_world + 1):
        for tp in range(1, max_world // pcp + 1):
            dcps = [d for d in range(1, tp + 1) if tp % d == 0] if pcp == 1 else sorted({1, pcp, tp * pcp})
            out += [(pcp, tp, dcp) for dcp in dcps]
    return out


def nixl_takes_pcp_prefill(pcp: int, tp: int, w: int, decode_w: int) -> bool:
    """vLLM 0.33.0's NixlConnector with a PCP producer, restated: PCP + DCP only at TP 1 with
    ``W == pcp`` (then ``pcp`` shards that must divide the decode W or be divided by it);
    replicated PCP (``W = 1``) only to a decode instance of W = 1."""
    if w == 1:
        return decode_w == 1
    return tp == 1 and w == pcp and (pcp % decode_w == 0 or decode_w % pcp == 0)


def pd_pcp_sizes(max_world: int = 8) -> list[tuple[tuple[int, int, int], int]]:
    """Every ``((prefill pcp, tp, W), decode W)`` with prefill PCP > 1 that NIXL takes, at
    most ``max_world`` processes in all."""
    return [
        (p, d)
        for p in allowed_parallel_sizes(max_world - 1)
        if p[0] > 1
        for d in range(1, max_world - p[0] * p[1] + 1)
        if nixl_takes_pcp_prefill(*p, d)
    ]


def pcp_scenario(pcp: int, tp: int, dcp: int, I: int = 1, k: int = 1):
    """A small PCP x TP x DCP scenario: a sharded MLA layer and a replicated full-attention
    layer; a prompt long enough to be split in chunked-prefill steps, a 2-token and a
    6-token prompt arriving alone (too short for 2 * pcp chunks with DCP on), ``k`` drafts."""
    import dataclasses

    sc = make_scenario(
        {"mla": mla_spec(B=16), "rep": full_rep_spec(B=16)},
        [request_spec("long", 150, 6), request_spec("two", 2, 4, arrival_step=5), request_spec("six", 6, 3, arrival_step=9)],
        W=dcp,
        I=I,
        k=k,
        budget=64,
        max_len=512,
        name=f"pcp{pcp}-tp{tp}-dcp{dcp}",
    )
    config = dataclasses.replace(sc.config, prefill_context_parallel_size=pcp, tensor_parallel_size=tp)
    return dataclasses.replace(sc, config=config)


# --- the CLI in a subprocess, with a memory limit and a timeout ---------------------------

CLI_MEMORY_LIMIT = 3 * 2**30
"""Address space of each CLI process (and its ranks) in the bad-input tests: a runaway
ends in an allocation failure instead of taking the machine."""


def run_cli(argv, *, cwd=None, timeout=120, memory=CLI_MEMORY_LIMIT, env=None):
    """``python -m dcpsim ARGV`` in a subprocess limited to ``memory`` bytes of address
    space (``RLIMIT_AS``, inherited by the ranks) and ``timeout`` seconds; returns the
    ``CompletedProcess`` (text stdout and stderr)."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    root = str(Path(__file__).resolve().parents[1])
    full_env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dcpsim", *argv], capture_output=True, text=True, cwd=cwd, timeout=timeout, preexec_fn=limit, env=full_env
    )


# --- bad inputs: a small scenario and the values a new user may type into it --------------

TINY_SCENARIO = {
    "name": "tiny",
    "seed": 0,
    "kv_cache_tokens": 2048,
    "config": {"max_model_len": 2048, "max_num_batched_tokens": 128, "decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 4},
    "layers": [{"name": "layers.{i}.attn", "layers": "0-1", "kind": "full_attention", "block_size": 16, "num_kv_heads": 1, "head_size": 8}],
    "requests": [{"id": "r{i}", "count": 2, "prompt_len": 100, "output_len": 10}],
}
"""Two requests of 100 + 10 tokens on two full-attention layers: runs in about a second."""

EXTREME_INTS = (-(2**63), -3, -1, 0, 1, 2, 7, 10**9, 2 * 10**9, 2**31, 9 * 10**18, 2**63, 10**20)
"""Integers at the edges: negative, zero, tiny, and far beyond any machine."""


def scenario_toml(data: dict) -> str:
    """A scenario dict (``TINY_SCENARIO`` changed) as TOML text."""

    def toml_value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(toml_value(x) for x in v) + "]"
        return json.dumps(v) if isinstance(v, str) else str(v)

    lines = [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, (dict, list))]
    for key, value in data.items():
        if isinstance(value, dict):
            lines += ["", f"[{key}]"] + [f"{k} = {toml_value(v)}" for k, v in value.items()]
        elif isinstance(value, list):
            for entry in value:
                lines += ["", f"[[{key}]]"] + [f"{k} = {toml_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


# --- reports: what may differ between two runs of one job ---------------------------------

RANK_TIMINGS = ("peak_rss_mb", "cpu_seconds")
"""A rank's figures that are measured, not computed (memory and CPU time of its process)."""


def without_timings(doc: dict) -> dict:
    """A run report document (``run --json``, ``dcpsim.Report.to_dict``) without what is
    measured: its wall time and each rank's memory and CPU time (a P/D report's instances too)."""
    out = {k: v for k, v in doc.items() if k != "wall_time_s"}
    if "ranks" in out:
        out["ranks"] = [{k: v for k, v in r.items() if k not in RANK_TIMINGS} for r in out["ranks"]]
    for role in ("prefill", "decode"):
        if isinstance(out.get(role), dict):
            out[role] = without_timings(out[role])
    return out


def patched_copy(source, dest, rel: str, old: str, new: str, *more: tuple[str, str]):
    """A copy of the source tree (hard links) with ``old`` replaced by ``new`` in one file (and
    each further ``(old, new)`` pair of ``more`` after it)."""
    import os
    import shutil

    shutil.copytree(source, dest, copy_function=os.link)
    path = dest / rel
    text = path.read_text(encoding="utf-8")
    for before, after in ((old, new), *more):
        assert before in text, f"{rel} no longer contains the line to patch: {before!r}"
        text = text.replace(before, after)
    path.unlink()  # a hard link: write a file of its own
    path.write_text(text, encoding="utf-8")
    return dest
