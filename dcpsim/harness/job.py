"""``Job``: everything a rank needs (picklable): the resolved scenario and the run options,
as one option tree (``dcpsim.options``).

``Job.engine`` (``EngineChoice``), ``Job.attention`` (``AttentionConfig``), ``Job.check``
(``CheckOptions``) and ``Job.world`` (``WorldOptions``) are its branches; ``inject`` and
``rank_failure`` its own leaves. Every leaf has one run-option name (``attention_heads``,
``vllm_runner``, ``verify``, ...): ``Job.from_options(scenario, **options)`` builds a job
from them (a fault's configs, a replay record), and the command line's flags are
generated from the same fields.

A Job can come from a hand-edited replay file, so it validates every option when it is
built: a bad one is a ``ConfigError`` (exit 2) before any rank starts.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.faults import get_fault
from dcpsim.engine.interface import Engine
from dcpsim.engine.reference import check_kv_cache_layout
from dcpsim.errors import ConfigError
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.attention_config import AttentionConfig
from dcpsim.model.scenario import Scenario
from dcpsim.model.validate import is_int
from dcpsim.options import branch, from_flat, leaves, option, replace_flat
from dcpsim.verify.options import CheckOptions


class RankFailureKind(enum.StrEnum):
    """How ``--simulate-rank-failure`` breaks a rank."""

    RAISE = "raise"
    HANG = "hang"
    EXIT = "exit"


@dataclass(frozen=True)
class Job:
    scenario: Scenario
    engine: EngineChoice = branch(EngineChoice)
    """The engine under test: ``reference``, ``vllm`` or ``MODULE:ATTR`` (``dcpsim.engine.registry``)."""
    inject: str | None = option(
        None,
        "switch on a known DCP bug in the engine under test (see selftest --list); the run must then fail",
        metavar="FAULT",
    )
    """Name of a known DCP bug to switch on in the reference engine (``dcpsim.engine.faults``)."""
    attention: AttentionConfig = branch(AttentionConfig)
    """The attention check (``--attention``; also on when the injected fault needs it)."""
    check: CheckOptions = branch(CheckOptions)
    world: WorldOptions = branch(WorldOptions)
    """Where the ranks run; no part of what runs (a replay record leaves it out)."""
    rank_failure: tuple[str, int, int] | None = option(
        None,
        "(kind, rank, step): make one rank raise, hang or exit at a step, to exercise the harness's failure "
        "handling (--simulate-rank-failure KIND:RANK:STEP)",
        cli=False,
    )

    def __post_init__(self) -> None:
        get_fault(self.inject)
        if self.inject and not self.engine.is_reference:
            raise ConfigError(
                f"--inject switches on a fault of the reference engine; it cannot be combined with --engine {self.engine.name}"
            )
        self.engine.validate()
        engine = self.build_engine()
        engine.check_scenario(self.scenario)
        check_kv_cache_layout(engine, self.scenario)  # Helix: the reference's layout only
        self._resolve_lse_base(engine)
        if self.rank_failure is not None:
            kind, rank, step = self.rank_failure
            if kind not in tuple(RankFailureKind) or not is_int(rank) or not is_int(step):
                raise ConfigError(f"rank_failure must be (raise|hang|exit, rank, step), got {self.rank_failure!r}")

    def _resolve_lse_base(self, engine: Engine) -> None:
        """``lse_base`` unset: the engine's (``Engine.lse_base``), else e. Set: it must be
        the engine's, when the engine fixes one (a vLLM backend computes in its own base)."""
        fixed = engine.lse_base
        if self.attention.lse_base is None:
            object.__setattr__(self, "attention", dataclasses.replace(self.attention, lse_base=fixed or "e"))
        elif fixed is not None and self.attention.lse_base != fixed:
            source = getattr(getattr(engine, "backend", None), "describe", lambda: getattr(engine, "lse_base_source", engine.name))()
            other = ", or choose another --vllm-attention-backend" if engine.name == "vllm" else ""
            raise ConfigError(
                f"--lse-base {self.attention.lse_base}: the engine under test computes base-{fixed} LSEs ({source}); "
                f"leave --lse-base out{other}"
            )

    @classmethod
    def from_options(cls, scenario: Scenario, **options) -> Job:
        """The job of ``scenario`` with run options by name (``attention=True``,
        ``lse_base="2"``, ``engine="vllm"``, ``verify="full"``, ...)."""
        return from_flat(cls, options, scenario=scenario)

    def with_options(self, **options) -> Job:
        """This job with run options changed by name (``verify="full"``, ``in_process=True``)."""
        return replace_flat(self, options)

    def build_engine(self) -> Engine:
        """The engine under test: ``--engine`` (vLLM's code, a plugin), else the injected
        fault, else the reference engine (``FAULTS["none"]``, the catalogue's correct engine).
        A fault is a fresh instance for each call (each rank's run), so a fault that keeps a
        buffer across steps (``faults.metadata.PersistentBufferFault``) starts empty on every
        rank, in a thread world too."""
        if not self.engine.is_reference:
            return self.engine.build()
        return type(get_fault(self.inject))()

    def attention_on(self, engine: Engine) -> bool:
        """``--attention``, or an engine (a fault) that can only show in the attention check."""
        return self.attention.enabled or bool(getattr(engine, "needs", {}).get("attention"))

    @property
    def world_size(self) -> int:
        """Processes of the world: ``prefill_context_parallel_size * tensor_parallel_size``
        (``decode_context_parallel_size`` without PCP or a larger TP)."""
        return self.scenario.config.world_size


RUN_OPTIONS = tuple(leaf.key for leaf in leaves(Job) if leaf.path[0] != "world")
"""The run options a replay record carries: every leaf of a ``Job`` but where it runs."""


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
