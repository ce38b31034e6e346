"""The suite keeps Python's bytecode for itself and every process it starts, even where
``PYTHONDONTWRITEBYTECODE`` is set (``tests/conftest.py``; docs/testing.md): otherwise each
xdist worker, forkserver and subprocess compiles the modules it imports anew."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_suite_and_its_subprocesses_write_bytecode():
    assert not sys.dont_write_bytecode
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
    child = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.flags.dont_write_bytecode, sys.dont_write_bytecode)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.stdout.split() == ["0", "False"], child.stdout + child.stderr
