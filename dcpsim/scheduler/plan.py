"""One step's decisions as plain data, identical on every rank."""

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
