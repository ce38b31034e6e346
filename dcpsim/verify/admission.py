"""The checker's judgement of admission: the longest request the engine admits against the pools
it holds (failure ``admission``; semantics section 8, class 53).

A request's logical tokens count once against the logical capacity. From the scenario alone
(``verify.geometry``) and the pools' sizes (the blocks each rank's store holds besides the null
block) the checker derives each group's per-rank rows (``blocks * B / R`` entries: positions, or
records of ``R`` tokens) and its logical capacity in tokens, the rows times ``R`` times ``W`` for a
DCP-sharded group and times 1 for a ``dcp_replicated`` one. Only groups that hold a request's whole
context count (full attention, MLA, compressed records): a sliding window, a chunk, a ring or a
Mamba state holds a bounded share of any request, and a pool too small for that share refuses the
scenario before any rank starts. The tightest group decides. A request's logical tokens are
``prompt_len + output_len + k`` (every slot its furthest step may take, as the pool-fit check
counts them).

The engine's decision (``Engine.max_admissible_tokens``, as its scheduler took it) is judged once,
before the first step, and costs one pass over the scenario's requests:

* a request of the scenario no longer than the capacity but longer than the decision: refused
  though its pool holds it (sglang#39731: a request's logical tokens against one rank's rows);
* a decision above the capacity (or no limit where a group bounds the length): it would admit a
  request its pool cannot hold (a limit already in logical tokens multiplied by ``W`` again).

Not judged: Helix's layout (its rows keep a spare entry for the busiest rank) and an engine that
does not make the decision (its scheduler admits by its own rules).
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.model.kinds import Retention, Storage
from dcpsim.plural import plural
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.report import Failure, FailureKind

RULE = (
    "admission counts a request's logical tokens once against the logical capacity: per-rank rows x W "
    "for a DCP-sharded group, x 1 for a dcp_replicated one; the tightest group decides"
)


@dataclass(frozen=True)
class GroupCapacity:
    """What one group's pool holds of a request."""

    name: str
    rows: int
    """Entries (positions, or records) one rank's pool holds."""
    tokens_per_row: int
    """``R`` for compressed records, 1 for positions."""
    shards: int
    """``W`` for a DCP-sharded group, 1 for a replicated one."""

    @property
    def tokens(self) -> int:
        """The group's logical capacity: the longest request its pool holds."""
        return self.rows * self.tokens_per_row * self.shards

    def describe(self) -> str:
        per = f" of {self.tokens_per_row} tokens" if self.tokens_per_row > 1 else ""
        how = f"x W = {self.shards}" if self.shards > 1 else "x 1 (replicated)" if self.shards == 1 else ""
        return f"group {self.name}: {plural(self.rows, 'row')}{per} per rank {how}"


def holds_whole_context(group: ExpectedGroup) -> bool:
    """Whether a group holds every position (or record) of a request while it runs."""
    return group.retention is Retention.FULL and group.storage in (Storage.PAGED, Storage.RECORDS)


def group_capacity(group: ExpectedGroup, blocks: int) -> GroupCapacity:
    """The capacity of ``blocks`` blocks per rank of ``group`` (a group that holds whole contexts)."""
    return GroupCapacity(
        name=group.name,
        rows=blocks * group.page_states,
        tokens_per_row=group.tokens_per_state,
        shards=group.dcp_size if group.sharded else 1,
    )


def logical_capacity(groups: list[ExpectedGroup], pool_blocks: list[int]) -> GroupCapacity | None:
    """The tightest group's capacity (None: no group bounds a request's length)."""
    caps = [group_capacity(g, n) for g, n in zip(groups, pool_blocks) if holds_whole_context(g)]
    return min(caps, key=lambda c: c.tokens, default=None)


def request_tokens(request, config) -> int:
    """A request's logical tokens as admission counts them."""
    return request.prompt_len + request.output_len + config.num_speculative_tokens


def judge_admission(groups: list[ExpectedGroup], pool_blocks: list[int], scenario, limit: int | None, rank: int) -> Failure | None:
    """The ``admission`` failure of an engine that admits requests of up to ``limit`` logical
    tokens (None: any) over pools of ``pool_blocks[g]`` blocks per rank, or None."""
    if any(g.helix for g in groups):
        return None
    cap = logical_capacity(groups, pool_blocks)
    capacity = None if cap is None else cap.tokens
    holds = f"the pools hold {capacity} logical tokens ({cap.describe()})" if cap else "no group bounds a request's length"
    admits = "any length" if limit is None else f"at most {limit} tokens"
    refused = [
        (r, n)
        for r in scenario.requests
        if limit is not None and limit < (n := request_tokens(r, scenario.config)) and (capacity is None or n <= capacity)
    ]
    if refused:
        r, n = refused[0]
        k = scenario.config.num_speculative_tokens
        more = f"; {plural(len(refused) - 1, 'more request')} refused alike" if len(refused) > 1 else ""
        return Failure(
            kind=FailureKind.ADMISSION,
            step=0,
            request_id=r.request_id,
            message=(
                f"rank {rank}: request {r.request_id} of {n} tokens refused though its pool holds it: the engine admits "
                f"{admits} (max_admissible_tokens), {holds}{more}"
            ),
            details=[f"{n} = prompt {r.prompt_len} + output {r.output_len} + {k} drafts", f"rule: {RULE}"],
        )
    if capacity is not None and (limit is None or limit > capacity):
        return Failure(
            kind=FailureKind.ADMISSION,
            step=0,
            message=(
                f"rank {rank}: the engine admits {admits} (max_admissible_tokens) but {holds}: "
                f"a request of {capacity + 1} tokens would be admitted that its pool cannot hold"
            ),
            group=cap.name,
            details=[f"rule: {RULE}"],
        )
    return None
