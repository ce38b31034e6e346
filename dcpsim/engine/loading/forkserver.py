"""Objects built once in the ranks' forkserver, before it forks them, so every rank inherits
them instead of building its own: the engines whose source trees a world's jobs load (a vLLM
or SGLang tree costs about 0.3 s of CPU per process to load).

Engine-neutral: the caller names builders (``"MODULE:FUNCTION"`` with keyword arguments, say
``dcpsim.engine.choice:build_choice`` with an engine's options) in ``$DCPSIM_PRELOAD_BUILDS``
(``ask``) before the forkserver starts; the forkserver's ``dcpsim.engine.loading.preload`` calls
each (``run_asked``), and a builder that caches its result per process (``build_engine`` does)
hands the ranks the prebuilt object. Best effort: the forkserver starts once per process, with
the environment of that moment, so a later world that asks for another build, or a build that
fails there, costs each rank its own build (which then reports any error), never a wrong
object: the builder's cache is keyed by every option.

Light on purpose (no torch, no Triton): the command line asks before it imports them.
"""

from __future__ import annotations

import importlib
import json
import os

PRELOAD_ENV = "DCPSIM_PRELOAD_BUILDS"


def ask(builds: list[tuple[str, dict]]) -> None:
    """Ask the forkserver (if it has not started yet) to call each ``(builder, kwargs)`` too,
    besides what was asked before."""
    entries = [[builder, kwargs] for builder, kwargs in [*asked(), *builds]]
    unique = [e for k, e in enumerate(entries) if e not in entries[:k]]
    os.environ[PRELOAD_ENV] = json.dumps(unique)


def asked() -> list[tuple[str, dict]]:
    try:
        return [(builder, kwargs) for builder, kwargs in json.loads(os.environ.get(PRELOAD_ENV) or "[]")]
    except (ValueError, TypeError):
        return []


def run_asked() -> int:
    """Call every build asked for; how many succeeded. A failure is left to the ranks: each
    then builds for itself and reports what is wrong with the run's own words."""
    done = 0
    for builder, kwargs in asked():
        module, _, name = builder.partition(":")
        try:
            getattr(importlib.import_module(module), name)(**kwargs)
        except Exception:  # best effort: the rank's own build reports it
            continue
        done += 1
    return done
