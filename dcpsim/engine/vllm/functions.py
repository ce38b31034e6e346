"""vLLM's functions as the adapter finds and calls them: looked up in the loaded modules with
their signatures checked (``lookup``: a missing function or a changed signature is exit 2
naming the file), and called so that an exception inside vLLM's code is a ``VllmCallError``
naming the function (``call``; the harness turns it into exit 3 naming the rank)."""

from __future__ import annotations

import inspect

from dcpsim.engine.loading.placeholders import is_placeholder
from dcpsim.engine.vllm.loader import INTERPRETER_LOCK, SourceTree
from dcpsim.engine.vllm.releases import VLLM_RELEASES
from dcpsim.errors import ConfigError


class VllmCallError(RuntimeError):
    """vLLM's code raised inside a rank."""


def arg_names(fn) -> tuple[str, ...]:
    names = getattr(fn, "arg_names", None)
    if names is None:
        target = getattr(fn, "fn", fn)
        names = list(inspect.signature(target).parameters)
    return tuple(names)


def where(tree: SourceTree, module: str, qualname: str, what: str) -> str:
    """``qualname`` of ``module`` in ``tree`` ``what`` (a message naming the file and the versions supported)."""
    file = tree.root / (module.replace(".", "/") + ".py")
    return f"vLLM {tree.version} at {tree.root}: {qualname} in {file} {what}; dcpsim knows vLLM {VLLM_RELEASES[0]}..{VLLM_RELEASES[-1]}"


def lookup(tree: SourceTree, mods: dict, module: str, qualname: str, args: tuple[str, ...]):
    """``module.qualname`` of the loaded ``mods``, its first parameters ``args``, else ``ConfigError``."""
    obj = mods[module]
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None or is_placeholder(obj):
            raise ConfigError(where(tree, module, qualname, "is missing"))
    have = arg_names(obj)
    if tuple(have[: len(args)]) != args:
        raise ConfigError(where(tree, module, qualname, f"has the signature ({', '.join(have)}), expected ({', '.join(args)})"))
    return obj


def call(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (one kernel at a time in a process: ``INTERPRETER_LOCK``); an
    exception a ``VllmCallError`` naming ``what``."""
    try:
        with INTERPRETER_LOCK:
            return fn(*args, **kwargs)
    except Exception as exc:  # reported with the function's name
        raise VllmCallError(f"vLLM {what} raised {type(exc).__name__}: {exc}") from exc
