"""Helix's KV-cache layout (TensorRT-LLM's decode context parallelism): the engine's math.

Pure numpy, vectorized. Notation as in ``docs/dcp-semantics.md`` section 15: ``P`` the
request's prompt length (where decoding starts), ``B`` tokens per block
(``tokens_per_block``), ``W`` the DCP (Helix ``cp``) size, ``r`` a rank.

* A prompt position ``p < P`` lies in prompt block ``j = p // B``, on rank ``j % W`` (the
  round-robin of the prefill-to-decode transfer; vLLM's layout with ``I = B``), in that rank's
  local block ``j // W``. The prompt's last block may be partial; it stays so.
* A decode position ``p >= P`` is decode token ``t = p - P``, in decode block ``k = t // B``,
  on rank ``k % W`` (only that rank appends it; the others do nothing), in local block
  ``P_r + k // W`` at offset ``t % B``, ``P_r`` being the prompt blocks rank ``r`` holds: each
  rank's decode blocks start fresh after its prompt blocks.

A rank's *local slot index* ``s`` is ``local block * B + offset``; through the request's
block-table row it is the slot ``row[s // B] * B + s % B`` (one manager block id stands for
``B`` slots on every rank, as under vLLM's layout). Local slot indices increase with the
position on a rank, with gaps (the partial prompt block's tail, the unfilled part of the
newest decode block), so attention reads a rank's keys in order with those gaps masked.

Speculative decoding: a verify row of request ``r`` carries ``1 + d`` tokens, ``d`` the drafts
``r`` runs this step (``min(k, tokens left - 1)``, so rows of one step differ), at positions
``start + [0, 1 + d)``; each is decode token ``p - P`` and goes where that decode token goes, so
a row crossing a multiple of ``B`` decode tokens straddles two blocks and two ranks. Rejected
drafts roll back: the accepted count sets the next row's start, and the rolled-back tokens'
places are taken again by the tokens accepted there later (a decode token's place depends on
its count from the first decode step alone, never on the step that wrote it).

The decode block of a decode token is TensorRT-LLM's
``(max(1, iteration) - 1) // tokens_per_block`` for the decode iteration ``t + 1``
(``decode_block_of``); the clamp keeps the first iteration, which may be counted as 0, on
block 0 (``decode_block_of(..., clamp=False)``: block -1, rank ``W - 1``, TensorRT-LLM#17795).
"""

from __future__ import annotations

import numpy as np

from dcpsim.errors import ConfigError
from dcpsim.model.arith import cdiv
from dcpsim.model.layout import PAD

KV_CACHE_LAYOUTS = ("vllm", "helix")
"""``SimConfig.kv_cache_layout`` values: vLLM's layout by position (``model.layout``), or Helix's."""

__all__ = [
    "KV_CACHE_LAYOUTS",
    "check_helix_config",
    "check_helix_scenario",
    "decode_block_of",
    "helix_blocks_needed",
    "helix_local_keys",
    "helix_local_seq_lens",
    "helix_owner",
    "helix_placement",
    "helix_slot_mapping",
    "prompt_blocks_on_rank",
]


def decode_block_of(decode_tokens, block_size: int, *, first_iteration: int = 1, clamp: bool = True) -> np.ndarray:
    """The decode block of each decode token ``t`` (0-based from the first decode step), as
    TensorRT-LLM derives it from the decode iteration: ``(max(1, it) - 1) // B`` with
    ``it = t + first_iteration`` (``first_iteration``: what the first decode step counts as;
    0 where a transferred request's first step is counted as 0). ``clamp=False`` drops the
    ``max(1, .)``."""
    it = np.asarray(decode_tokens, dtype=np.int64) + first_iteration
    if clamp:
        it = np.maximum(it, 1)
    return (it - 1) // block_size


def prompt_blocks_on_rank(prompt_len, block_size: int, dcp_size: int, dcp_rank: int) -> np.ndarray:
    """``P_r``: prompt blocks ``j < cdiv(P, B)`` with ``j % W == r`` (each input a prompt length)."""
    blocks = -(-np.asarray(prompt_len, dtype=np.int64) // block_size)
    return np.maximum(blocks - dcp_rank + dcp_size - 1, 0) // dcp_size


def helix_placement(positions, *, prompt_len: int, block_size: int, dcp_size: int, decode_blocks=None) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, local slot index on the owner)`` of each position of a request whose
    decoding starts at ``prompt_len``. ``decode_blocks``: the decode block of each decode
    position (default ``(p - P) // B``; an engine's own derivation may be handed in)."""
    pos = np.asarray(positions, dtype=np.int64)
    B, W, P = block_size, dcp_size, int(prompt_len)
    decode = pos >= P
    j = pos // B
    owner = j % W
    local = (j // W) * B + pos % B
    if decode.any():
        t = pos[decode] - P
        k = t // B if decode_blocks is None else np.asarray(decode_blocks, dtype=np.int64)
        r = k % W
        owner[decode] = r
        local[decode] = (prompt_blocks_on_rank(P, B, W, r) + k // W) * B + t % B
    return owner, local


def helix_owner(positions, *, prompt_len: int, block_size: int, dcp_size: int) -> np.ndarray:
    """The rank storing each position (``helix_placement``'s owner)."""
    return helix_placement(positions, prompt_len=prompt_len, block_size=block_size, dcp_size=dcp_size)[0]


def helix_slot_mapping(
    positions, block_row, *, prompt_len: int, block_size: int, dcp_size: int, dcp_rank: int, decode_blocks=None
) -> np.ndarray:
    """Slots of one request's ``positions`` on rank ``dcp_rank`` (``PAD``: another rank's),
    through the request's block-table row. A local slot past the row is a ``ValueError``."""
    owner, local = helix_placement(positions, prompt_len=prompt_len, block_size=block_size, dcp_size=dcp_size, decode_blocks=decode_blocks)
    row = np.asarray(block_row, dtype=np.int64)
    mine = owner == dcp_rank
    entry = local // block_size
    if mine.any() and (int(entry[mine].max()) >= len(row) or int(entry[mine].min()) < 0):
        bad = int(np.asarray(positions, dtype=np.int64)[mine][np.argmax(entry[mine] >= len(row))])
        raise ValueError(f"position {bad} needs a block-table entry the row of {len(row)} entries does not have")
    slots = np.full(len(local), PAD, dtype=np.int64)
    slots[mine] = row[entry[mine]] * block_size + local[mine] % block_size
    return slots


def helix_local_keys(seq_len: int, *, prompt_len: int, block_size: int, dcp_size: int, dcp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, local slot indices)`` of the keys ``< seq_len`` rank ``dcp_rank`` holds,
    in local order (which is position order)."""
    pos = np.arange(int(seq_len), dtype=np.int64)
    owner, local = helix_placement(pos, prompt_len=prompt_len, block_size=block_size, dcp_size=dcp_size)
    mine = owner == dcp_rank
    return pos[mine], local[mine]


def helix_local_seq_lens(seq_lens, *, prompt_len: int, block_size: int, dcp_size: int, dcp_rank: int) -> np.ndarray:
    """Keys ``< L`` rank ``dcp_rank`` holds, for each length ``L`` (closed form: the rank's
    prompt keys below ``min(L, P)``, then its decode keys below ``L - P``)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    B, W, r, P = block_size, dcp_size, dcp_rank, int(prompt_len)
    return _owned_runs(np.minimum(lens, P), B, W, r) + _owned_runs(np.maximum(lens - P, 0), B, W, r)


def _owned_runs(n: np.ndarray, B: int, W: int, r: int) -> np.ndarray:
    """Of ``n`` tokens in blocks of ``B`` dealt round-robin from rank 0, those on rank ``r``."""
    full, part = n // B, n % B
    mine = np.maximum(full - r + W - 1, 0) // W * B  # whole blocks k < full with k % W == r
    return mine + np.where(full % W == r, part, 0)


def helix_blocks_needed(num_tokens: int, block_size: int, dcp_size: int) -> int:
    """Block-table entries a request of ``num_tokens`` tokens holds under Helix, whatever its
    prompt length: ``cdiv(L, B * W) + 1`` (0 for no token). The busiest rank holds
    ``cdiv(cdiv(P, B), W) + cdiv(cdiv(L - P, B), W)`` local blocks; with at most
    ``cdiv(L, B) + 1`` blocks in all (a partial prompt block) that is at most
    ``cdiv(cdiv(L, B), W) + 1``, reached for example at ``P = 1``."""
    if num_tokens <= 0:
        return 0
    return cdiv(num_tokens, block_size * dcp_size) + 1


def check_helix_config(config) -> None:
    """Refuse what Helix cannot express in dcpsim under ``kv_cache_layout = "helix"``
    (``ConfigError`` naming the field): PCP, prefix caching, CUDA-graph padding (dummy requests
    without a prompt), a draft model. Any other value than ``vllm`` and ``helix`` is refused
    too. Speculative decoding runs: a verify row's ``1 + d`` tokens are decode tokens placed as
    any other (module docstring)."""
    if config.kv_cache_layout not in KV_CACHE_LAYOUTS:
        raise ConfigError(f"kv_cache_layout must be one of {', '.join(KV_CACHE_LAYOUTS)}, got {config.kv_cache_layout!r}")
    if config.kv_cache_layout != "helix":
        return
    refused = (
        ("prefill_context_parallel_size", config.prefill_context_parallel_size != 1, "1"),
        ("enable_prefix_caching", config.enable_prefix_caching, "false (a cached block's placement depends on its first request)"),
        ("max_cudagraph_capture_size", config.max_cudagraph_capture_size != 0, "0 (padding requests have no prompt)"),
        ("draft_layers", bool(config.draft_layers), "empty (no draft model)"),
    )
    for name, bad, want in refused:
        if bad:
            value = getattr(config, name)
            raise ConfigError(f'kv_cache_layout = "helix" needs {name} = {want}, got {value!r}')


def check_helix_scenario(groups, config, requests, disaggregated=None) -> None:
    """The scenario-level refusals of ``kv_cache_layout = "helix"``: every KV-cache group a
    DCP-sharded full-attention paged group (Helix deals whole blocks of ``B`` tokens: it reads
    no interleave, both sides take ``I = B``), no forced preemption (a recomputation would re-prefill
    decode positions). ``groups``: ``(name, storage, retention, sharded, block_size)`` of each
    group.

    A ``[disaggregated]`` run (``disaggregated``) is accepted: it takes Helix's layout on its
    decode instance only (the prefill instance runs vLLM's: ``dcpsim.scenarios.pd.instance_scenario``),
    and its connector delivers each prompt position to the rank and local slot
    ``helix_placement`` gives it (``dcpsim.model.connector``)."""
    if config.kv_cache_layout != "helix":
        return
    head = 'kv_cache_layout = "helix"'
    for name, storage, retention, sharded, _ in groups:
        if str(storage) != "paged" or str(retention) != "full" or not sharded:
            raise ConfigError(
                f"{head} lays out DCP-sharded full-attention groups only; group {name} is {storage} storage, {retention} retention"
                + ("" if sharded else ", not sharded")
            )
    for r in requests:
        if r.preempt_at_steps:
            raise ConfigError(f"{head}: request {r.request_id!r} has preempt_at_steps (a recomputation under Helix is not modelled)")
