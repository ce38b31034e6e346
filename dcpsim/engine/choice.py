"""``EngineChoice``: which engine a run puts under test, and its options (``--engine``,
``--vllm-source``, ``--vllm-runner``, ``--vllm-merge``,
``--vllm-scheduler``, ``--vllm-attention-backend``, ``--vllm-merge-programs``, ``--sglang-source``,
``--sglang-platform``, ``--sglang-write-programs``, ``--sglang-read-programs``).

A value of the option tree (``dcpsim.options``): it resolves where vLLM's (SGLang's) source is when
built; ``validate`` builds the engine once in the parent (loading a vLLM source tree and
checking its functions), so an engine that cannot run is exit 2 before any rank starts;
``build`` gives the engine in a rank (``dcpsim.engine.registry``, cached per process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dcpsim.engine.interface import Engine
from dcpsim.engine.reference import check_kv_cache_layout
from dcpsim.engine.registry import VLLM_RUNNERS, build_engine
from dcpsim.engine.sglang import loader as sglang_loader
from dcpsim.engine.sglang.adapter import DEFAULT_READ_PROGRAMS, DEFAULT_WRITE_PROGRAMS, PLATFORMS
from dcpsim.engine.vllm.backends import DEFAULT_BACKEND
from dcpsim.engine.vllm.loader import source_dir
from dcpsim.engine.vllm.merge import DEFAULT_PROGRAMS
from dcpsim.engine.vllm.merge_choice import VLLM_MERGES
from dcpsim.engine.vllm.scheduler_choice import VLLM_SCHEDULERS
from dcpsim.engine.vllm_ascend import loader as ascend_loader
from dcpsim.errors import ConfigError
from dcpsim.model.validate import check_int
from dcpsim.options import option

REAL_ENGINES = ("vllm", "sglang", "vllm-ascend")
"""The engines whose own code a run loads from a source tree."""


@dataclass(frozen=True)
class EngineChoice:
    name: str = option(
        "reference",
        "reference (default), vllm (vLLM's own DCP code from --vllm-source), sglang (SGLang's, from "
        "--sglang-source), vllm-ascend (the NPU plugin's, from --vllm-ascend-source, over --vllm-source), or MODULE:ATTR for a plugin "
        "implementing dcpsim.engine.interface.Engine",
        key="engine",
        metavar="NAME",
    )
    engine_partial: bool = option(
        False,
        "--engine vllm or sglang: where the source tree holds a decision's code in no known shape (a tree newer "
        "than the releases dcpsim knows), let the reference make exactly those decisions, named in engine info and "
        "the report, instead of exit 2",
    )
    vllm_source: str | None = option(
        None,
        "--engine vllm: a directory holding vllm/ (an unpacked wheel, a site-packages, a checkout); default $DCPSIM_VLLM_SOURCE",
        metavar="DIR",
    )
    vllm_runner: str = option("v2", "--engine vllm: the slot mapping kernel of model runner v2 (default) or v1", choices=VLLM_RUNNERS)
    vllm_merge: str = option(
        "vllm",
        "--engine vllm with --attention: vllm (default): every cross-rank merge runs vLLM's combine wrappers "
        "(cp_lse_ag_out_rs, dcp_a2a_lse_reduce) on a sample of its rows; reference: dcpsim's merge",
        choices=VLLM_MERGES,
    )
    vllm_attention_backend: str = option(
        DEFAULT_BACKEND,
        f"--engine vllm: the vLLM attention backend whose LSE base (its lse_base_on_e, read from the source "
        f"tree) the ranks compute and merge in (default {DEFAULT_BACKEND})",
        metavar="NAME",
    )
    vllm_merge_programs: int = option(
        DEFAULT_PROGRAMS,
        "--engine vllm: at most N token x head programs of a merge run vLLM's wrappers (one Python call each "
        f"under Triton's interpreter); a bigger merge runs them on N / heads evenly spaced rows (default {DEFAULT_PROGRAMS})",
        metavar="N",
    )
    vllm_scheduler: str = option(
        "manager",
        "--engine vllm: manager (default): vLLM's KVCacheManager decides every block (hits, allocation and "
        "the preemption signal, releases, frees, KV events) in dcpsim's step loop; full: vLLM's v1 Scheduler "
        "drives every step (schedule() decides which requests run and how many tokens each, update_from_output() "
        "takes the scenario's sampled tokens); dcpsim: dcpsim's own scheduler (only vLLM's worker-side code runs)",
        choices=VLLM_SCHEDULERS,
    )
    vllm_allow_chunked_local_hybrid: bool = option(
        False,
        "--engine vllm: run vLLM as with VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1: a model with chunked "
        "local attention keeps the hybrid KV cache manager (vLLM's default, read from its VllmConfig, turns it off; "
        "it stays off beside an EAGLE-style drafter)",
    )
    vllm_ascend_source: str | None = option(
        None,
        "--engine vllm-ascend: a directory holding vllm_ascend/ (an unpacked source archive, a checkout); default "
        "$DCPSIM_VLLM_ASCEND_SOURCE. Its vLLM core comes from --vllm-source (the release the plugin runs on)",
        metavar="DIR",
    )
    sglang_source: str | None = option(
        None,
        "--engine sglang: a directory holding sglang/ (an unpacked wheel, a site-packages, a checkout); default $DCPSIM_SGLANG_SOURCE",
        metavar="DIR",
    )
    sglang_platform: str = option(
        "cuda",
        "--engine sglang: cuda (default; HIP and XPU alike): tokens dealt one by one (interleave 1); npu: whole pages "
        "(interleave = block size)",
        choices=PLATFORMS,
    )
    sglang_write_programs: int = option(
        DEFAULT_WRITE_PROGRAMS,
        "--engine sglang: SGLang's Triton MLA write kernel runs on at most N tokens of each write (one Python call "
        f"each under Triton's interpreter), its torch scatter on the rest (default {DEFAULT_WRITE_PROGRAMS})",
        metavar="N",
    )
    sglang_read_programs: int = option(
        DEFAULT_READ_PROGRAMS,
        "--engine sglang: SGLang's MLA page-table builder (create_mla_kv_page_table_for_dcp, one Python call per "
        "request under Triton's interpreter) runs on at most N requests of each step, the reference's pages on the "
        f"rest (default {DEFAULT_READ_PROGRAMS})",
        metavar="N",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"engine must be reference, vllm or MODULE:ATTR, got {self.name!r}")
        if self.vllm_runner not in VLLM_RUNNERS:
            raise ConfigError(f"--vllm-runner must be one of {', '.join(VLLM_RUNNERS)}, got {self.vllm_runner!r}")
        if self.vllm_scheduler not in VLLM_SCHEDULERS:
            raise ConfigError(f"--vllm-scheduler must be one of {', '.join(VLLM_SCHEDULERS)}, got {self.vllm_scheduler!r}")
        if isinstance(self.vllm_merge, bool):  # a replay record of before 0.x: true was vLLM's kernel
            object.__setattr__(self, "vllm_merge", "vllm" if self.vllm_merge else "reference")
        if self.vllm_merge not in VLLM_MERGES:
            raise ConfigError(f"--vllm-merge must be one of {', '.join(VLLM_MERGES)}, got {self.vllm_merge!r}")
        check_int("vllm_merge_programs", self.vllm_merge_programs)
        check_int("sglang_write_programs", self.sglang_write_programs, 0)
        check_int("sglang_read_programs", self.sglang_read_programs, 0)
        if self.sglang_platform not in PLATFORMS:
            raise ConfigError(f"--sglang-platform must be one of {', '.join(PLATFORMS)}, got {self.sglang_platform!r}")
        if self.engine_partial and self.name not in REAL_ENGINES:
            raise ConfigError("--engine-partial is only used with --engine vllm, sglang or vllm-ascend")
        for engine, users in (("vllm", ("vllm", "vllm-ascend")), ("sglang", ("sglang",)), ("vllm-ascend", ("vllm-ascend",))):
            if self.name not in users and self._options_set(engine):
                raise ConfigError(f"--{engine}-* options are only used with --engine {' or '.join(users)}")
        self._resolve_sources()

    def _resolve_sources(self) -> None:
        """Each source tree the engine loads as an absolute path, so that a replay finds the same tree."""
        if self.name in ("vllm", "vllm-ascend"):
            object.__setattr__(self, "vllm_source", os.path.abspath(source_dir(self.vllm_source)))
        if self.name == "vllm-ascend":
            object.__setattr__(self, "vllm_ascend_source", os.path.abspath(ascend_loader.source_dir(self.vllm_ascend_source)))
        if self.name == "sglang":
            object.__setattr__(self, "sglang_source", os.path.abspath(sglang_loader.source_dir(self.sglang_source)))

    def _options_set(self, engine: str) -> bool:
        """Whether an option of ``engine`` (``vllm``: ``vllm_*`` but ``vllm_ascend_*``) is set."""
        defaults = EngineChoice.__dataclass_fields__
        prefix = engine.replace("-", "_") + "_"
        mine = [f for f in defaults if f.startswith(prefix) and not (engine == "vllm" and f.startswith("vllm_ascend_"))]
        return any(getattr(self, f) != defaults[f].default for f in mine)

    @property
    def is_reference(self) -> bool:
        return self.name == "reference"

    def validate(self) -> None:
        """Build the engine once here (``ConfigError`` if it cannot run): a vLLM source tree
        is loaded and its functions checked, a plugin imported."""
        if not self.is_reference:
            self.build()

    def refusal(self, scenario) -> str | None:
        """Why the engine cannot run ``scenario`` (its ``check_scenario``: SGLang has no
        interleave knob, for one), or None; the reference runs every valid scenario. How
        ``matrix``, ``selftest`` and ``fuzz`` leave out what an engine refuses."""
        if self.is_reference:
            return None
        try:
            engine = self.build()
            engine.check_scenario(scenario)
            check_kv_cache_layout(engine, scenario)  # Helix: the reference's layout only
        except ConfigError as exc:
            return str(exc)
        return None

    def forkserver_build(self) -> tuple[str, dict]:
        """This engine as a build the ranks' forkserver makes once, before it forks them
        (``dcpsim.engine.loading.forkserver``: a source tree loaded once per world, not per rank)."""
        fields = {f: getattr(self, f) for f in EngineChoice.__dataclass_fields__}
        return "dcpsim.engine.choice:build_choice", fields

    def build(self) -> Engine:
        """The engine (``dcpsim.engine.registry.build_engine``, cached per process)."""
        return build_engine(
            self.name,
            engine_partial=self.engine_partial,
            vllm_source=self.vllm_source,
            vllm_runner=self.vllm_runner,
            vllm_merge=self.vllm_merge,
            vllm_scheduler=self.vllm_scheduler,
            vllm_attention_backend=self.vllm_attention_backend,
            vllm_merge_programs=self.vllm_merge_programs,
            vllm_allow_chunked_local_hybrid=self.vllm_allow_chunked_local_hybrid,
            sglang_source=self.sglang_source,
            vllm_ascend_source=self.vllm_ascend_source,
            sglang_platform=self.sglang_platform,
            sglang_write_programs=self.sglang_write_programs,
            sglang_read_programs=self.sglang_read_programs,
        )


def build_choice(**fields) -> Engine:
    """``EngineChoice(**fields).build()``: the builder the ranks' forkserver calls
    (``EngineChoice.forkserver_build``); the engine is cached in that process, so the forked
    ranks find it built."""
    return EngineChoice(**fields).build()
