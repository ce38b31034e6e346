"""The ranks never run the caller's ``__main__``.

A process that multiprocessing starts re-creates its parent's main module before it unpickles
its target (``multiprocessing.spawn.prepare``): a script is run again from its path as
``__mp_main__``, a module run with ``-m`` is imported again by name. dcpsim's ranks need none
of it (their code and payload are dcpsim's own), and it breaks the Python API where people use
it most: a script that calls ``dcpsim.run`` at its top level, with no ``if __name__ ==
"__main__":`` guard, would start a world again from every rank, and a script read from
standard input (``python - < check.py``) has no file to run again at all.

``starting_ranks()`` marks, for the calling thread, the processes it starts (and the
forkserver it may start) as ranks: their preparation data leaves the main module out, so they
start from dcpsim's code alone, wherever the caller runs (a script, standard input, a
notebook, ``python -c``, ``python -m``). Other threads, and processes the caller starts itself,
keep multiprocessing's behaviour. What the ranks then cannot have, an object of their payload
or a plugin engine defined in the caller's ``__main__``, is a ``ConfigError`` that names it
(``check_payload``, ``check_plugins``) before any rank starts.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from multiprocessing import spawn

from dcpsim.errors import ConfigError

MAIN_KEYS = ("init_main_from_path", "init_main_from_name", "main_path")
"""The preparation-data keys that make a new process re-create its parent's main module."""

_state = threading.local()
_install_lock = threading.Lock()
_original = None


def _preparation_data(name):
    data = _original(name)
    if getattr(_state, "starting", False):
        for key in MAIN_KEYS:
            data.pop(key, None)
    return data


def _install() -> None:
    global _original
    with _install_lock:
        if _original is None:
            _original = spawn.get_preparation_data
            spawn.get_preparation_data = _preparation_data


@contextlib.contextmanager
def starting_ranks():
    """While in this block, the processes this thread starts through multiprocessing do not
    re-create the caller's main module."""
    _install()
    before = getattr(_state, "starting", False)
    _state.starting = True
    try:
        yield
    finally:
        _state.starting = before


class _Found(Exception):
    """Raised by ``_MainFinder`` at the first object of ``__main__``: nothing more to pickle."""

    def __init__(self, owner) -> None:
        super().__init__()
        self.owner = owner


class _MainFinder(pickle.Pickler):
    """Pickles to nowhere and stops at the first object whose class, or which itself, is
    defined in ``__main__``."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj):
        owner = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
        if getattr(owner, "__module__", None) == "__main__":
            raise _Found(owner)
        return NotImplemented


def check_payload(payload, pickled: bytes) -> None:
    """A ``ConfigError`` if ranks could not unpickle ``payload`` (``pickled``) for want of
    the caller's ``__main__``."""
    found = main_object(payload, pickled)
    if found is not None:
        raise ConfigError(f"the ranks cannot have {found}: {REMEDY}")


def check_plugins(engine_names) -> None:
    """A ``ConfigError`` if one of ``engine_names`` is a plugin in the caller's ``__main__``."""
    found = main_plugin(engine_names)
    if found is not None:
        raise ConfigError(f"--engine {found}: {REMEDY}")


def main_object(payload, pickled: bytes) -> str | None:
    """What of ``payload`` (``pickled`` its pickle) is defined in the caller's ``__main__``,
    as ``__main__.NAME``, or None. The pickle is searched first, so a payload that never
    names ``__main__`` costs one bytes search."""
    if b"__main__" not in pickled:
        return None
    try:
        _MainFinder().dump(payload)
    except _Found as found:
        return f"__main__.{getattr(found.owner, '__qualname__', type(found.owner).__name__)}"
    return None


def main_plugin(engine_names) -> str | None:
    """The first ``__main__:ATTR`` among ``engine_names`` (a plugin the ranks would have to
    import from the caller's script), or None."""
    return next((n for n in engine_names if isinstance(n, str) and n.partition(":")[0] == "__main__"), None)


REMEDY = (
    "the ranks are fresh processes that never run the calling script, so define it in a module they can "
    "import (and name it MODULE:ATTR), or run the ranks as threads (in_process=True, --in-process)"
)
