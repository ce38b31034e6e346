"""The checker's expectation of a step's context gather (``docs/dcp-semantics.md`` section 10).

From the step's plan and the checker's own geometry: the prefill rows (more than ``1 + k``
query tokens) with a cached context (their write starts past 0), packed in batch order into
chunks of workspace rows; a rank gathers, of an entry covering context tokens ``[s, e)``,
exactly the keys of its shard among them, counted with ``owned_below`` (its runs of ``I``
below a length), and reads them through its block-table row. Written apart from the
engine's ``model.context_gather``: the packing walks down the split length one alignment
at a time, and the rows a piece takes are rank 0's keys of whole interleave runs.
"""

from __future__ import annotations

import math

import numpy as np

from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import StepPlan
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.metadata import MetadataJudge, kernel_states, owned_below, show

WORKSPACE_CAP = 65536


def gathered_group(group: ExpectedGroup) -> bool:
    """Whether a group's prefills gather their context: paged full attention (MLA's rule)."""
    return group.storage is Storage.PAGED and group.retention is Retention.FULL


def expected_workspace(group: ExpectedGroup, config) -> int:
    """The workspace rows: the configured size or vLLM's rule, rounded up to the alignment."""
    B = group.block_size
    want = config.chunked_prefill_workspace_size
    if want is None:
        want = min(WORKSPACE_CAP, max(config.max_model_len * 8, config.max_num_seqs * B * 4))
    unit = B if not group.sharded else B * group.dcp_size * group.interleave_size // math.gcd(B, group.dcp_size * group.interleave_size)
    return max(want + (-want) % unit, unit)


def _ranks(group: ExpectedGroup) -> int:
    return group.dcp_size if group.sharded else 1


def _rows(group: ExpectedGroup, tokens: int) -> int:
    """Workspace rows per rank of ``tokens`` context tokens: whole interleave runs of rank 0."""
    W = _ranks(group)
    if W == 1:
        return tokens
    runs_per_round = W * group.interleave_size
    return (tokens + runs_per_round - 1) // runs_per_round * group.interleave_size


def expected_entries(group: ExpectedGroup, contexts: list[int], workspace: int) -> list[tuple[int, int, int, int]]:
    """``(chunk, row, start, length)`` of every entry; ``row`` indexes ``contexts``."""
    W = _ranks(group)
    step = group.block_size if W == 1 else math.lcm(group.block_size, W * group.interleave_size)
    budget, biggest = workspace // W, workspace - workspace % step
    entries, chunk, i, start = [], 0, 0, 0
    while i < len(contexts):
        if not contexts[i]:
            i += 1
            continue
        room, took = budget, False
        while i < len(contexts) and contexts[i]:
            cost = _rows(group, contexts[i]) - _rows(group, start)
            if cost <= room:
                entries.append((chunk, i, start, contexts[i] - start))
                room, took, i, start = room - cost, True, i + 1, 0
                continue
            n = min(biggest, (contexts[i] - start - 1) // step * step)
            while n > 0 and _rows(group, start + n) - _rows(group, start) > room:
                n -= step
            if n > 0:
                entries.append((chunk, i, start, n))
                start, took = start + n, True
            break
        chunk += 1 if took else 0
    return entries


def expected_gather(group: ExpectedGroup, plan: StepPlan, rows: dict, rank: int, workspace: int) -> dict | None:
    """Every field of the rank's gather of this group in this step (None: no gather)."""
    prefills = [w for w in plan.writes if w.stop - w.start > 1 + group.num_speculative_tokens]
    contexts = [w.start for w in prefills]
    entries = expected_entries(group, contexts, workspace)
    if not entries:
        return None
    kernel = kernel_states(group)
    per_block = group.page_states // kernel
    out = {k: [] for k in ("request_ids", "chunks", "starts", "seq_lens", "local_starts", "local_seq_lens", "slots")}
    for chunk, i, start, n in entries:
        w = prefills[i]
        end = min(start + n, contexts[i])
        lo, hi = owned_below(np.array([start, end]), rank, group)
        keys = np.arange(lo, hi, dtype=np.int64)
        row = np.asarray(rows.get(w.req_index, np.zeros(0, np.int64)), dtype=np.int64)
        page, offset = keys // kernel, keys % kernel
        entry = page // per_block
        inside = entry < len(row)
        slots = np.full(len(keys), -1, np.int64)
        slots[inside] = (row[entry[inside]] * per_block + page[inside] % per_block) * kernel + offset[inside]
        for name, value in zip(out, (w.request_id, chunk, start, n, int(lo), int(hi - lo), slots)):
            out[name].append(value)
    expected = {k: np.asarray(v, dtype=np.int64) for k, v in out.items() if k not in ("request_ids", "slots")}
    return dict(expected, request_ids=tuple(out["request_ids"]), slots=out["slots"], workspace_size=workspace)


def judge_gathers(judge: MetadataJudge, plan: StepPlan, gathers) -> None:
    """The step's context gathers (``verify.context_gather``): every gathered group's
    entries, field by field, each mismatch naming the request and the chunk."""
    if gathers is None or judge.config is None or not plan.writes:
        return
    by_group = {g.group: g for g in gathers}
    for g, group in enumerate(judge.groups):
        if not gathered_group(group):
            continue
        store = judge.store_of[g]
        want = expected_gather(group, plan, plan.rows_before[store], judge.rank, expected_workspace(group, judge.config))
        have = by_group.get(store)
        if want is None and have is None:
            continue
        judge.gather_checks += 1
        if want is None or have is None:
            what = "none" if want is None else f"{len(want['request_ids'])} entries"
            judge.add(plan, group, "context gather", None, what, "none" if have is None else f"{len(have.request_ids)} entries")
            continue
        _compare_gather(judge, plan, group, have, want)


def _compare_gather(judge: MetadataJudge, plan, group, have, want: dict) -> None:
    if have.workspace_size != want["workspace_size"]:
        judge.add(plan, group, "context gather workspace_size", None, str(want["workspace_size"]), str(have.workspace_size))
    if tuple(have.request_ids) != want["request_ids"] or not np.array_equal(np.asarray(have.chunks), want["chunks"]):
        judge.add(plan, group, "context gather requests", None, show(want["request_ids"]), show(tuple(have.request_ids)))
        return
    for name in ("starts", "seq_lens", "local_starts", "local_seq_lens"):
        got, expect = np.asarray(getattr(have, name)), want[name]
        bad = np.nonzero(got != expect)[0]
        if len(bad):
            k = int(bad[0])
            field = f"context gather chunk {int(want['chunks'][k])} {name}"
            judge.add(plan, group, field, want["request_ids"][k], str(int(expect[k])), str(int(got[k])))
            return
    for k, slots in enumerate(want["slots"]):
        got = have.slots_of(k)
        if not np.array_equal(got, slots):
            field = f"context gather chunk {int(want['chunks'][k])} slots"
            judge.add(plan, group, field, want["request_ids"][k], show(slots), show(np.asarray(got)))
            return
