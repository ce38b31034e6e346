"""``EngineChoice``: which engine a run puts under test, and its options (``--engine``,
``--vllm-source``, ``--vllm-runner``, ``--vllm-merge``).

A value of the option tree (``dcpsim.options``): it resolves where vLLM's source is when
built; ``validate`` builds the engine once in the parent (loading a vLLM source tree and
checking its functions), so an engine that cannot run is exit 2 before any rank starts;
``build`` gives the engine in a rank (``dcpsim.engine.registry``, cached per process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dcpsim.engine.interface import Engine
from dcpsim.engine.registry import VLLM_RUNNERS, build_engine
from dcpsim.engine.vllm.adapter import VLLM_SCHEDULERS
from dcpsim.engine.vllm.loader import source_dir
from dcpsim.errors import ConfigError
from dcpsim.options import option


@dataclass(frozen=True)
class EngineChoice:
    name: str = option(
        "reference",
        "reference (default), vllm (vLLM's own DCP code from --vllm-source), or MODULE:ATTR for a plugin "
        "implementing dcpsim.engine.interface.Engine",
        key="engine",
        metavar="NAME",
    )
    vllm_source: str | None = option(
        None,
        "--engine vllm: a directory holding vllm/ (an unpacked wheel, a site-packages, a checkout); default $DCPSIM_VLLM_SOURCE",
        metavar="DIR",
    )
    vllm_runner: str = option("v2", "--engine vllm: the slot mapping kernel of model runner v2 (default) or v1", choices=VLLM_RUNNERS)
    vllm_merge: bool = option(
        False,
        "--engine vllm with --attention: merge with vLLM's DCP correction kernel too (slow under Triton's "
        "interpreter: one program per token and head)",
    )
    vllm_scheduler: str = option(
        "manager",
        "--engine vllm: manager (default): vLLM's KVCacheManager decides every block (hits, allocation and "
        "the preemption signal, releases, frees, KV events) in dcpsim's step loop; dcpsim: dcpsim's own "
        "scheduler (only vLLM's worker-side code runs)",
        choices=VLLM_SCHEDULERS,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"engine must be reference, vllm or MODULE:ATTR, got {self.name!r}")
        if self.vllm_runner not in VLLM_RUNNERS:
            raise ConfigError(f"--vllm-runner must be one of {', '.join(VLLM_RUNNERS)}, got {self.vllm_runner!r}")
        if self.vllm_scheduler not in VLLM_SCHEDULERS:
            raise ConfigError(f"--vllm-scheduler must be one of {', '.join(VLLM_SCHEDULERS)}, got {self.vllm_scheduler!r}")
        if self.name != "vllm" and (self.vllm_source is not None or self.vllm_merge or self.vllm_scheduler != "manager"):
            raise ConfigError("--vllm-source, --vllm-merge and --vllm-scheduler are only used with --engine vllm")
        if self.name == "vllm":  # an absolute path, so that a replay finds the same tree
            object.__setattr__(self, "vllm_source", os.path.abspath(source_dir(self.vllm_source)))

    @property
    def is_reference(self) -> bool:
        return self.name == "reference"

    def validate(self) -> None:
        """Build the engine once here (``ConfigError`` if it cannot run): a vLLM source tree
        is loaded and its functions checked, a plugin imported."""
        if not self.is_reference:
            self.build()

    def build(self) -> Engine:
        """The engine (``dcpsim.engine.registry.build_engine``, cached per process)."""
        return build_engine(
            self.name,
            vllm_source=self.vllm_source,
            vllm_runner=self.vllm_runner,
            vllm_merge=self.vllm_merge,
            vllm_scheduler=self.vllm_scheduler,
        )
