"""Fetch an engine's source: its wheel from the package index, without dependencies, unpacked.

``fetch("vllm==0.33.0")`` or ``fetch("sglang==0.5.23")`` runs ``pip download --no-deps`` and
unpacks the wheel's pure-Python files (``PACKAGE/**/*.py``, its ``dist-info``) into ``dest``
(default ``$DCPSIM_CACHE``, else ``~/.cache/dcpsim``, ``/PACKAGE-VERSION``); compiled
extensions are left out (nothing here loads them). Idempotent: a ``dest`` that already holds
that version is returned as it is. Several processes (pytest-xdist workers) may fetch at once:
a file lock beside ``dest`` makes them fetch once.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from dcpsim.cache import cache_dir
from dcpsim.engine.sglang.releases import NEWEST as SGLANG_NEWEST
from dcpsim.engine.vllm.releases import NEWEST as VLLM_NEWEST
from dcpsim.engine.vllm_ascend.releases import NEWEST as ASCEND_NEWEST
from dcpsim.errors import ConfigError, HarnessError

PACKAGES = {"vllm": f"vllm=={VLLM_NEWEST}", "sglang": f"sglang=={SGLANG_NEWEST}", "vllm-ascend": f"vllm-ascend=={ASCEND_NEWEST}"}
"""The engines' packages, each with the requirement fetched by default: the newest release the
engine's table of code shapes knows (``dcpsim.engine.vllm.releases``, ``...sglang.releases``);
``fetch("vllm")`` without a version fetches that one too."""


def package_of(requirement: str) -> str:
    """``vllm`` of ``vllm==0.33.0``; ``ConfigError`` for anything but ``PACKAGE[==VERSION]``."""
    names = "|".join(sorted(PACKAGES, key=len, reverse=True))
    match = re.fullmatch(rf"({names})(==[0-9][0-9A-Za-z.+-]*)?", requirement)
    if not match:
        expected = " or ".join(f"{p}==VERSION" for p in PACKAGES)
        raise ConfigError(f"engine fetch: expected {expected}, got {requirement!r}")
    return match.group(1)


def pinned(requirement: str) -> str:
    """``requirement`` with a version: a bare ``vllm`` (``sglang``) is its newest known release."""
    package = package_of(requirement)
    return requirement if "==" in requirement else PACKAGES[package]


def default_dest(requirement: str) -> Path:
    """``$DCPSIM_CACHE`` (or ``~/.cache/dcpsim``) ``/PACKAGE-VERSION``."""
    requirement = pinned(requirement)
    package, version = requirement.split("==", 1)
    return cache_dir(f"{package}-{version}")  # vllm-ascend-0.23.0.post1


def _version_of(dest: Path, package: str) -> str | None:
    info = sorted(dest.glob(f"{package}-*.dist-info"))
    if not info or not (dest / package / "__init__.py").is_file():
        return None
    return info[0].name.removeprefix(f"{package}-").removesuffix(".dist-info")


def fetch(requirement: str, dest: str | os.PathLike | None = None) -> Path:
    """Download and unpack ``requirement`` (``vllm==X.Y.Z``, ``sglang==X.Y.Z``), once per
    ``dest`` however many processes ask; returns the directory that holds the package."""
    requirement = pinned(requirement)
    package = package_of(requirement)
    named = f"--dest {dest}" if dest else "the cache directory ($DCPSIM_CACHE, else ~/.cache/dcpsim)"
    dest = Path(dest) if dest else default_dest(requirement)
    want = requirement.split("==", 1)[1] if "==" in requirement else None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = open(dest.parent / f".{dest.name}.fetch.lock", "w")
    except OSError as exc:
        raise ConfigError(f"{named}: cannot create the directory {dest}: {exc.strerror or exc}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        have = _version_of(dest, module_of(package))
        if have is not None and (want is None or have == want):
            return dest
        if package in SDIST_ONLY:
            _download_sdist(requirement, package, dest)
        else:
            _download_and_unpack(requirement, package, dest)
    return dest


SDIST_ONLY = {"vllm-ascend": {"SOC_VERSION": "ascend910b1", "COMPILE_CUSTOM_KERNELS": "0"}}
"""Packages published as a source archive only, with the environment their ``setup.py`` needs
to say its metadata on a machine without an NPU (pip builds it, without build isolation, so
it pulls no dependency: ``setuptools-scm`` and ``wheel`` must be installed, the
``vllm-ascend`` extra has them); nothing of theirs is built or run beyond that."""


def module_of(package: str) -> str:
    """The import name of a package (``vllm_ascend`` of ``vllm-ascend``)."""
    return package.replace("-", "_")


def _download_sdist(requirement: str, package: str, dest: Path) -> None:
    """``pip download`` the source archive, unpack its package's Python files and its
    ``PKG-INFO`` (as ``MODULE-VERSION.dist-info/METADATA``, so the tree names its version)."""
    module = module_of(package)
    env = {**os.environ, **SDIST_ONLY[package]}
    with tempfile.TemporaryDirectory(prefix=f"dcpsim-{package}-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-build-isolation",
            "--no-binary",
            ":all:",
            "-q",
            "-d",
            tmp,
            requirement,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        archives = list(Path(tmp).glob(f"{module}-*.tar.gz"))
        if done.returncode != 0 or not archives:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no source archive"]
            needs = "it needs setuptools-scm and wheel: pip install 'dcpsim[vllm-ascend]'"
            raise HarnessError(f"engine fetch: pip download {requirement} failed: {last} ({needs})")
        staging = Path(tempfile.mkdtemp(prefix=f".{package}-", dir=dest.parent))
        try:
            with tarfile.open(archives[0]) as archive:
                for member in archive.getmembers():
                    parts = member.name.split("/")
                    if len(parts) < 2 or not member.isfile():
                        continue
                    inner = "/".join(parts[1:])
                    if inner == "PKG-INFO":
                        version = archives[0].name.removeprefix(f"{module}-").removesuffix(".tar.gz")
                        target = staging / f"{module}-{version}.dist-info" / "METADATA"
                    elif parts[1] == module and inner.endswith(".py"):
                        target = staging / inner
                    else:
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.extractfile(member).read())
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _download_and_unpack(requirement: str, package: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory(prefix=f"dcpsim-{package}-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", tmp, requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob(f"{package}-*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise HarnessError(f"engine fetch: pip download {requirement} failed: {last}")
        staging = Path(tempfile.mkdtemp(prefix=f".{package}-", dir=dest.parent))  # same file system as dest
        try:
            with zipfile.ZipFile(wheels[0]) as wheel:
                for member in wheel.namelist():
                    top = member.split("/", 1)[0]
                    if (top == package and member.endswith(".py")) or (top.endswith(".dist-info") and top.startswith(f"{package}-")):
                        wheel.extract(member, staging)
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
