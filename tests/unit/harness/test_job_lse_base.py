"""A ``Job`` settles the LSE base its ranks compute and merge in: the configured one, else
the engine's (``Engine.lse_base``), else e; a configured base an engine contradicts is exit
2 naming both."""

from __future__ import annotations

import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.errors import ConfigError
from dcpsim.harness.job import Job
from support.helpers import builtin


class Base2Engine(ReferenceEngine):
    name = "base-2"
    lse_base = "2"


def test_unset_is_e_for_the_reference_and_a_choice_stays():
    s = builtin("dsv3", 2)
    assert Job.from_options(s, attention=True).attention.lse_base == "e"
    assert Job.from_options(s, attention=True, lse_base="2").attention.lse_base == "2"


def test_an_engine_that_fixes_its_base_sets_it_and_refuses_another(monkeypatch):
    monkeypatch.setattr(Job, "build_engine", lambda self: Base2Engine())
    s = builtin("dsv3", 2)
    assert Job.from_options(s, attention=True).attention.lse_base == "2"
    assert Job.from_options(s, attention=True, lse_base="2").attention.lse_base == "2"
    with pytest.raises(ConfigError, match="--lse-base e: the engine under test computes base-2 LSEs"):
        Job.from_options(s, attention=True, lse_base="e")
