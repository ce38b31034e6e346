"""How one interleave size spreads a schedule over the DCP ranks, in one sharded group.

``InterleaveStats`` is fed every step of a run (``GroupStep``: the step's writes, each
rank's write record of each of them, and the local lengths the engine gives each rank)
and sums up, per rank:

* ``stored``: entries (positions, or records of a compressed group) of the requests'
  contexts the rank wrote, each ``(request, index)`` once and below the request's final
  committed length (a shared prefix is stored once, by the request that wrote it);
* ``imbalance``: at each decode step, the max minus the min over ranks of the local
  length summed over the step's decoding requests (the extra keys the slowest rank
  reads), its max and mean over decode steps;
* ``speculative``: on how many ranks the tokens of a speculative step (``1 + k`` query
  tokens of one request) land, the mean and the share of steps on a single rank;
* ``empty_shards``: per rank, the requests whose final context it holds nothing of, and
  the decode writes where some rank's shard was empty (its LSE must be ``-inf``,
  semantics section 6);
* ``fragmentation``: the runs a rank's part of one write falls into (a run: consecutive
  tokens of the write stored at consecutive slots, what one copy can move), the mean runs
  per write and the mean run length.

Pure numpy over plan records; the run itself is ``dcpsim.campaigns.interleave``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.model.plan import ReqWrite, WriteRecord


@dataclass(frozen=True)
class GroupStep:
    """One step of one sharded group."""

    writes: tuple[ReqWrite, ...]
    records: tuple[tuple[WriteRecord, ...], ...]
    """``records[r][k]``: what rank ``r`` wrote for ``writes[k]``."""
    local_lens: np.ndarray
    """``[len(writes), W]``: entries before ``writes[k].stop`` that each rank holds."""


def is_decode(write: ReqWrite) -> bool:
    """One true token (plus any drafts): a decode or speculative step, not a prefill chunk."""
    return len(write.contents) - write.num_drafts == 1


def write_runs(record: WriteRecord) -> int:
    """Runs of consecutive tokens at consecutive slots in one rank's part of a write."""
    n = len(record.slots)
    if n == 0:
        return 0
    breaks = (np.diff(record.index) != 1) | (np.diff(record.slots) != 1)
    return 1 + int(np.count_nonzero(breaks))


def _mean(values) -> float | None:
    return float(np.mean(values)) if len(values) else None


class InterleaveStats:
    def __init__(self, dcp_size: int):
        self.dcp_size = dcp_size
        self._written: dict[tuple[int, int], list[np.ndarray]] = {}
        self._imbalance: list[int] = []
        self._spec_ranks: list[int] = []
        self._empty_decodes = 0
        self._decode_writes = 0
        self._runs = 0
        self._slots = 0
        self._rank_writes = 0

    def add(self, step: GroupStep) -> None:
        W = self.dcp_size
        local = np.asarray(step.local_lens, dtype=np.int64).reshape(len(step.writes), W)
        decode = np.array([is_decode(w) for w in step.writes], dtype=bool)
        if decode.any():
            per_rank = local[decode].sum(axis=0)
            self._imbalance.append(int(per_rank.max() - per_rank.min()))
            self._decode_writes += int(decode.sum())
            self._empty_decodes += int((local[decode] == 0).any(axis=1).sum())
        for k, write in enumerate(step.writes):
            landed = 0
            for r in range(W):
                rec = step.records[r][k]
                if len(rec.slots) == 0:
                    continue
                landed += 1
                self._written.setdefault((r, write.req_index), []).append(np.asarray(rec.index, dtype=np.int64))
                self._runs += write_runs(rec)
                self._slots += len(rec.slots)
                self._rank_writes += 1
            if write.num_drafts:
                self._spec_ranks.append(landed)

    def result(self, final_entries: dict[int, int], final_local: dict[int, np.ndarray]) -> dict:
        """``final_entries[req]``: entries of the request's final committed context;
        ``final_local[req]``: what each rank holds of it (``[W]``)."""
        W = self.dcp_size
        stored = [0] * W
        for (r, req), parts in self._written.items():
            idx = np.unique(np.concatenate(parts))
            stored[r] += int(np.count_nonzero(idx < final_entries.get(req, 0)))
        empty = [sum(int(np.asarray(lens)[r] == 0) for lens in final_local.values()) for r in range(W)]
        spec = self._spec_ranks
        return {
            "stored": stored,
            "stored_spread": max(stored) - min(stored),
            "decode_steps": len(self._imbalance),
            "imbalance_max": max(self._imbalance, default=0),
            "imbalance_mean": _mean(self._imbalance) or 0.0,
            "speculative_steps": len(spec),
            "speculative_ranks_mean": _mean(spec),
            "speculative_one_rank_share": _mean([n == 1 for n in spec]),
            "requests": len(final_local),
            "empty_shards": empty,
            "decode_writes": self._decode_writes,
            "decode_writes_with_empty_shard": self._empty_decodes,
            "rank_writes": self._rank_writes,
            "runs_per_write": self._runs / self._rank_writes if self._rank_writes else None,
            "run_length": self._slots / self._runs if self._runs else None,
        }
