"""The two implementations of ``dcpsim.collectives.Collectives``, the interface a rank uses.

``GlooCollectives`` wraps the torch.distributed process group (the real
harness); ``ThreadCollectives`` joins ranks running as threads of one process
(fast in-process tests). Rank code never knows which it runs on. Both count
the bytes each rank contributes, so verification traffic can be reported.

``subgroup(name, groups)`` splits a world into the groups of one kind (DCP, PCP, TP:
``harness.groups``): every rank calls it with the same list of groups, in the same
order, and gets the ``Collectives`` of the group it is in (``rank`` = its rank there).
Gloo subgroups are real process groups (``new_group``); thread subgroups get their own
exchange per ``(name, members)``, so two kinds of group over the same ranks never pair
one's collective with the other's.
"""

from __future__ import annotations

import pickle
import threading
import traceback

import torch
import torch.distributed as dist

from dcpsim.collectives import Collectives
from dcpsim.errors import HarnessError

STAR_GATHER_FROM = 2
"""Groups larger than this all-gather as a gather to the first member and a broadcast."""


class GlooCollectives(Collectives):
    def __init__(self, rank: int, world_size: int, group=None, ranks=None, groups: dict | None = None):
        """``group``: a subgroup of the default process group (``rank`` and ``world_size``
        are then within it); None: the default group. ``ranks``: the default world's rank
        of each member (None: ``0 .. world_size - 1``). ``groups``: the world's process
        groups by ``(name, world ranks)``, shared by every ``Collectives`` of the world."""
        self.rank = rank
        self.world_size = world_size
        self.bytes_sent = 0
        self.group = group
        """The process group (None: the default, whole world)."""
        self.ranks = tuple(range(world_size)) if ranks is None else tuple(ranks)
        self.groups = {} if groups is None else groups
        # torch.distributed numbers a group's processes in the order of their world ranks, while
        # ``rank`` is the place in ``ranks`` (a DCP group over a (PCP, TP) grid lists world ranks
        # 0, 2, 1, 3): ``_at[g]`` is the member at group rank ``g``, ``_place[m]`` member ``m``'s
        # group rank. Every collective below speaks in members (chunk ``m`` for member ``m``).
        self._at = sorted(range(world_size), key=lambda m: self.ranks[m])
        self._place = [self._at.index(m) for m in range(world_size)]
        self._reordered = self._at != list(range(world_size))

    def _in_members(self, by_group_rank: list) -> list:
        """Results listed by group rank, listed by member instead."""
        return [by_group_rank[g] for g in self._place] if self._reordered else list(by_group_rank)

    def _by_group_rank(self, chunks: torch.Tensor) -> torch.Tensor:
        """Chunks ``[W, ...]`` for members, ordered for the group ranks that receive them."""
        return chunks[self._at].contiguous() if self._reordered else chunks

    def subgroup(self, name, groups):
        """``groups`` are ranks of this collective, translated to world ranks. A process
        group is made by every process of the default world (``new_group`` is collective
        over it), so only the default-world collective makes new ones; a subgroup's
        collective finds its groups made beforehand (``harness.groups.make_world_groups``)."""
        key = (name, tuple(map(tuple, groups)))
        cache = self.__dict__.setdefault("_subgroups", {})
        if key in cache:  # the jobs of a batch share their groups (gloo groups are never freed)
            return cache[key]
        mine = None
        for members in groups:  # every rank creates every group, in the same order
            world = tuple(self.ranks[m] for m in members)
            pg = self.world_group(name, world)
            if self.rank in members:
                mine = GlooCollectives(members.index(self.rank), len(members), pg, world, self.groups)
        cache[key] = mine
        return mine

    def world_group(self, name: str, world_ranks: tuple[int, ...]):
        """The process group of ``world_ranks`` (default-world ranks), made on first use."""
        key = (name, tuple(world_ranks))
        if key not in self.groups:
            if self.group is not None:
                raise HarnessError(
                    f"the {name} group of world ranks {', '.join(map(str, world_ranks))} was not made at world "
                    "start: a subgroup's collectives cannot make process groups (dist.new_group is collective "
                    "over the whole world); make them on every rank first (harness.groups.make_world_groups)"
                )
            # its own group even over every rank (its own collectives), with the world's timeout
            # (new_group's default is 30 minutes)
            self.groups[key] = dist.new_group(list(world_ranks), timeout=_world_timeout())
        return self.groups[key]

    def all_gather_tensor(self, tensor):
        tensor = tensor.contiguous()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        if self.world_size <= STAR_GATHER_FROM:
            out = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(out, tensor, group=self.group)
            return self._in_members(out)
        # gather to the first member, then broadcast: gloo's all_gather is a ring of W - 1
        # dependent hops, each waiting for the next rank to be scheduled, which costs 3.5-4x
        # more than these two star-shaped collectives when ranks outnumber cores (8 ranks on
        # 2 cores: 16-18 ms a call against 3.4-5 ms; benchmarks/bench_collectives.py)
        root = self.ranks[0]
        stacked = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype)
        parts = list(stacked.unbind(0)) if self.rank == 0 else None
        dist.gather(tensor, parts, dst=root, group=self.group)
        dist.broadcast(stacked, src=root, group=self.group)
        return self._in_members(list(stacked.unbind(0)))

    def all_gather_object(self, obj):
        self.bytes_sent += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return self._in_members(out)

    def all_to_all_tensor(self, tensor):
        tensor = tensor.contiguous()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        out = torch.empty_like(tensor)
        # gloo implements all_to_all_single (equal splits along dim 0) natively
        dist.all_to_all_single(out, self._by_group_rank(tensor), group=self.group)
        return torch.stack(self._in_members(list(out.unbind(0)))) if self._reordered else out

    def reduce_scatter_tensor(self, tensor):
        tensor = tensor.contiguous()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        # torch 2.13's gloo reduce-scatters natively (reduce_scatter_single, which replaces the
        # deprecated reduce_scatter_tensor). Older torch without it: emulate with an
        # all-to-all of the chunks and a local sum (same result, same bytes per rank).
        native = getattr(dist, "reduce_scatter_single", None)
        tensor = self._by_group_rank(tensor)
        if native is None:
            chunks = torch.empty_like(tensor)
            dist.all_to_all_single(chunks, tensor, group=self.group)
            return chunks.sum(dim=0)
        out = torch.empty_like(tensor[0])
        native(out.view(-1), tensor.view(-1), group=self.group)  # gloo wants input length == W * output length
        return out


class CollectiveTimeout(HarnessError):
    """A thread rank waited longer than the timeout in a collective (its peers never came)."""


def _world_timeout():
    """The default process group's timeout (the harness's ``--timeout``), or None."""
    try:
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


class _Exchange:
    """Shared slots and a barrier for ranks that are threads of one process; the
    subgroups' exchanges, made on first use, by ``(name, members)``."""

    def __init__(
        self,
        world_size: int,
        timeout: float | None = None,
        name: str = "world",
        members: tuple[int, ...] | None = None,
        registry: dict | None = None,
    ):
        self.world_size = world_size
        self.timeout = timeout
        self.name = name
        self.members = members if members is not None else tuple(range(world_size))
        self.barrier = threading.Barrier(world_size)
        self.slots: list = [None] * world_size
        self.registry = {} if registry is None else registry
        self.lock = threading.Lock() if registry is None else registry["lock"]
        self.registry.setdefault("lock", self.lock)

    def sub(self, name: str, members: tuple[int, ...]) -> _Exchange:
        with self.lock:
            key = (name, members)
            if key not in self.registry:
                self.registry[key] = _Exchange(len(members), self.timeout, name, members, self.registry)
            return self.registry[key]


class ThreadCollectives(Collectives):
    def __init__(self, rank: int, exchange: _Exchange):
        self.rank = rank
        self.world_size = exchange.world_size
        self._ex = exchange
        self.bytes_sent = 0

    def subgroup(self, name, groups):
        world_rank = self._ex.members[self.rank]
        for members in groups:
            world = tuple(members)
            if world_rank in world:
                return ThreadCollectives(world.index(world_rank), self._ex.sub(name, world))
        return None

    def _wait(self) -> None:
        ex, me = self._ex, self._ex.members[self.rank]
        waiting = ex.registry.setdefault("waiting", {})
        waiting[me] = ex.name
        try:
            ex.barrier.wait(ex.timeout)
        except threading.BrokenBarrierError:
            if ex.timeout is not None and not ex.registry.get("aborted"):
                where = "; ".join(f"rank {r} in its {name} group" for r, name in sorted(waiting.items()))
                raise CollectiveTimeout(
                    f"collective timeout: rank {me} waited more than {ex.timeout:g} s in a collective of "
                    f"its {ex.name} group (world ranks {', '.join(map(str, ex.members))}) that a peer never "
                    f"entered; waiting then: {where}"
                ) from None
            raise
        finally:
            waiting.pop(me, None)

    def _gather(self, value):
        self._ex.slots[self.rank] = value
        self._wait()
        out = list(self._ex.slots)
        self._wait()  # nobody overwrites a slot before all have read
        return out

    def all_gather_tensor(self, tensor):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return [t.clone() for t in self._gather(tensor.contiguous())]

    def all_gather_object(self, obj):
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.bytes_sent += len(data)
        return [pickle.loads(d) for d in self._gather(data)]

    def all_to_all_tensor(self, tensor):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return torch.stack([t[self.rank] for t in self._gather(tensor.contiguous())])

    def reduce_scatter_tensor(self, tensor):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return torch.stack([t[self.rank] for t in self._gather(tensor.contiguous())]).sum(dim=0)


def run_in_threads(rank_fn, payload, world_size: int, timeout: float | None = None) -> list:
    """Run ``rank_fn(payload, collectives)`` for every rank as threads; results by rank.

    The first exception raised by any rank is re-raised (after breaking the
    barriers so that the other ranks stop waiting). With ``timeout``, a rank that waits
    longer than that in a collective raises ``CollectiveTimeout`` (a ``HarnessError``),
    re-raised as it is.
    """
    ex = _Exchange(world_size, timeout)
    results: list = [None] * world_size
    errors: list = []

    def abort_all() -> None:
        with ex.lock:
            ex.registry["aborted"] = True
            exchanges = [ex] + [v for k, v in ex.registry.items() if isinstance(v, _Exchange)]
        for e in exchanges:
            e.barrier.abort()

    def body(rank: int) -> None:
        try:
            results[rank] = rank_fn(payload, ThreadCollectives(rank, ex))
        except CollectiveTimeout as exc:
            errors.append((rank, exc))
            abort_all()
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # reported below
            errors.append((rank, exc))
            abort_all()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    # One intra-op thread, as every gloo rank has (launch._rank_main): the ranks are the
    # parallelism, and torch's own threads spin on small tensors (the --attention math got
    # 30x slower with 2 of them on a busy 2-core machine).
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(intra_op)
    if errors:
        rank, exc = errors[0]
        if isinstance(exc, CollectiveTimeout):
            raise CollectiveTimeout(str(exc)) from exc
        raise ThreadRankError(rank, exc) from exc
    return results


class ThreadRankError(HarnessError, RuntimeError):
    """A rank thread of ``run_in_threads`` raised: a harness failure (exit 3) whose message
    holds the rank's traceback, indented, as a gloo rank's failure report does."""

    def __init__(self, rank: int, exc: BaseException):
        lines = traceback.format_exception(exc)
        super().__init__(
            f"rank {rank} failed: {type(exc).__name__}: {exc}\n"
            + "".join("    " + line for line in "".join(lines).rstrip().splitlines(True))
        )
        self.rank, self.exc = rank, exc
