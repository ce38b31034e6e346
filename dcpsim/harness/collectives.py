"""The collectives a rank uses, behind one interface with two implementations.

``GlooCollectives`` wraps the torch.distributed process group (the real
harness); ``ThreadCollectives`` joins ranks running as threads of one process
(fast in-process tests). Rank code never knows which it runs on. Both count
the bytes each rank contributes, so verification traffic can be reported.
"""

from __future__ import annotations

import pickle
import threading
import traceback

import torch

from dcpsim.errors import HarnessError


class Collectives:
    rank: int
    world_size: int
    bytes_sent: int = 0

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def all_gather_object(self, obj) -> list:
        raise NotImplementedError

    def all_to_all_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` is ``[world_size, ...]``: ``tensor[i]`` goes to rank ``i``; returns
        ``out`` of the same shape with ``out[i]`` the chunk rank ``i`` sent here."""
        raise NotImplementedError

    def reduce_scatter_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` is ``[world_size, ...]``: returns the sum over ranks of their
        ``tensor[self.rank]`` (shape ``tensor.shape[1:]``)."""
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

    def all_to_all_tensor(self, tensor):
        import torch.distributed as dist

        tensor = tensor.contiguous()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        out = torch.empty_like(tensor)
        # gloo implements all_to_all_single (equal splits along dim 0) natively
        dist.all_to_all_single(out, tensor)
        return out

    def reduce_scatter_tensor(self, tensor):
        import torch.distributed as dist

        tensor = tensor.contiguous()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        # torch 2.13's gloo reduce-scatters natively (reduce_scatter_single, which replaces the
        # deprecated reduce_scatter_tensor). Older torch without it: emulate with an
        # all-to-all of the chunks and a local sum (same result, same bytes per rank).
        native = getattr(dist, "reduce_scatter_single", None)
        if native is None:
            chunks = torch.empty_like(tensor)
            dist.all_to_all_single(chunks, tensor)
            return chunks.sum(dim=0)
        out = torch.empty_like(tensor[0])
        native(out.view(-1), tensor.view(-1))  # gloo wants input length == W * output length
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

    def all_to_all_tensor(self, tensor):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return torch.stack([t[self.rank] for t in self._gather(tensor.contiguous())])

    def reduce_scatter_tensor(self, tensor):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return torch.stack([t[self.rank] for t in self._gather(tensor.contiguous())]).sum(dim=0)


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
        raise ThreadRankError(rank, exc) from exc
    return results


class ThreadRankError(HarnessError, RuntimeError):
    """A rank thread of ``run_in_threads`` raised: a harness failure (exit 3) whose message
    holds the rank's traceback, indented, as a gloo rank's failure report does."""

    def __init__(self, rank: int, exc: BaseException):
        lines = traceback.format_exception(exc)
        super().__init__(f"rank {rank} failed: {type(exc).__name__}: {exc}\n"
                         + "".join("    " + line for line in "".join(lines).rstrip().splitlines(True)))
        self.rank, self.exc = rank, exc
