"""The collectives a rank uses, behind one interface with two implementations.

``GlooCollectives`` wraps the torch.distributed process group (the real
harness); ``ThreadCollectives`` joins ranks running as threads of one process
(fast in-process tests). Rank code never knows which it runs on. Both count
the bytes each rank contributes, so verification traffic can be reported.
"""

from __future__ import annotations

import pickle
import threading

import torch


class Collectives:
    rank: int
    world_size: int
    bytes_sent: int = 0

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def all_gather_object(self, obj) -> list:
        raise NotImplementedError


class GlooCollectives(Collectives):
    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.bytes_sent = 0

    def all_gather_tensor(self, tensor):
        import torch.distributed as dist

        tensor = tensor.contiguous()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)
        return out

    def all_gather_object(self, obj):
        import torch.distributed as dist

        self.bytes_sent += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


class _Exchange:
    """Shared slots and a barrier for ranks that are threads of one process."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots: list = [None] * world_size


class ThreadCollectives(Collectives):
    def __init__(self, rank: int, exchange: _Exchange):
        self.rank = rank
        self.world_size = exchange.world_size
        self._ex = exchange
        self.bytes_sent = 0

    def _gather(self, value):
        self._ex.slots[self.rank] = value
        self._ex.barrier.wait()
        out = list(self._ex.slots)
        self._ex.barrier.wait()  # nobody overwrites a slot before all have read
        return out

    def all_gather_tensor(self, tensor):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return [t.clone() for t in self._gather(tensor.contiguous())]

    def all_gather_object(self, obj):
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.bytes_sent += len(data)
        return [pickle.loads(d) for d in self._gather(data)]


def run_in_threads(rank_fn, payload, world_size: int) -> list:
    """Run ``rank_fn(payload, collectives)`` for every rank as threads; results by rank.

    The first exception raised by any rank is re-raised (after breaking the
    barrier so that the other ranks stop waiting).
    """
    ex = _Exchange(world_size)
    results: list = [None] * world_size
    errors: list = []

    def body(rank: int) -> None:
        try:
            results[rank] = rank_fn(payload, ThreadCollectives(rank, ex))
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((rank, exc))
            ex.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        rank, exc = errors[0]
        raise RuntimeError(f"rank {rank} failed: {exc!r}") from exc
    return results
