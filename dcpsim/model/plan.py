"""The records the two sides exchange: a step's plan (scheduler -> ranks -> checker) and
the write log a rank keeps of what it wrote (worker -> checker).

Plain data, identical on every rank for the plan; no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ReqWrite:
    """Positions ``[start, start + len(contents))`` of a request get KV this step."""

    req_index: int
    request_id: str
    start: int
    contents: np.ndarray  # int64 fingerprint per written position (drafts included)
    num_drafts: int = 0
    """The last ``num_drafts`` written positions are speculative drafts."""

    @property
    def stop(self) -> int:
        return self.start + len(self.contents)


@dataclass(frozen=True)
class RequestView:
    """A live request after the step: what its KV must hold now."""

    req_index: int
    request_id: str
    num_committed: int
    fingerprints: np.ndarray  # true fingerprint of every position of the request


@dataclass(frozen=True)
class StepPlan:
    step: int
    writes: tuple[ReqWrite, ...]
    rows_before: tuple[dict[int, np.ndarray], ...]
    """Per group: block-table row of every request holding blocks during the step."""
    views: tuple[RequestView, ...]
    rows_after: tuple[dict[int, np.ndarray], ...]
    """Per group: rows after the step's releases (what attention reads next)."""
    events: tuple[str, ...] = field(default_factory=tuple)
    last: bool = False


@dataclass(frozen=True)
class WriteRecord:
    """One write the worker made into a KV store during a step (its change record).

    ``slots`` are every slot the write path produced for this rank (``PAD`` removed),
    including slots outside the store, which the store itself refuses to write;
    ``index[i]`` is the position, record or ring state the worker stored at ``slots[i]``.
    """

    group: int
    req_index: int
    request_id: str
    slots: np.ndarray
    index: np.ndarray


@dataclass
class AttentionResult:
    """One (group, request) of a step's attention on one rank, as the engine reports it.

    ``out [len(rows), head1 - head0, dv]`` and ``lse [len(rows), head1 - head0]`` hold the
    heads ``[head0, head1)`` of query tokens ``write.start + rows``: after the merge across
    ranks for a sharded group (``merged``), or as this rank computed them (replicated).
    ``visible[j]`` counts the keys token ``rows[j]`` saw in this rank's shard, and
    ``shard_lse`` (heads ``[shard_head0, ...)``) is the LSE this rank reported to the merge:
    diagnostics for a failure report.
    """

    group: int
    write: ReqWrite
    rows: np.ndarray
    merged: bool
    out: object
    lse: object
    head0: int
    head1: int
    visible: np.ndarray
    shard_lse: object
    shard_head0: int
