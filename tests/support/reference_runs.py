"""The reference engine's verdicts that the real engines' sweeps compare with, run once per test
process: several sweeps (both vLLM runners, both ``--vllm-scheduler`` modes, SGLang's) compare with
the reference's run of the same built-in at the same W and options, which is a function of them."""

from __future__ import annotations

import hashlib
import pickle

from support.helpers import run

_KEPT: dict[str, object] = {}


def reference_run(scenario, **job):
    """``run(scenario, **job)`` on the reference engine, once per process for the same scenario
    and options (the report is shared: read it, never change it)."""
    key = hashlib.sha256(pickle.dumps((scenario, sorted(job.items())))).hexdigest()
    if key not in _KEPT:
        _KEPT[key] = run(scenario, **job)
    return _KEPT[key]
