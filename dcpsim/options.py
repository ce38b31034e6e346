"""Option trees: frozen dataclasses whose fields carry their default, their help and their
run-option name in one place.

An option is a field made by ``option(default, help, ...)``. A field whose type is itself
an option dataclass is a branch (``Job.attention`` is an ``AttentionConfig``). Each leaf has
a *key*, its name among the flat run options (``attention_heads`` for
``Job.attention.heads``): keys are unique in a tree, and they are what a replay record, a
fault's ``configs`` and ``Job.from_options`` use. The command line is generated from the
leaves (``dcpsim.cli.flags``): ``--`` + the key with dashes, plus the leaf's aliases.

Example::

    @dataclass(frozen=True)
    class WorldOptions:
        timeout: float = option(30.0, "process-group timeout in seconds", metavar="S")

    leaves(WorldOptions)[0].flag          # '--timeout'
    from_flat(WorldOptions, {"timeout": 5.0}).timeout   # 5.0
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass

from dcpsim.errors import ConfigError


def option(
    default,
    help: str,  # argparse's word
    *,
    key: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    choices: tuple | None = None,
    cli: bool = True,
) -> typing.Any:
    """A leaf of an option tree: ``default`` and ``help`` once. ``key``: its run-option name
    (default: the field's name); ``aliases``: extra flags (``--dcp``); ``cli``: False for an
    option no flag sets (a replay record or a fault's config still may)."""
    meta = dict(help=help, key=key, aliases=tuple(aliases), metavar=metavar, choices=choices, cli=cli)
    return dataclasses.field(default=default, metadata={"option": meta})


def branch(cls) -> typing.Any:
    """A field holding a whole option dataclass, ``cls()`` by default."""
    return dataclasses.field(default_factory=cls)


@dataclass(frozen=True)
class Leaf:
    """One option of a tree: where it sits (``path``), its run-option ``key`` and its field."""

    path: tuple[str, ...]
    key: str
    field: dataclasses.Field
    type: object
    """The field's type (``int | None`` and the like, resolved)."""

    @property
    def meta(self) -> dict:
        return self.field.metadata["option"]

    @property
    def help(self) -> str:
        return self.meta["help"]

    @property
    def default(self):
        return self.field.default

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def base_type(self) -> type:
        """``int`` for ``int | None``; the type itself otherwise."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        return args[0] if args else self.type


def is_tree(cls) -> bool:
    """An option dataclass: one with at least one ``option`` field or branch."""
    return dataclasses.is_dataclass(cls) and isinstance(cls, type) and bool(_children(cls))


@functools.cache
def _children(cls) -> tuple[tuple[dataclasses.Field, object], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if "option" in f.metadata or (isinstance(kind, type) and dataclasses.is_dataclass(kind) and _children(kind)):
            out.append((f, kind))
    return tuple(out)


@functools.cache
def leaves(cls) -> tuple[Leaf, ...]:
    """Every leaf of the tree rooted at ``cls``, depth first in field order."""
    out: list[Leaf] = []
    for f, kind in _children(cls):
        if "option" in f.metadata:
            out.append(Leaf((f.name,), f.metadata["option"]["key"] or f.name, f, kind))
        else:
            out += [dataclasses.replace(leaf, path=(f.name, *leaf.path)) for leaf in leaves(kind)]
    keys = [leaf.key for leaf in out]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    assert not dupes, f"{cls.__name__}: run-option keys used twice: {dupes}"
    return tuple(out)


def keys(cls) -> tuple[str, ...]:
    return tuple(leaf.key for leaf in leaves(cls))


def flatten(obj) -> dict[str, object]:
    """``{key: value}`` of every leaf of ``obj``."""
    out = {}
    for leaf in leaves(type(obj)):
        value = obj
        for name in leaf.path:
            value = getattr(value, name)
        out[leaf.key] = value
    return out


def replace_flat(obj, values: dict):
    """``obj`` with the leaves named by ``values``' keys replaced (``ConfigError`` for a key
    the tree does not have)."""
    by_key = {leaf.key: leaf for leaf in leaves(type(obj))}
    unknown = sorted(set(values) - set(by_key))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(map(repr, unknown))}; known: {', '.join(by_key)}")
    nested: dict = {}
    for key, value in values.items():
        node = nested
        *parents, name = by_key[key].path
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = value
    return _replace(obj, nested)


def _replace(obj, nested: dict):
    changes = {name: _replace(getattr(obj, name), value) if isinstance(value, dict) else value for name, value in nested.items()}
    return dataclasses.replace(obj, **changes) if changes else obj


def from_flat(cls, values: dict, **fields):
    """``cls(**fields)`` with the leaves named by ``values``' keys set, each object of the
    tree built once (so each validates once, as it ends up); ``fields`` are the root's own
    non-option fields (a ``Job``'s scenario). ``ConfigError`` for an unknown key."""
    by_key = {leaf.key: leaf for leaf in leaves(cls)}
    unknown = sorted(set(values) - set(by_key))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(map(repr, unknown))}; known: {', '.join(by_key)}")
    return _build(cls, {by_key[k].path: v for k, v in values.items()}, fields)


def _build(cls, by_path: dict, fields: dict):
    kwargs = dict(fields)
    for f, kind in _children(cls):
        if (f.name,) in by_path:
            kwargs[f.name] = by_path[(f.name,)]
        elif "option" not in f.metadata:
            inner = {path[1:]: v for path, v in by_path.items() if path[0] == f.name}
            if inner:
                kwargs[f.name] = _build(kind, inner, {})
    return cls(**kwargs)
