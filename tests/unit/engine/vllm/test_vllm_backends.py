"""``dcpsim.engine.vllm.backends`` reads a backend's LSE base from a source tree's text:
through the registry's enum, ``get_impl_cls`` (its own or a base's), the implementation's
bases across modules, and a base bound into a combine ``partial``; a backend that does not
support DCP, or is not in the enum, is a ``ConfigError`` naming it."""

from __future__ import annotations

import textwrap

import pytest

from dcpsim.engine.vllm.backends import backend_names, read_backend
from dcpsim.errors import ConfigError

FILES = {
    "vllm/v1/attention/backends/registry.py": """
        from enum import Enum
        class AttentionBackendEnum(Enum):
            BASE_E = "vllm.b.plain.PlainBackend"
            BASE_2 = (
                "vllm.b.fast."
                "FastBackend"
            )
            BOUND = "vllm.b.bound.BoundBackend"
            NO_DCP = "vllm.b.plain.NoDcpBackend"
            INHERITS = "vllm.b.fast.ChildBackend"
            EMPTY = ""
        """,
    "vllm/v1/attention/backend.py": """
        class AttentionImplBase:
            supports_dcp: bool = False
            lse_base_on_e: bool = True
        """,
    "vllm/b/plain.py": """
        from vllm.v1.attention.backend import AttentionImplBase
        class PlainImpl(AttentionImplBase[int]):
            supports_dcp: bool = True
        class PlainBackend:
            @staticmethod
            def get_impl_cls():
                return PlainImpl
        class NoDcpBackend:
            @staticmethod
            def get_impl_cls():
                return AttentionImplBase
        """,
    "vllm/b/fast.py": """
        from vllm.b.plain import PlainImpl, PlainBackend
        class FastImpl(PlainImpl):
            lse_base_on_e = False
        class FastBackend(PlainBackend):
            @staticmethod
            def get_impl_cls():
                return FastImpl
        class ChildBackend(FastBackend):
            pass
        """,
    "vllm/b/bound.py": """
        from functools import partial
        from vllm.b.plain import PlainImpl
        class BoundImpl(PlainImpl):
            def __init__(self):
                self.combine = partial(print, is_lse_base_on_e=False)
        class BoundBackend:
            def get_impl_cls():
                return BoundImpl
        """,
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-tree")
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text), encoding="utf-8")
    return str(root)


def test_the_base_is_read_along_the_bases(tree):
    plain = read_backend(tree, "BASE_E")
    assert (plain.lse_base, plain.impl_class, plain.where) == ("e", "vllm.b.plain.PlainImpl", "vllm/v1/attention/backend.py:4")
    fast = read_backend(tree, "BASE_2")
    assert (fast.lse_base, fast.where) == ("2", "vllm/b/fast.py:4")
    assert read_backend(tree, "INHERITS").impl_class == "vllm.b.fast.FastImpl"  # get_impl_cls of a base


def test_a_base_bound_into_the_combine_wins(tree):
    bound = read_backend(tree, "BOUND")
    assert bound.lse_base == "2" and "binds is_lse_base_on_e" in bound.where and bound.where.startswith("vllm/b/bound.py:6")


def test_backends_that_cannot_run_dcp_are_named(tree):
    assert backend_names(tree) == ["BASE_2", "BASE_E", "BOUND", "INHERITS", "NO_DCP"]
    with pytest.raises(ConfigError, match="NO_DCP: vllm.v1.attention.backend.AttentionImplBase does not support DCP"):
        read_backend(tree, "NO_DCP")
    with pytest.raises(ConfigError, match=r"MISSING: not in AttentionBackendEnum .*valid: BASE_2, BASE_E"):
        read_backend(tree, "MISSING")
