"""A request's token stream and scheduling state."""

from __future__ import annotations

import enum
import functools

import numpy as np

from dcpsim.model.content import (
    VOCAB,
    extend_fingerprints,
    prefix_fingerprints,
    random_tokens,
    raw_prefix_hash,
    stable_seed,
)
from dcpsim.model.scenario import RequestSpec
from dcpsim.model.shared_streams import Streams, shared_streams


class Status(enum.Enum):
    PENDING = "pending"  # not yet arrived
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """``tokens`` holds the prompt and the true output tokens the model will emit.

    ``num_computed`` positions have committed KV; ``num_known`` tokens exist
    (prompt plus sampled output). A decoding request has
    ``num_known == num_computed + 1``.
    """

    def __init__(self, index: int, spec: RequestSpec, seed: int, prefix_tokens: np.ndarray | None):
        self.index = index
        self.spec = spec
        self._seed = seed
        self._prefix_tokens = prefix_tokens
        self.status = Status.PENDING
        self.num_computed = 0
        self.num_output = 0
        self.num_preemptions = 0
        self._accept_cursor = 0

    # The token stream is drawn on first use: a scheduler built only to validate a
    # configuration (every cell of the full matrix) never pays for it.

    @functools.cached_property
    def _shared(self) -> Streams | None:
        """The streams the launcher drew and hashed once for the world, if it shares this
        request's (``model.shared_streams``: the same arrays, mapped read-only)."""
        return shared_streams(self._seed, self.spec)

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        if self._shared is not None:
            return self._shared.tokens
        spec = self.spec
        own = random_tokens(
            stable_seed(self._seed, "request", spec.request_id),
            spec.prompt_len - spec.shared_prefix_len + spec.output_len,
        )
        shared = self._prefix_tokens[: spec.shared_prefix_len] if self._prefix_tokens is not None else own[:0]
        return np.concatenate([shared, own])

    @functools.cached_property
    def raw_hash(self) -> np.ndarray:
        return self._shared.raw if self._shared is not None else raw_prefix_hash(self.tokens)

    @functools.cached_property
    def fingerprints(self) -> np.ndarray:
        return self._shared.fingerprints if self._shared is not None else prefix_fingerprints(self.tokens, self.raw_hash)

    @functools.cached_property
    def _accept_rng(self) -> np.random.Generator:
        return np.random.default_rng(stable_seed(self._seed, "accept", self.spec.request_id))

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_known(self) -> int:
        return self.spec.prompt_len + self.num_output

    @property
    def remaining_output(self) -> int:
        return self.spec.output_len - self.num_output

    def next_acceptance(self, num_drafts: int) -> int:
        """How many of ``num_drafts`` drafts this speculative step accepts."""
        if self.spec.acceptance:
            a = self.spec.acceptance[self._accept_cursor % len(self.spec.acceptance)]
        else:
            a = int(self._accept_rng.integers(0, num_drafts + 1))
        self._accept_cursor += 1
        return min(a, num_drafts)

    def draft_contents(self, start: int, num_drafts: int, accepted: int, step: int) -> np.ndarray:
        """Fingerprints written for drafts at ``[start, start + num_drafts)``.

        The first ``accepted`` drafts are the true tokens; the next one is a
        wrong token (so its KV and every later draft's differ from what will
        eventually be committed there).
        """
        true = self.fingerprints[start : start + num_drafts].copy()
        if accepted >= num_drafts:
            return true
        q = start + accepted
        wrong = 1 + (int(self.tokens[q]) + step % (VOCAB - 2)) % (VOCAB - 1)
        drafted = self.tokens[q : start + num_drafts].copy()
        drafted[0] = wrong
        raw_before = int(self.raw_hash[q - 1]) if q > 0 else 0
        true[accepted:] = extend_fingerprints(raw_before, drafted)
        return true
