"""``PDJob``: a disaggregated prefill/decode run (a scenario with a ``[disaggregated]`` table
and an optional P/D fault), validated before any rank starts, and each instance's sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcpsim.engine.async_load import async_loaded_scheduler
from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.connector import CONNECTORS, LoadedScheduler
from dcpsim.engine.faults import PDFault, get_pd_fault
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.errors import ConfigError
from dcpsim.harness.dry_run import dry_run
from dcpsim.harness.job import Job
from dcpsim.model.kinds import Storage
from dcpsim.model.scenario import Scenario
from dcpsim.scenarios.pd import ROLES, check_disaggregation, instance_layout, instance_scenario


def require_one_dcp_group(scenario: Scenario) -> None:
    """The decode instance loads each prompt into one DCP group: PCP 1 and TP = its W (exit 2)."""
    layout = instance_scenario(scenario, "decode").config.parallel_layout
    if layout.pcp > 1 or layout.world_size != layout.dcp:
        raise ConfigError(
            f"disaggregated.decode: prefill_context_parallel_size {layout.pcp}, tensor_parallel_size {layout.tp}, "
            f"decode_context_parallel_size {layout.dcp}: the decode instance of a P/D run is one DCP group "
            "(prefill_context_parallel_size 1, tensor_parallel_size = decode_context_parallel_size)"
        )


@dataclass(frozen=True)
class PDJob:
    scenario: Scenario
    inject: str | None = None
    """A P/D fault (``dcpsim.engine.faults.pd``)."""
    engine: EngineChoice = field(default_factory=EngineChoice)
    """The engine under test of both instances (``--engine``); its scheduler is the engine's."""

    def __post_init__(self) -> None:
        if self.scenario.disaggregated is None:
            raise ConfigError(f"scenario {self.scenario.name!r} has no [disaggregated] table")
        fault = get_pd_fault(self.inject)
        if not self.engine.is_reference and any(fault.engine(role) is not None for role in ROLES):
            raise ConfigError(
                f"--inject {self.inject}: the fault changes an instance's reference engine; it cannot be combined with "
                f"--engine {self.engine.name}"
            )
        kind = self.scenario.disaggregated.kv_connector
        if self.scenario.disaggregated.load_steps:
            check_async_load(self.scenario, self.engine, fault, self.inject)
        if self.inject and fault.connector(kind) is not None and fault.kv_connector != kind:
            raise ConfigError(
                f"--inject {self.inject}: the fault is in the {fault.kv_connector} connector; this run uses "
                f"kv_connector = {kind} (--kv-connector {fault.kv_connector})"
            )

    @property
    def sizes(self) -> tuple[int, int]:
        """Each instance's processes (``pcp * tp``)."""
        pd = self.scenario.disaggregated
        return pd.prefill.world_size, pd.decode.world_size

    @property
    def world_size(self) -> int:
        return sum(self.sizes)

    def fault(self) -> PDFault:
        return get_pd_fault(self.inject)

    def instance(self, role: str) -> Scenario:
        return instance_scenario(self.scenario, role)

    def instance_job(self, role: str) -> Job:
        """The job one instance runs: its scenario, the run's engine (validated: an engine that
        refuses the instance is exit 2, ``Engine.check_scenario``)."""
        return Job(self.instance(role), engine=self.engine)

    def connector(self):
        return self.fault().connector(self.scenario.disaggregated.kv_connector) or CONNECTORS[self.scenario.disaggregated.kv_connector]()

    def notices(self) -> np.ndarray:
        """``[decode rank, request, 2]``: the completion the connector notifies each decode rank of,
        per prompt (entries received, entries on the final page; -1: never notified)."""
        src, dst = instance_layout(self.scenario, "prefill"), instance_layout(self.scenario, "decode")
        connector = self.connector()
        out = np.full((dst.cp_size, len(self.scenario.requests), 2), -1, np.int64)
        for i, req in enumerate(self.scenario.requests):
            for d, notice in connector.notices(connector.routes(req.prompt_len, src, dst), dst).items():
                out[d, i] = notice
        return out

    def pairs(self) -> dict[tuple[int, int], list]:
        """(prefill rank, decode rank) -> [(request index, group, Route)], in one order for both sides."""
        src, dst = instance_layout(self.scenario, "prefill"), instance_layout(self.scenario, "decode")
        groups = len(ReferenceEngine().geometries(self.instance("decode").layers, self.instance("decode").config))
        connector = self.connector()
        out: dict[tuple[int, int], list] = {}
        for i, req in enumerate(self.scenario.requests):
            for route in connector.routes(req.prompt_len, src, dst):
                for g in range(groups):
                    out.setdefault((route.src_rank, route.dst_rank), []).append((i, g, route))
        return out


def prepare_pd(job: PDJob) -> dict:
    """Validate a P/D run before any rank starts (exit 2 naming the field); dry-run both
    instances' schedules. Returns their summaries."""
    scenario = job.scenario
    check_disaggregation(scenario)
    require_one_dcp_group(scenario)
    summaries = {}
    for role in ROLES:
        sc = job.instance(role)
        engine = ReferenceEngine()
        geometries = engine.geometries(sc.layers, sc.config)
        for g in geometries:
            if g.storage is not Storage.PAGED or g.tokens_per_state != 1 or g.draft or not (g.sharded or g.dcp_size == 1):
                raise ConfigError(
                    f"disaggregated: group {g.name} ({g.storage}, {'sharded' if g.sharded else 'replicated'}) "
                    "is not supported in P/D runs yet: every KV-cache group must be a sharded, paged, "
                    "uncompressed attention cache of the target model"
                )
        if len({g.block_size for g in geometries}) != 1:
            raise ConfigError("disaggregated: P/D runs need one block size for every KV-cache group")
        summaries[role] = dry_run(sc, scheduler_class=instance_scheduler(role, scenario.disaggregated.load_steps)).summary
        try:
            job.instance_job(role)
        except ConfigError as exc:
            raise ConfigError(f"the {role} instance: {exc}") from None
    return summaries


def instance_scheduler(role: str, load_steps: int = 0) -> type[Scheduler]:
    """The scheduler of an instance: the decode instance's admits prompts whose KV the
    connector loads (``LoadedScheduler``; with ``load_steps``, asynchronously:
    ``engine.async_load``)."""
    if role != "decode":
        return Scheduler
    return async_loaded_scheduler(load_steps) if load_steps else LoadedScheduler


def check_async_load(scenario: Scenario, engine: EngineChoice, fault: PDFault, inject: str | None) -> None:
    """Asynchronous loads (``[disaggregated] load_steps``) are dcpsim's scheduler's, and the decode
    instance's page tails are judged: the reference engine's decode instance, no draft tokens (a
    rejected draft stays past the length) and no prefix caching (a hit's blocks are not new).
    Exit 2 naming the field."""
    config = instance_scenario(scenario, "decode").config
    why = None
    if not engine.is_reference:
        why = f"the asynchronous loads are dcpsim's scheduler's; --engine {engine.name} brings its own"
    elif fault.engine("decode") is not None:
        why = f"--inject {inject} changes the decode instance's engine"
    elif config.num_speculative_tokens:
        why = "num_speculative_tokens must be 0 (a rejected draft's entry stays past the request's length)"
    elif config.enable_prefix_caching:
        why = "enable_prefix_caching must be false (a prefix hit's blocks are not cleared as new ones)"
    if why:
        raise ConfigError(f"disaggregated.load_steps {scenario.disaggregated.load_steps}: {why}")


def instance_sizes(scenario: Scenario, role: str) -> dict:
    """An instance's sizes as run (``W`` its DCP group's) and its connector layout's shards."""
    config = instance_scenario(scenario, role).config
    layout = instance_layout(scenario, role)
    return dict(
        decode_context_parallel_size=config.decode_context_parallel_size,
        prefill_context_parallel_size=config.prefill_context_parallel_size,
        tensor_parallel_size=config.parallel_layout.tp,
        cp_kv_cache_interleave_size=layout.cp_kv_cache_interleave_size,
        block_size=layout.block_size,
        kv_shards=layout.cp_size,
    )
