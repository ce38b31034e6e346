"""Fetch vLLM's source: ``dcpsim.engine.loading.fetch`` with vLLM's default requirement."""

from __future__ import annotations

import os
from pathlib import Path

from dcpsim.engine.loading import fetch as _fetch
from dcpsim.engine.loading.fetch import default_dest

__all__ = ["DEFAULT_REQUIREMENT", "default_dest", "fetch"]

DEFAULT_REQUIREMENT = _fetch.PACKAGES["vllm"]


def fetch(requirement: str = DEFAULT_REQUIREMENT, dest: str | os.PathLike | None = None) -> Path:
    """Download and unpack ``requirement`` (``vllm==X.Y.Z``); returns the directory that holds ``vllm/``."""
    return _fetch.fetch(requirement, dest)
