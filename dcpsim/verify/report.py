"""What a run found, for people (text) and machines (JSON)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field

from dcpsim.model.kinds import Storage
from dcpsim.plural import plural
from dcpsim.report_file import SCHEMA_VERSION


class FailureKind(enum.StrEnum):
    """What a failure report is about (``Failure.kind``; a string in JSON)."""

    WRONG_CONTENT = "wrong-content"
    """A rank does not hold the right entry where attention reads it."""
    REASSEMBLY = "reassembly"
    """The shards of a sharded group do not reassemble the full context exactly once."""
    REPLICAS_DIFFER = "replicas-differ"
    WRITE_VIOLATION = "write-violation"
    BLOCK_TABLE_MISMATCH = "block-table-mismatch"
    BLOCK_TABLE_OVERFLOW = "block-table-overflow"
    ATTENTION_MISMATCH = "attention-mismatch"
    KV_EVENTS = "kv-events"
    """The prefix-cache events the engine advertises do not match what a router hashes."""
    ATTENTION_METADATA = "attention-metadata"
    """A rank's attention metadata (lengths, query bounds, paged plan, table width,
    CUDA-graph padding) differs from what the scenario gives."""
    ATTENTION_MASK = "attention-mask"
    """A rank's spec-decode (verify) attention mask shows a query token a later key, or hides
    a key at or before its position (``verify.attention_mask``)."""
    PREFIX_HIT_SHORT = "prefix-hit-short"
    """An admission took a shorter prefix-cache hit than the cache allows (a lost hit:
    its tokens are recomputed, the KV is right; ``verify.prefix_hit``)."""
    RETENTION_AT_READ = "retention-at-read"
    """A key a step's query read (its window, its chunk, its context) was no longer held by the
    rank that owns it when the step ran (``verify.retention``)."""
    RANKS_DISAGREE = "ranks-disagree"
    SPARSE_SELECTION = "sparse-selection"
    """A rank's top-k selection of sparse attention (its keys for a query token) differs from
    the other ranks' or from the one the scenario gives (semantics section 14)."""
    PD_BLOCK_RELEASE = "pd-block-release"
    """P/D: a prefill rank freed a finished prompt's block before a decode rank's pull of it, or not
    exactly once (``engine.connector.PrefillBlocks``)."""
    PD_NOTIFICATION = "pd-notification"
    """P/D: a decode rank was never notified of a prompt's transfer, or of the wrong entry counts
    (``harness.pd.judge_notices``)."""
    PD_PAGE_TAIL = "pd-page-tail"
    """P/D with asynchronous loads: a decode rank's page of a running request holds a stale entry past
    the request's length, not cleared (``verify.page_tail``)."""
    ADMISSION = "admission"
    """The longest request the engine admits (``Engine.max_admissible_tokens``) refuses a request
    of the scenario its pools hold, or exceeds what they hold (``verify.admission``)."""
    ENGINE_ERROR = "engine-error"
    """The engine under test raised on a valid input (its scheduler refused or crashed at a
    step every rank reached alike)."""


def _json_safe(value):
    """Non-finite floats (an empty shard's lse = -inf) as the strings "-inf", "inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@dataclass
class Holding:
    """What one rank holds at the slot where the expected owner must hold the index."""

    rank: int
    slot: int
    group: int
    index: int
    content: int
    writer: str | None
    step: int
    found_at: list[int] = field(default_factory=list)
    """Slots of this rank whose entry claims the index for the request."""

    def describe(self) -> str:
        if self.index == -1:
            what = "nothing (never written)"
        else:
            what = f"index {self.index} of {self.writer} (content {self.content & 0xFFFFFFFF:08x}, written at step {self.step})"
        found = f"; entries for it at slots {self.found_at}" if self.found_at else ""
        return f"rank {self.rank} slot {self.slot}: {what}{found}"


@dataclass
class Failure:
    kind: FailureKind
    step: int
    message: str
    group: str | None = None
    request_id: str | None = None
    index_kind: str = "position"
    index: int | None = None
    expected_owner: int | str | None = None
    expected_slot: int | None = None
    expected_content: int | None = None
    holdings: list[Holding] = field(default_factory=list)
    last_write_step: int | None = None
    further_bad: int = 0
    details: list[str] = field(default_factory=list)
    violations: list[dict] = field(default_factory=list)
    """Write violations, as runs of consecutive slots (rank, step, group, request, index, slot, reason, count)."""
    query_position: int | None = None
    """attention-mismatch: the query token's position, the head, the error, and each rank's
    contribution to the merge (keys it saw for the token, the lse it reported)."""
    head: int | None = None
    error: float | None = None
    contributions: list[dict] = field(default_factory=list)
    block_table: list[int] | None = None
    """The request's block-table row in the failing group, as the checker read it (identical on
    every rank): the block ids behind ``expected_slot``, so a layout view can show real slots."""

    def lines(self) -> list[str]:
        out = [f"FAIL at step {self.step}: {self.message}"]
        if self.group is not None:
            out.append(f"  group: {self.group}")
        if self.request_id is not None:
            out.append(f"  request: {self.request_id}")
        if self.index is not None:
            out.append(f"  first bad {self.index_kind}: {self.index}")
            owner = "every rank (replicated)" if self.expected_owner == "all" else f"rank {self.expected_owner}"
            out.append(f"  expected on: {owner}, slot {self.expected_slot}, content {(self.expected_content or 0) & 0xFFFFFFFF:08x}")
            for h in self.holdings:
                out.append(f"    {h.describe()}")
            if self.last_write_step is not None:
                out.append(f"  last written at step {self.last_write_step}")
            out.append(f"  further bad {self.index_kind}s: {self.further_bad}")
        if self.query_position is not None and self.error is not None:
            out.append(f"  query position: {self.query_position}, head {self.head}, error {self.error:.3g}")
        elif self.query_position is not None:
            out.append(f"  query position: {self.query_position}")
        out.extend(f"  {d}" for d in self.details)
        return out


@dataclass
class RunReport:
    scenario: str
    source: str
    dcp_size: int
    interleave_size: int
    kernel_block_size: int | None
    groups: list[dict]
    passed: bool = True
    prefill_context_parallel_size: int = 1
    tensor_parallel_size: int | None = None
    """The world's PCP x TP (None: the world is the DCP group, the usual case)."""
    steps: int = 0
    verifications: int = 0
    verified_indices: int = 0
    verify_mode: str = "incremental"
    """``--verify``: ``incremental`` (re-read what changed) or ``full`` (re-read everything)."""
    full_sweeps: int = 0
    """Checks that re-read every live index (each one in ``full`` mode)."""
    metadata_checks: int = 0
    """(group, step) attention-metadata records judged (0: the engine builds none)."""
    bytes_gathered: int = 0
    """Bytes this rank contributed to verification all-gathers."""
    pcp_gather_bytes: int = 0
    """Bytes this rank contributed to the engine's PCP KV all-gathers (rank 0's; 0 without PCP)."""
    schedule: dict = field(default_factory=dict)
    failure: Failure | None = None
    ranks: list[dict] = field(default_factory=list)
    """Per-rank figures filled in by the launcher (peak memory, bytes sent)."""
    wall_time_s: float | None = None
    replay: dict | None = None
    """The resolved scenario and run options: ``dcpsim replay`` reruns them exactly."""
    attention: dict | None = None
    """The attention check's options (None: ``--attention`` off)."""
    attention_checks: int = 0
    """(group, request, step) attention results compared with the full-context reference."""
    attention_query_tokens: int = 0
    attention_sampled_checks: int = 0
    """Checks of a huge prefill chunk done on a sample of its query tokens (``max_query_keys``)."""
    attention_skipped_checks: int = 0
    """(group, request, step) items of long contexts left unchecked by the step rule (``max_step_keys``)."""
    attention_checked_steps: int = 0
    """Steps with at least one attention check."""
    attention_max_error: float | None = None
    """Largest error (max abs over output and lse) seen over the run; inf if a check saw a
    NaN or an lse of -inf against a finite one."""
    attention_bytes: int = 0
    """Bytes this rank contributed to the attention merge and verdict (not in bytes_gathered)."""
    attention_merges: dict = field(default_factory=dict)
    """Steps merged with each variant (allgather, alltoall)."""
    attention_merged_by: dict = field(default_factory=dict)
    """Code the engine names (``MergedBy``) -> ``{"merges", "rows", "of"}``: how many merges
    it ran and how many of those merges' rows it merged (vLLM's combine wrappers)."""
    engine: dict | None = None
    """The engine under test: name, version, and who makes each decision."""

    @property
    def bytes_per_verified_index(self) -> float:
        return self.bytes_gathered / self.verified_indices if self.verified_indices else 0.0

    def to_json(self) -> str:
        data = {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(self)}
        data["bytes_per_verified_index"] = round(self.bytes_per_verified_index, 4)
        return json.dumps(_json_safe(data), indent=2)

    def pass_line(self) -> str:
        """The verdict of a passing run, naming what was verified."""
        writes = "every rank wrote exactly the right positions into the right slots"
        if self.attention is None:
            return f"PASS: writes verified: {writes}"
        return (
            f"PASS: writes and attention verified: {writes}, and "
            f"{plural(self.attention_checks, 'attention check')} matched the full-context reference"
        )

    def text(self) -> str:
        head = (
            f"scenario {self.scenario} ({self.source}): decode_context_parallel_size={self.dcp_size} "
            f"cp_kv_cache_interleave_size={self.interleave_size}"
            + (f" kernel_block_size={self.kernel_block_size}" if self.kernel_block_size else "")
            + (
                f" prefill_context_parallel_size={self.prefill_context_parallel_size} tensor_parallel_size={self.tensor_parallel_size}"
                if self.tensor_parallel_size is not None
                else ""
            )
        )
        out = [head]
        if self.engine and self.engine.get("name") not in (None, "reference", "none"):
            out += _engine_lines(self.engine)
        for g in self.groups:
            out.append(
                f"  group {g['name']}: {plural(g['layers'], 'layer')}, {g['storage']}, "
                f"block_size={g['block_size']} ({g['states_per_page']} states/page), "
                f"{'sharded' if g['sharded'] else 'replicated'}, "
                + (
                    "one ring block per request"
                    if g["storage"] == Storage.RING
                    else f"manager block {plural(g['manager_block_size'], 'token')}"
                )
            )
        s = self.schedule
        if s:
            out.append(
                f"  schedule: {plural(s.get('steps', 0), 'step')}, {plural(s.get('requests', 0), 'request')}, "
                f"{s.get('finished', 0)} finished, {plural(s.get('preemptions', 0), 'preemption')}, "
                f"{plural(s.get('prefix_hit_tokens', 0), 'prefix-hit token')}, {plural(s.get('reused_blocks', 0), 'reused block')}"
            )
        out.append(
            f"  verified: {plural(self.verifications, 'check')}, {plural(self.verified_indices, 'index', 'indices')}, "
            f"{plural(self.bytes_gathered, 'byte')} gathered per rank ({self.bytes_per_verified_index:.3f} B/index), "
            f"--verify {self.verify_mode} ({plural(self.full_sweeps, 'full sweep')})"
            + (
                f"; attention metadata of {plural(self.metadata_checks, '(group, step) pair')}"
                if self.metadata_checks
                else "; no attention metadata (the engine builds none)"
            )
        )
        for r in self.ranks:
            out.append(
                f"  rank {r['rank']}: peak RSS {r['peak_rss_mb']:.0f} MiB, KV stores {r['kv_store_mb']:.2f} MiB"
                + (f", CPU {r['cpu_seconds']:.2f} s" if "cpu_seconds" in r else "")
            )
        if self.attention is not None:
            a = self.attention
            merges = ", ".join(f"{n} {v}" for v, n in self.attention_merges.items() if n) or "none (no sharded group)"
            if self.attention_merged_by:
                by = "; ".join(
                    f"{code} {plural(t['merges'], 'merge')}, {t['rows']} of {plural(t['of'], 'row')}"
                    for code, t in self.attention_merged_by.items()
                )
                merges += f" (by the engine's code: {by})"
            err = "n/a" if self.attention_max_error is None else f"{self.attention_max_error:.2e}"
            out.append(
                f"  attention: {plural(self.attention_checks, 'check')} ({plural(self.attention_query_tokens, 'query token')}"
                + (f", {plural(self.attention_sampled_checks, 'check')} sampled" if self.attention_sampled_checks else "")
                + (
                    f", {plural(self.attention_skipped_checks, 'check')} skipped by the step rule, "
                    f"{plural(self.attention_checked_steps, 'step')} checked"
                    if self.attention_skipped_checks
                    else ""
                )
                + ", "
                f"{plural(a['heads'], 'head')}, K/V dims {a['head_dim']}/{a['value_dim']}), max error {err} "
                f"(tolerance {a['tolerance']:g}), lse base {a['lse_base']}, merges: {merges}, "
                f"{plural(self.attention_bytes, 'byte')} per rank"
            )
        if self.wall_time_s is not None:
            out.append(f"  wall time: {self.wall_time_s:.2f} s")
        if self.failure:
            out.extend(self.failure.lines())
        else:
            out.append(self.pass_line())
        return "\n".join(out)


def _engine_lines(e: dict) -> list[str]:
    """The report's lines on an engine under test: who makes each decision it does not
    leave to the reference, then each scheduler-side decision and the function making it."""
    out = [f"  engine: {e['name']}" + (f" {e['version']}" if e.get("version") else "")]
    if e.get("partial"):  # --engine-partial: the tree holds these in no known shape
        out.append(f"    --engine-partial: the reference makes {', '.join(e['partial'])} (the tree holds them in no known shape)")
    out += [f"    {decision}: {who}" for decision, who in e.get("decisions", {}).items() if who != "reference"]
    out.append("    (every other decision: the reference engine)")
    out += [f"    scheduler: {decision}: {who}" for decision, who in e.get("scheduler_decisions", {}).items()]
    return out
