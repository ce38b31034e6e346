"""Automatic stubs: the modules of a source tree that the loaded code imports but dcpsim does
not run. Every name in one is a placeholder that can be called, subclassed, decorated with
and tested for truth (always false), so import-time code runs; using one for real fails
loudly."""

from __future__ import annotations

import types


class Placeholder:
    """What an automatic stub hands out for every name (see the module docstring)."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator: keep the function
        return Placeholder(f"{self._name}(...)")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._name}.{name}")

    def __getitem__(self, key):
        return Placeholder(f"{self._name}[...]")

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):  # type annotations such as ``Stub | None``
        return Placeholder(f"{self._name} | ...")

    __ror__ = __or__

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        return iter(())

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


def is_placeholder(obj) -> bool:
    return isinstance(obj, Placeholder)


class StubModule(types.ModuleType):
    """A module of placeholders; a package one still imports its real submodules
    (``tree.exists``: whether the source tree has a module of that name)."""

    def __init__(self, name: str, tree):
        super().__init__(name)
        self.__dcpsim_stub__ = True
        self._tree = tree

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if self._tree is not None and self._tree.exists(f"{self.__name__}.{name}"):
            raise AttributeError(name)  # a submodule: let the import system load it
        return Placeholder(f"{self.__name__}.{name}")
