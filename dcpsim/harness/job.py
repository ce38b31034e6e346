"""``Job``: everything a rank needs (picklable): the resolved scenario and the run options.

A Job can come from a hand-edited replay file, so it validates every option when it is
built: a bad one is a ``ConfigError`` (exit 2) before any rank starts.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass
from functools import cached_property

from dcpsim.errors import ConfigError
from dcpsim.model.attention_config import DEFAULT_MAX_STEP_KEYS, AttentionConfig
from dcpsim.model.scenario import Scenario
from dcpsim.model.validate import is_int

VERIFY_MODES = ("incremental", "full")
"""``--verify``: what each check re-reads (``verify.check.Checker``)."""


class RankFailureKind(enum.StrEnum):
    """How ``--simulate-rank-failure`` breaks a rank."""

    RAISE = "raise"
    HANG = "hang"
    EXIT = "exit"


@dataclass(frozen=True)
class Job:
    scenario: Scenario
    paranoid: bool = False
    inject: str | None = None
    """Name of a known DCP bug to switch on in the engine (``dcpsim.engine.faults``)."""
    rank_failure: tuple[str, int, int] | None = None
    """(kind, rank, step): make one rank raise, hang or exit at a step, to exercise the
    harness's failure handling (``--simulate-rank-failure``)."""
    attention: bool = False
    """Check the decode math every step (``--attention``); also on when the injected fault
    needs it."""
    lse_base: str = "e"
    attention_merge: str = "alternate"
    """allgather, alltoall, or alternate (allgather on even steps, alltoall on odd ones)."""
    attention_heads: int = 8
    attention_head_dim: int = 16
    """Width of K and of V (each)."""
    attention_max_step_keys: int = DEFAULT_MAX_STEP_KEYS
    """The attention check's step rule (``AttentionConfig.max_step_keys``): a context up to
    this many keys is checked every step, a longer one on a stated sample of steps."""
    engine: str = "reference"
    """The engine under test: ``reference``, ``vllm`` or ``MODULE:ATTR`` (``dcpsim.engine.registry``)."""
    vllm_source: str | None = None
    """``--engine vllm``: the directory holding ``vllm/`` (resolved to an absolute path)."""
    vllm_runner: str = "v2"
    """``--engine vllm``: whose slot mapping kernel runs, model runner v2's or v1's."""
    vllm_merge: bool = False
    """``--engine vllm``: also merge attention (``--attention``) with vLLM's DCP correction kernel."""
    verify: str = "incremental"
    """``--verify``: ``incremental`` (each check re-reads what the stores' and tables' change
    records say can have changed, a full sweep as each request finishes and at the end) or
    ``full`` (every check re-reads every live index)."""
    exchange_every: int = 16
    """Verified steps whose rows the ranks exchange in one collective (``Checker.exchange``):
    each step is still read and judged as of that step; a failing step found in a later
    exchange has the run redone in lockstep for its report. 1: one exchange a step (also
    whenever the attention check, ``--paranoid``, several DCP groups, PCP or a
    disaggregated instance are on, since their ranks meet in collectives every step
    anyway, and under ``--trace``)."""

    def __post_init__(self) -> None:
        from dcpsim.engine.faults import get_fault

        get_fault(self.inject)
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}")
        if not is_int(self.exchange_every) or self.exchange_every < 1:
            raise ConfigError(f"exchange_every must be an integer >= 1, got {self.exchange_every!r}")
        self.attention_config  # noqa: B018 - validates the attention options, once
        if self.inject and self.engine != "reference":
            raise ConfigError(f"--inject switches on a fault of the reference engine; it cannot be combined with --engine {self.engine}")
        if self.engine == "vllm":
            from dcpsim.engine.vllm.adapter import source_dir

            object.__setattr__(self, "vllm_source", os.path.abspath(source_dir(self.vllm_source)))
        self.validate_engine(self.engine, self.vllm_source, self.vllm_runner, self.vllm_merge)
        if self.rank_failure is not None:
            kind, rank, step = self.rank_failure
            if kind not in tuple(RankFailureKind) or not is_int(rank) or not is_int(step):
                raise ConfigError(f"rank_failure must be (raise|hang|exit, rank, step), got {self.rank_failure!r}")

    @staticmethod
    def validate_engine(
        engine: str = "reference", vllm_source: str | None = None, vllm_runner: str = "v2", vllm_merge: bool = False
    ) -> None:
        """Refuse engine options that cannot run (``ConfigError``, before any rank starts);
        builds the engine once, which loads a vLLM source tree and checks its functions."""
        from dcpsim.engine.registry import VLLM_RUNNERS, build_engine

        if not isinstance(engine, str) or not engine:
            raise ConfigError(f"engine must be reference, vllm or MODULE:ATTR, got {engine!r}")
        if vllm_runner not in VLLM_RUNNERS:
            raise ConfigError(f"--vllm-runner must be one of {', '.join(VLLM_RUNNERS)}, got {vllm_runner!r}")
        if engine != "vllm" and (vllm_source is not None or vllm_merge):
            raise ConfigError("--vllm-source and --vllm-merge are only used with --engine vllm")
        if engine != "reference":
            build_engine(engine, vllm_source=vllm_source, vllm_runner=vllm_runner, vllm_merge=vllm_merge)

    @cached_property
    def attention_config(self) -> AttentionConfig:
        """The attention check's options as one validated object."""
        return AttentionConfig(
            heads=self.attention_heads,
            head_dim=self.attention_head_dim,
            value_dim=self.attention_head_dim,
            lse_base=self.lse_base,
            merge=self.attention_merge,
            max_step_keys=self.attention_max_step_keys,
        )

    @property
    def world_size(self) -> int:
        """Processes of the world: ``prefill_context_parallel_size * tensor_parallel_size``
        (``decode_context_parallel_size`` without PCP or a larger TP)."""
        return self.scenario.config.world_size


def parse_rank_failure(text: str, world_size: int) -> tuple[str, int, int]:
    """``KIND:RANK:STEP`` with KIND one of raise, hang, exit."""
    kinds = tuple(RankFailureKind)
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in kinds or not all(p.isdigit() for p in parts[1:]):
        raise ConfigError(f"--simulate-rank-failure expects KIND:RANK:STEP with KIND in {'/'.join(kinds)}, got {text!r}")
    kind, rank, step = parts[0], int(parts[1]), int(parts[2])
    if rank >= world_size:
        raise ConfigError(f"--simulate-rank-failure: rank {rank} is not in a world of {world_size}")
    return kind, rank, step


def simulate_rank_failure(job: Job, rank: int, step: int) -> None:
    """Break this rank now if the job says so (raise, hang forever, or exit at once)."""
    if job.rank_failure is None:
        return
    kind, which, at = job.rank_failure
    if (which, at) != (rank, step):
        return
    if kind == RankFailureKind.RAISE:
        raise RuntimeError(f"simulated failure of rank {rank} at step {step}")
    from dcpsim.harness.world import flush_progress

    flush_progress()  # the parent places the hang or the exit at this step
    if kind == RankFailureKind.HANG:
        while True:
            time.sleep(3600)
    os._exit(17)
