"""The checker's judgement of the PCP prefill attention metadata, every step.

Under PCP a prefill row of ``q`` tokens (positions ``start + [0, q)``) is computed in pieces across
the PCP group, and each rank's attention of its pieces reads the row's own keys from the KV its
group all-gathered (the cached context before the row is read through the local lengths, as for
any row). Whatever pieces a rank computes, causality over positions fixes what each reads: the
token at row offset ``o`` attends the row's keys ``[0, o]``, each exactly once. That is derived
here from the row alone; the split itself is judged by the content it writes. A key after the
query is a leak, a key before it missing is a lost key, a key in both of its ranges is read twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.model.plan import PcpQueryKeys, StepPlan
from dcpsim.verify.attention_mask import MaskJudge


@dataclass(frozen=True)
class PcpKeysMismatch:
    rank: int
    step: int
    request_id: str
    query_position: int
    key_position: int | None
    """The first key read wrongly (None: the record's queries are not the row's)."""
    reads: int
    """How often the query reads that key (0, or 2 and more for a key it must read once)."""
    leaks: int
    hidden: int
    shape: str = ""
    group: str = "(PCP prefill)"
    """The split is the row's, the same in every group."""

    def __str__(self) -> str:
        where = f"rank {self.rank} step {self.step} request {self.request_id} (PCP prefill)"
        if self.key_position is None:
            return f"{where}: the PCP attention metadata has {self.shape}"
        if self.key_position > self.query_position:
            what = "sees"
        else:
            what = "does not see" if self.reads == 0 else f"reads {self.reads} times"
        return (
            f"{where}: the query at position {self.query_position} {what} the key at position {self.key_position} "
            f"({self.leaks} later key(s) shown, {self.hidden} earlier key(s) hidden over the row's wrong queries)"
        )


def judge_pcp_keys(judge: MaskJudge, plan: StepPlan, records: list[PcpQueryKeys]) -> None:
    """Judge every split row's PCP attention metadata of the step into ``judge`` (its count
    and kept mismatches, failure ``attention-mask``)."""
    for rec in records:
        judge.checks += 1
        mismatch = _row_mismatch(judge.rank, plan.step, rec)
        if mismatch is not None:
            judge.add(mismatch)


def _row_mismatch(rank: int, step: int, rec: PcpQueryKeys) -> PcpKeysMismatch | None:
    q, spans = np.asarray(rec.queries, np.int64), np.asarray(rec.spans, np.int64).reshape(-1, 4)
    if len(q) != len(spans) or (len(q) and (q.min() < 0 or q.max() >= rec.query_len)):
        shape = f"{len(q)} queries with {len(spans)} key ranges, offsets outside the row of {rec.query_len}"
        return PcpKeysMismatch(rank, step, rec.request_id, rec.start, None, 0, 0, 0, shape)
    lo0, hi0, lo1, hi1 = spans.T
    first, second = hi0 > lo0, hi1 > lo1
    both = first & second
    right = np.where(
        both,
        (lo0 == 0) & (hi0 == lo1) & (hi1 == q + 1),
        np.where(first, (lo0 == 0) & (hi0 == q + 1), second & (lo1 == 0) & (hi1 == q + 1)),
    )
    if right.all():
        return None
    bad = np.flatnonzero(~right)
    leaks = hidden = 0
    key = reads = None
    for j in bad:  # count over the row; name the first wrong key of the first wrong query
        seen = np.zeros(max(rec.query_len, int(spans[j].max(initial=0))) + 1, np.int64)
        for lo, hi in ((lo0[j], hi0[j]), (lo1[j], hi1[j])):
            if hi > lo:
                seen[max(lo, 0) : hi] += 1
        want = np.arange(len(seen)) <= q[j]
        wrong = np.flatnonzero(seen != want.astype(np.int64))
        leaks += int(((seen > 0) & ~want).sum())
        hidden += int(((seen == 0) & want).sum())
        if key is None and len(wrong):
            key, reads = int(wrong[0]), int(seen[wrong[0]])
    o = int(q[bad[0]])
    return PcpKeysMismatch(rank, step, rec.request_id, rec.start + o, rec.start + (key or 0), reads or 0, leaks, hidden)
