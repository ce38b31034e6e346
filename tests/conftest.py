"""Shared fixtures: the helpers of ``tests/helpers.py`` (import them directly where a
module-level use, such as ``parametrize``, needs them)."""

from __future__ import annotations

import pytest

import helpers


@pytest.fixture
def builtin():
    return helpers.builtin


@pytest.fixture
def run():
    return helpers.run


@pytest.fixture
def run_json(capsys):
    return lambda *argv: helpers.run_json(capsys, *argv)
