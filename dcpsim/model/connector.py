"""KV-connector math for disaggregated prefill/decode: which rank and local block of the
prefill instance holds what a decode rank needs. Pure numpy.

An instance shards a request's KV over its context-parallel world of ``N = pcp * dcp``
ranks; the rank of a (PCP rank, DCP rank) pair is ``pcp_rank * dcp + dcp_rank`` (the rule
NIXL-style matching must follow, vllm#38433). Inside that world the DCP formulas of
``dcpsim.model.layout`` hold with ``W = N``: position ``p`` lives on rank ``(p // I) % N``
at local index ``(p // (N * I)) * I + p % I``, and local index ``l`` is in the rank's
local block ``l // B`` (block-table entry), at offset ``l % B``.

Two ways to move a prompt:

* ``block_matches``: NIXL-style block-level matching. It needs ``I == B`` on both sides
  (vLLM sets the interleave to the smallest group block size under NIXL for exactly this,
  ``VllmConfig.adjust_dcp_kv_cache_interleave_size``), equal ``B``, and context-parallel
  sizes that divide one another. Global block ``g`` (positions ``[g*B, (g+1)*B)``) is then
  local block ``g // N`` of rank ``g % N``; so a rank owns blocks ``rank, rank + N,
  rank + 2N, ...``: the stride is ``N = pcp * dcp``, never ``dcp`` alone.
* ``token_routes``: a re-sharding connector that moves every position on its own, so
  instances may differ in every size (W, I, B and PCP).

A decode instance under Helix's layout (``kv_cache_layout = "helix"``, TensorRT-LLM; docs
section 15) takes the prompt's blocks of ``B`` round-robin over its ``W`` ranks: prompt
position ``p`` goes to rank ``(p // B) % W`` at local slot ``(p // (B * W)) * B + p % B``
(``dcpsim.model.helix.helix_placement``; a prompt position's place does not depend on the
prompt's length). ``InstanceLayout(kv_cache_layout="helix")`` is that layout, whatever
interleave the instance's config names. It is vLLM's layout with ``I = B``, so NIXL's block
matching pairs a vLLM prefill instance with ``I = B`` and a Helix decode instance exactly:
global block ``g`` goes whole to rank ``g % W``, local block ``g // W``, which is where Helix
puts prompt block ``g``.

Both return ``Route`` lists (a source rank's local indices and where they go on one
decode rank); ``routes_cover`` says whether routes deliver every position of the
destination layout exactly once to its owner's local index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.errors import ConfigError
from dcpsim.model.arith import cdiv
from dcpsim.model.helix import KV_CACHE_LAYOUTS, helix_placement
from dcpsim.model.validate import check_int


@dataclass(frozen=True)
class InstanceLayout:
    """The KV layout of one instance (one sharded KV-cache group of it)."""

    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    block_size: int = 16
    prefill_context_parallel_size: int = 1
    kv_cache_layout: str = "vllm"
    """``helix``: a decode instance under Helix's layout (the module doc): one DCP group
    (PCP 1), its prompt blocks round-robin, ``cp_kv_cache_interleave_size`` taken as ``B``."""

    def __post_init__(self) -> None:
        check_int("decode_context_parallel_size", self.decode_context_parallel_size, 1)
        check_int("cp_kv_cache_interleave_size", self.cp_kv_cache_interleave_size, 1)
        check_int("block_size", self.block_size, 1)
        check_int("prefill_context_parallel_size", self.prefill_context_parallel_size, 1)
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ConfigError(f"kv_cache_layout must be one of {', '.join(KV_CACHE_LAYOUTS)}, got {self.kv_cache_layout!r}")
        if self.kv_cache_layout == "helix":
            if self.prefill_context_parallel_size != 1:
                raise ConfigError('kv_cache_layout = "helix" needs prefill_context_parallel_size = 1 on the decode instance')
            object.__setattr__(self, "cp_kv_cache_interleave_size", self.block_size)  # Helix deals whole blocks

    @property
    def cp_size(self) -> int:
        """``N = pcp * dcp``: the ranks a request's KV is sharded over."""
        return self.prefill_context_parallel_size * self.decode_context_parallel_size

    def cp_rank(self, pcp_rank: int, dcp_rank: int) -> int:
        """``pcp_rank * dcp + dcp_rank``."""
        if not 0 <= pcp_rank < self.prefill_context_parallel_size:
            raise ConfigError(f"pcp_rank must be in [0, {self.prefill_context_parallel_size}), got {pcp_rank}")
        if not 0 <= dcp_rank < self.decode_context_parallel_size:
            raise ConfigError(f"dcp_rank must be in [0, {self.decode_context_parallel_size}), got {dcp_rank}")
        return pcp_rank * self.decode_context_parallel_size + dcp_rank

    def owner(self, positions) -> np.ndarray:
        """The rank storing each prompt position."""
        pos = np.asarray(positions, dtype=np.int64)
        if self.kv_cache_layout == "helix":
            return self._helix(pos)[0]
        return (pos // self.cp_kv_cache_interleave_size) % self.cp_size

    def local_index(self, positions) -> np.ndarray:
        """Each prompt position's local index (slot index) on its owner."""
        pos = np.asarray(positions, dtype=np.int64)
        if self.kv_cache_layout == "helix":
            return self._helix(pos)[1]
        n, i = self.cp_size, self.cp_kv_cache_interleave_size
        return (pos // (n * i)) * i + pos % i

    def _helix(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Helix's (owner, local slot) of prompt positions: every one below the prompt's end."""
        prompt_len = int(pos.max()) + 1 if pos.size else 0
        return helix_placement(pos, prompt_len=prompt_len, block_size=self.block_size, dcp_size=self.decode_context_parallel_size)

    def positions_on(self, rank: int, num_tokens: int) -> np.ndarray:
        """The positions ``< num_tokens`` rank ``rank`` stores, in local order."""
        pos = np.arange(num_tokens, dtype=np.int64)
        return pos[self.owner(pos) == rank]


@dataclass(frozen=True)
class Route:
    """Entries at local indices ``src_local`` of prefill rank ``src_rank`` go to local
    indices ``dst_local`` of decode rank ``dst_rank``."""

    src_rank: int
    dst_rank: int
    src_local: np.ndarray
    dst_local: np.ndarray


def rank_global_blocks(layout: InstanceLayout, rank: int, num_blocks: int, *, stride: int | None = None) -> np.ndarray:
    """Global blocks (of ``B`` positions, ``I == B``) that rank ``rank`` owns among
    ``num_blocks``: ``rank, rank + N, ...`` with ``N = pcp * dcp``. ``stride`` overrides
    ``N`` (how the stride-by-dcp bug of vllm#38433 reads the layout)."""
    return np.arange(rank, num_blocks, stride or layout.cp_size, dtype=np.int64)


def check_block_matching(src: InstanceLayout, dst: InstanceLayout, what: str = "kv_connector") -> None:
    """Refuse two layouts NIXL-style block matching cannot pair, naming the field."""
    for side, layout in (("prefill", src), ("decode", dst)):
        if layout.cp_kv_cache_interleave_size != layout.block_size and layout.cp_size > 1:
            raise ConfigError(
                f"{what}: block-level matching needs the {side} instance's cp_kv_cache_interleave_size "
                f"({layout.cp_kv_cache_interleave_size}) equal to its block_size ({layout.block_size})"
            )
    if src.block_size != dst.block_size:
        raise ConfigError(
            f"{what}: block-level matching needs equal block_size on both instances, "
            f"got prefill {src.block_size} and decode {dst.block_size}"
        )
    a, b = src.cp_size, dst.cp_size
    if a % b and b % a:
        raise ConfigError(
            f"{what}: the instances' context-parallel sizes (pcp * dcp) must divide one another, got prefill {a} and decode {b}"
        )


def block_matches(num_tokens: int, src: InstanceLayout, dst: InstanceLayout, *, src_stride: int | None = None) -> list[Route]:
    """NIXL-style routes of a ``num_tokens`` prompt, one per (decode rank, decode local
    block): decode rank ``d`` takes global blocks ``d, d + N_dst, ...``; block ``g`` comes
    from prefill rank ``p = g % N_src``, whose blocks are ``p, p + N_src, ...``: its local
    block ``(g - p) // N_src``. ``src_stride`` (a fault) replaces that stride, as a
    connector that strides by ``dcp`` alone does (it takes global blocks 0, 2, 4 of a
    pcp = dcp = 2 rank for the ones it holds, 0, 4, 8). The layouts are not checked here (``check_block_matching``)."""
    B = dst.block_size
    num_blocks = cdiv(num_tokens, B)
    n_src = src.cp_size
    stride = src_stride or n_src
    routes = []
    for d in range(dst.cp_size):
        for j, g in enumerate(rank_global_blocks(dst, d, num_blocks)):
            count = min(B, num_tokens - int(g) * B)
            offsets = np.arange(count, dtype=np.int64)
            p = int(g % n_src)
            routes.append(Route(p, d, ((int(g) - p) // stride) * B + offsets, j * B + offsets))
    return routes


def token_routes(num_tokens: int, src: InstanceLayout, dst: InstanceLayout, *, dst_as: InstanceLayout | None = None) -> list[Route]:
    """Re-sharding routes of a ``num_tokens`` prompt, one per (prefill rank, decode rank)
    pair that shares positions. ``dst_as`` (a fault) is the layout the connector believes
    the decode instance has (e.g. the prefill's interleave)."""
    believed = dst_as or dst
    pos = np.arange(num_tokens, dtype=np.int64)
    s_rank, s_local = src.owner(pos), src.local_index(pos)
    d_rank, d_local = believed.owner(pos), believed.local_index(pos)
    routes = []
    for s in range(src.cp_size):
        for d in range(dst.cp_size):
            mine = (s_rank == s) & (d_rank == d)
            if mine.any():
                routes.append(Route(s, d, s_local[mine], d_local[mine]))
    return routes


def routes_cover(routes: list[Route], num_tokens: int, src: InstanceLayout, dst: InstanceLayout) -> bool:
    """Whether the routes deliver every position ``< num_tokens`` exactly once, from the
    prefill rank and local index holding it to the decode rank and local index owning it."""
    got = {}
    for r in routes:
        for s, t in zip(r.src_local.tolist(), r.dst_local.tolist()):
            key = (r.dst_rank, t)
            if key in got:
                return False
            got[key] = (r.src_rank, s)
    pos = np.arange(num_tokens, dtype=np.int64)
    want = {
        (int(dr), int(dl)): (int(sr), int(sl))
        for dr, dl, sr, sl in zip(dst.owner(pos), dst.local_index(pos), src.owner(pos), src.local_index(pos))
    }
    return got == want
