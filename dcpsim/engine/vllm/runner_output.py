"""What dcpsim's model runner outputs for vLLM's scheduler (``--vllm-scheduler full``):
what one step of a scheduled request writes, and the tokens it samples.

vLLM's ``SchedulerOutput`` says where a request's step starts (its ``num_computed_tokens``),
how many tokens it runs (``num_scheduled_tokens``) and how many of them are drafts
(``scheduled_spec_decode_tokens``). What the model computes there is the scenario's:

* a position the request has a token for (prompt, or sampled output) gets that token's
  fingerprint; a scheduled position it has no token for yet gets the KV of a token that is
  no token of the scenario (``NO_TOKEN``: what a model runner reads from a slot nothing filled);
* a step that reaches the request's last token samples: its drafts are verified by the
  scenario's acceptance pattern (the first ``accepted`` true, the next one wrong:
  ``Request.draft_contents``; vLLM's ``-1`` padding drafts of a resumed request are never
  accepted), and the accepted drafts plus one more true token are the
  sampled tokens handed back to vLLM (never more than the request's output has left);
* the request's committed length becomes the step's end less its rejected drafts: the
  positions vLLM's worker now holds as computed. The checker compares every committed
  position with the scenario's fingerprint at the rank and slot its own arithmetic gives,
  so a schedule that skips positions, runs past the request's tokens or keeps rejected
  drafts leaves the wrong content where the checker reads.
"""

from __future__ import annotations

import numpy as np

from dcpsim.engine.interface import EngineError
from dcpsim.engine.scheduler.request import Request
from dcpsim.model.content import extend_fingerprints
from dcpsim.model.plan import EventKind, ReqWrite, ScheduleEvent

NO_TOKEN = 0
"""A token id no scenario draws (``random_tokens`` draws from 1 on)."""
SCHEDULE = "vllm.v1.core.sched.scheduler.Scheduler.schedule"


def run(req: Request, start: int, n: int, drafts: list[int], step: int, events: list[ScheduleEvent]) -> tuple[ReqWrite, list[int]]:
    """The write of ``req``'s step (``n`` tokens from ``start``, the last ``len(drafts)``
    of them the draft token ids vLLM scheduled) and the token ids it samples; advances ``req``."""
    num_drafts = len(drafts)
    own_end = start + n - num_drafts
    if num_drafts > n:
        _refuse(req, f"scheduled {n} tokens from position {start} with {num_drafts} drafts: more drafts than tokens")
    if own_end > len(req.tokens):
        _refuse(req, f"scheduled {n} tokens from position {start} with {num_drafts} drafts: past the request's {len(req.tokens)} tokens")
    known = req.num_known
    parts = [req.fingerprints[start : min(own_end, known)]]
    if own_end > known:
        parts.append(no_token(req, max(start, known), own_end))
    accepted, tokens = 0, []
    if own_end >= known:  # the step reaches the request's last token: it samples
        real = _real_drafts(req, drafts) if own_end == known else 0
        if real:
            accepted = req.next_acceptance(real)
            parts.append(req.draft_contents(known, real, accepted, step))
            events.append(ScheduleEvent(EventKind.VERIFIED, req.request_id, drafts=num_drafts, accepted=accepted))
        parts.append(no_token(req, own_end + real, own_end + num_drafts))  # never accepted
        out = min(accepted + 1, req.remaining_output)
        tokens = [int(t) for t in req.tokens[known : known + out]]
        req.num_output += out
    else:  # a prefill chunk: drafts on it are never verified
        parts.append(no_token(req, own_end, own_end + num_drafts))
    req.num_computed = own_end + accepted
    contents = np.concatenate(parts).astype(np.int64, copy=False)
    prefill = n - num_drafts > 1 or start < req.spec.prompt_len
    return ReqWrite(req.index, req.request_id, start, contents, num_drafts=num_drafts, prefill=prefill), tokens


def _real_drafts(req: Request, drafts: list[int]) -> int:
    """How many leading drafts are the drafter's (vLLM pads a resumed request's step with
    ``-1``, which no model accepts), within the request's tokens."""
    real = next((j for j, t in enumerate(drafts) if t < 0), len(drafts))
    return max(0, min(real, len(req.tokens) - req.num_known))


def no_token(req: Request, start: int, stop: int) -> np.ndarray:
    """Fingerprints of ``NO_TOKEN`` at ``[start, stop)`` after the request's true prefix
    (past the request's last token: after its whole stream)."""
    before = int(req.raw_hash[min(start, len(req.tokens)) - 1]) if start > 0 else 0
    return extend_fingerprints(before, [NO_TOKEN] * (stop - start))


def _refuse(req: Request, what: str) -> None:
    raise EngineError(what=SCHEDULE, function=SCHEDULE, file="", line=0, message=f"vLLM's scheduler {what} ({req.request_id!r})")
