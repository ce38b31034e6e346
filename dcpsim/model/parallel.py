"""Prefill context parallelism (PCP) x tensor parallelism (TP) x DCP: the size rules, the
rank grid and the prefill split, as pure functions (vLLM 0.33.0 semantics).

* The world is ``pcp * tp`` processes laid out as a ``(PCP, TP)`` grid, world rank
  ``pcp_rank * tp + tp_rank`` (``vllm/distributed/parallel_state.py``: the layout order is
  ... x PCP x TP).
* Allowed sizes (``vllm/config/parallel.py``): with ``pcp == 1`` DCP reuses the TP ranks,
  so ``tp % dcp == 0``; with PCP, DCP is off (1), spans the PCP axis (``pcp``), or spans
  the whole grid (``tp * pcp``).
* DCP groups: the grid transposed to ``(TP, PCP)`` and cut into rows of ``dcp`` (when
  ``dcp > 1``); PCP groups: the grid's columns (one per TP rank); TP groups: its rows.
  Each DCP group is an independent replica of the whole KV cache: PCP adds no KV shards.
* The prefill split (``vllm/v1/worker/gpu/pcp_manager.py``): a prefill of ``q`` tokens is
  cut into ``2 * pcp`` chunks of ``cdiv(q, 2 * pcp)`` tokens (the last ones shorter or
  empty) and PCP rank ``r`` computes chunks ``r`` and ``2 * pcp - 1 - r``. Decodes are
  never split, and with ``dcp > 1`` neither is a prefill too short to fill every chunk
  (``(2 * pcp - 1) * cdiv(q, 2 * pcp) >= q``): such a row is *replicated*, every PCP rank
  computes all of it (the fix of vllm#53573).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.errors import ConfigError


def check_parallel_sizes(pcp: int, tp: int, dcp: int) -> None:
    """vLLM 0.33.0's rule for ``prefill_context_parallel_size`` (pcp),
    ``tensor_parallel_size`` (tp) and ``decode_context_parallel_size`` (dcp); a
    ``ConfigError`` (exit 2) that states the rule otherwise."""
    for name, value in (("prefill_context_parallel_size", pcp), ("tensor_parallel_size", tp), ("decode_context_parallel_size", dcp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if pcp == 1:
        if tp % dcp:
            raise ConfigError(
                f"tensor_parallel_size {tp} must be divisible by decode_context_parallel_size {dcp}: "
                "without prefill context parallelism DCP reuses the TP ranks (vLLM 0.33.0, "
                "vllm/config/parallel.py)"
            )
        return
    allowed = sorted({1, pcp, tp * pcp})
    if dcp not in allowed:
        raise ConfigError(
            f"decode_context_parallel_size {dcp} with prefill_context_parallel_size {pcp} and "
            f"tensor_parallel_size {tp}: with PCP, DCP must be off (1), span the PCP axis ({pcp}) or "
            f"span the whole TP x PCP grid ({tp * pcp}); valid sizes are {allowed} (vLLM 0.33.0, "
            "vllm/config/parallel.py)"
        )


def default_tensor_parallel_size(pcp: int, dcp: int) -> int:
    """``tensor_parallel_size`` when a scenario leaves it out: ``dcp`` without PCP (the
    world is the DCP group, as before PCP existed), else the smallest TP that fits
    (``dcp // pcp`` for a DCP group spanning the grid, 1 otherwise)."""
    if pcp == 1:
        return dcp
    return dcp // pcp if dcp > pcp and dcp % pcp == 0 else 1


@dataclass(frozen=True)
class RankCoords:
    """Where one world rank sits: its grid coordinates and its DCP group and rank."""

    rank: int
    pcp_rank: int
    tp_rank: int
    dcp_group: int
    dcp_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    """The ``(PCP, TP)`` rank grid and its groups (sizes already checked)."""

    pcp: int
    tp: int
    dcp: int

    def __post_init__(self) -> None:
        check_parallel_sizes(self.pcp, self.tp, self.dcp)

    @property
    def world_size(self) -> int:
        return self.pcp * self.tp

    def grid(self) -> np.ndarray:
        """``grid[pcp_rank, tp_rank]`` is the world rank."""
        return np.arange(self.world_size).reshape(self.pcp, self.tp)

    def dcp_groups(self) -> list[list[int]]:
        """Each DCP group's world ranks, in DCP-rank order."""
        ranks = self.grid().T if self.dcp > 1 else self.grid()
        return ranks.reshape(-1, self.dcp).tolist()

    def pcp_groups(self) -> list[list[int]]:
        """Each PCP group's world ranks (one group per TP rank), in PCP-rank order."""
        return self.grid().T.reshape(-1, self.pcp).tolist()

    def tp_groups(self) -> list[list[int]]:
        return self.grid().reshape(-1, self.tp).tolist()

    def coords(self, rank: int) -> RankCoords:
        pcp_rank, tp_rank = divmod(rank, self.tp)
        for g, members in enumerate(self.dcp_groups()):
            if rank in members:
                return RankCoords(rank, pcp_rank, tp_rank, g, members.index(rank))
        raise ValueError(f"rank {rank} is not in a world of {self.world_size}")


def pcp_chunk_size(query_len: int, pcp: int) -> int:
    num_chunks = 2 * pcp
    return (query_len + num_chunks - 1) // num_chunks


def pcp_replicated(query_len: int, prefill: bool, pcp: int, dcp: int) -> bool:
    """Whether every PCP rank computes the whole row instead of its two chunks: a decode
    (speculative steps included), and with ``dcp > 1`` a prefill too short to fill all
    ``2 * pcp`` chunks."""
    if pcp == 1 or not prefill:
        return True
    if dcp > 1:
        return (2 * pcp - 1) * pcp_chunk_size(query_len, pcp) >= query_len
    return False


def pcp_chunks(query_len: int, pcp: int, pcp_rank: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` pieces of a split row that PCP rank ``pcp_rank`` computes:
    chunks ``pcp_rank`` and ``2 * pcp - 1 - pcp_rank``, empty ones left out."""
    size = pcp_chunk_size(query_len, pcp)
    pieces = []
    for chunk in (pcp_rank, 2 * pcp - 1 - pcp_rank):
        offset = chunk * size
        length = min(size, query_len - offset)
        if length > 0:
            pieces.append((offset, length))
    return pieces


def chunk_computer(query_len: int, pcp: int) -> np.ndarray:
    """For each query token of a split row, the PCP rank that computes it (a view of
    ``pcp_chunks``; every token has exactly one)."""
    out = np.full(query_len, -1, np.int64)
    for r in range(pcp):
        for offset, length in pcp_chunks(query_len, pcp, r):
            out[offset : offset + length] = r
    return out
