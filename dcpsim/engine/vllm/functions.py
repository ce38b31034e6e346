"""vLLM's functions as the adapter calls them: an exception inside vLLM's code is a
``VllmCallError`` naming the function (``call``; the harness turns it into exit 3 naming the
rank). Finding them in the loaded modules, their signatures checked, is
``dcpsim.engine.loading.bindings.resolve`` (with ``KNOWN`` in its messages); ``where`` names a
spec class's file for the spec classes' own messages."""

from __future__ import annotations

from dcpsim.engine.vllm.loader import INTERPRETER_LOCK, SourceTree
from dcpsim.engine.vllm.releases import VLLM_RELEASES


class VllmCallError(RuntimeError):
    """vLLM's code raised inside a rank."""


KNOWN = f"dcpsim knows vLLM {VLLM_RELEASES[0]}..{VLLM_RELEASES[-1]}"
"""The releases the adapter knows, as messages say it."""


def where(tree: SourceTree, module: str, qualname: str, what: str) -> str:
    """``qualname`` of ``module`` in ``tree`` ``what`` (a message naming the file and the versions supported)."""
    file = tree.root / (module.replace(".", "/") + ".py")
    return f"vLLM {tree.version} at {tree.root}: {qualname} in {file} {what}; {KNOWN}"


def call(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (one kernel at a time in a process: ``INTERPRETER_LOCK``); an
    exception a ``VllmCallError`` naming ``what``."""
    with INTERPRETER_LOCK:
        return call_unlocked(what, fn, *args, **kwargs)


def call_unlocked(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` without the interpreter lock, for plain torch code that runs a
    collective (ranks that are threads must all enter it, so none may hold the lock there); an
    exception a ``VllmCallError`` naming ``what``."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # reported with the function's name
        raise VllmCallError(f"vLLM {what} raised {type(exc).__name__}: {exc}") from exc
