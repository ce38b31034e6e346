"""``Collectives``: the interface through which the ranks of a group exchange data.

Neutral ground between the two sides: the engine under test merges attention through it
and the checker gathers its rows through it, while only the harness implements it (over
a gloo process group, or over threads: ``dcpsim.harness.collectives``) and touches the
process group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Collectives:
    """One group of ranks that exchange data: the rank's place in it, its collectives, and
    the bytes this rank has contributed so far. Every rank of the group calls each
    collective in the same order with tensors of the same shape."""

    rank: int
    world_size: int
    bytes_sent: int = 0

    def all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), in rank order."""
        raise NotImplementedError

    def subgroup(self, name: str, groups: list[list[int]]) -> Collectives:
        """The ``Collectives`` of the group (of ``groups``, world ranks) this rank is in.
        Collective: every rank calls it with the same arguments."""
        raise NotImplementedError

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order."""
        raise NotImplementedError

    def all_to_all_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` is ``[world_size, ...]``: ``tensor[i]`` goes to rank ``i``; returns
        ``out`` of the same shape with ``out[i]`` the chunk rank ``i`` sent here."""
        raise NotImplementedError

    def reduce_scatter_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` is ``[world_size, ...]``: returns the sum over ranks of their
        ``tensor[self.rank]`` (shape ``tensor.shape[1:]``)."""
        raise NotImplementedError
