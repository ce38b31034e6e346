"""Fetch vLLM's source: the wheel from the package index, without dependencies, unpacked.

``fetch("vllm==0.33.0", dest)`` runs ``pip download --no-deps`` and unpacks the wheel's
pure-Python files (``vllm/**/*.py``, its ``dist-info``) into ``dest``; compiled
extensions are left out (nothing here loads them). Idempotent: a ``dest`` that already
holds that version is returned as it is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dcpsim.cache import cache_dir
from dcpsim.errors import ConfigError, HarnessError

DEFAULT_REQUIREMENT = "vllm==0.33.0"


def default_dest(requirement: str) -> Path:
    """``$DCPSIM_CACHE`` (or ``~/.cache/dcpsim``) ``/vllm-VERSION``."""
    version = requirement.split("==", 1)[1] if "==" in requirement else "latest"
    return cache_dir(f"vllm-{version}")


def _version_of(dest: Path) -> str | None:
    info = sorted(dest.glob("vllm-*.dist-info"))
    if not info or not (dest / "vllm" / "__init__.py").is_file():
        return None
    return info[0].name.removeprefix("vllm-").removesuffix(".dist-info")


def fetch(requirement: str = DEFAULT_REQUIREMENT, dest: str | os.PathLike | None = None) -> Path:
    """Download and unpack ``requirement`` (``vllm==X.Y.Z``); returns the directory that holds ``vllm/``."""
    if not re.fullmatch(r"vllm(==[0-9][0-9A-Za-z.+-]*)?", requirement):
        raise ConfigError(f"engine fetch: expected vllm==VERSION, got {requirement!r}")
    dest = Path(dest) if dest else default_dest(requirement)
    want = requirement.split("==", 1)[1] if "==" in requirement else None
    have = _version_of(dest)
    if have is not None and (want is None or have == want):
        return dest
    with tempfile.TemporaryDirectory(prefix="dcpsim-vllm-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", tmp, requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if done.returncode != 0 or not wheels:
            raise HarnessError(
                f"engine fetch: pip download {requirement} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:] or ['no wheel']}"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".vllm-", dir=dest.parent))  # same file system as dest
        try:
            with zipfile.ZipFile(wheels[0]) as wheel:
                for member in wheel.namelist():
                    top = member.split("/", 1)[0]
                    if (top == "vllm" and member.endswith(".py")) or (top.endswith(".dist-info") and top.startswith("vllm-")):
                        wheel.extract(member, staging)
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest
