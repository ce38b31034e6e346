"""dcpsim's cache folder, for files a command keeps between runs (vLLM's unpacked source,
the compiled code of a source tree's modules, Hypothesis's files of ``fuzz``): ``$DCPSIM_CACHE``,
default ``~/.cache/dcpsim``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$DCPSIM_CACHE`` (or ``~/.cache/dcpsim``) joined with ``parts``; not created here."""
    return Path(os.environ.get("DCPSIM_CACHE") or Path.home() / ".cache" / "dcpsim").joinpath(*parts)
