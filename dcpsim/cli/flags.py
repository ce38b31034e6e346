"""Flags generated from an option tree (``dcpsim.options``), and the tree built back from
the parsed flags: a default and its help live once, on the dataclass field.

``add_flags(parser, Job, only=...)`` adds ``--KEY-WITH-DASHES`` (and the leaf's aliases) for
each leaf a command takes, ``dest`` the leaf's key; ``options_from(Job, args, scenario=sc)``
builds the tree from the flags the command has (the others keep their defaults). Nothing
below ``dcpsim.cli`` sees an argparse namespace.
"""

from __future__ import annotations

import argparse

from dcpsim.options import Leaf, flatten, from_flat, leaves


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    tree,
    *,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
    defaults: dict | None = None,
) -> None:
    """A flag for each command-line leaf of ``tree`` (those of ``only`` if given, in the
    tree's order, without ``skip``); ``defaults`` replaces a leaf's default for this command
    (``replay --verify`` defaults to the recorded mode)."""
    for leaf in leaves(tree):
        if not leaf.meta["cli"] or leaf.key in skip or (only is not None and leaf.key not in only):
            continue
        default = (defaults or {}).get(leaf.key, leaf.default)
        parser.add_argument(leaf.flag, *leaf.meta["aliases"], dest=leaf.key, help=leaf.help, default=default, **_kind(leaf))


def _kind(leaf: Leaf) -> dict:
    if leaf.base_type is bool:
        return dict(action="store_true")
    kind = dict(type=leaf.base_type)
    if leaf.meta["metavar"]:
        kind["metavar"] = leaf.meta["metavar"]
    if leaf.meta["choices"]:
        kind["choices"] = tuple(leaf.meta["choices"])
    return kind


def options_from(tree, args: argparse.Namespace, **fields):
    """``tree`` (the class) built from the parsed flags of its leaves that ``args`` holds;
    ``fields``: the root's own fields (a ``Job``'s scenario)."""
    return from_flat(tree, flag_values(tree, args), **fields)


def flag_values(tree, args: argparse.Namespace) -> dict:
    """``{key: value}`` of the leaves of ``tree`` that the command's flags set."""
    return {leaf.key: getattr(args, leaf.key) for leaf in leaves(tree) if leaf.meta["cli"] and hasattr(args, leaf.key)}


def flag_args(obj) -> list[str]:
    """The flags that rebuild ``obj`` (a tree's value): each command-line leaf whose value
    is not its default (``--vllm-merge reference``, a bool leaf as its bare flag)."""
    out: list[str] = []
    values = flatten(obj)
    for leaf in leaves(type(obj)):
        value = values[leaf.key]
        if not leaf.meta["cli"] or value == leaf.default:
            continue
        out += [leaf.flag] if leaf.base_type is bool else [leaf.flag, str(value)]
    return out
