"""DCP layout math: which rank stores a position, and in which slot.

Pure numpy, vectorized, no torch.distributed and no I/O. Notation as in the
semantics doc: ``W`` = decode_context_parallel_size, ``r`` = DCP rank,
``I`` = cp_kv_cache_interleave_size, ``B`` = KV-manager block size of the
group, ``Bk`` = attention-kernel block size (divides ``B``).

Sharded groups: one block-table entry (a *virtual block*) covers ``B * W``
global positions, ``B`` slots on each rank. Position ``p`` lives on rank
``(p // I) % W``; inside the virtual block its local offset is
``(off // (W * I)) * I + off % I`` with ``off = p % (B * W)``.
Replicated groups use the plain mapping ``block_table[p // B] * B + p % B`` on
every rank.

Every function returns int64 arrays; ``PAD`` (-1) marks a position that this
rank does not store.
"""

from __future__ import annotations

import functools

import numpy as np

from dcpsim.errors import ConfigError
from dcpsim.model.validate import check_int
from dcpsim.plural import plural

PAD = -1

__all__ = [
    "PAD",
    "validate_layout",
    "owner_rank",
    "slot_mapping",
    "runs_slot_mapping",
    "local_seq_lens",
    "query_local_seq_lens",
    "kernel_block_table",
    "records_emitted",
    "record_emit_positions",
    "record_slot_mapping",
    "ring_states_to_write",
    "ring_slot_mapping",
    "state_writes",
    "state_slot_mapping",
]


def validate_layout(**layout) -> None:
    """Reject a layout that the DCP formulas do not cover, naming the values (keywords:
    those of ``_validate_layout``). Remembers the layouts it accepted (a rejection raises,
    so it is never remembered; ``typed``: ``True`` is not ``1``): every slot mapping of
    every step validates its layout, and a run has a handful."""
    try:
        _validated(**layout)
    except TypeError:  # an unhashable value: validate (and reject) it uncached
        _validate_layout(**layout)


def _validate_layout(
    *,
    block_size: int,
    dcp_size: int = 1,
    interleave_size: int = 1,
    kernel_block_size: int | None = None,
    replicated: bool = False,
    what: str = "",
) -> None:
    """Reject a layout that the DCP formulas do not cover, naming the values.

    ``what`` prefixes the message (for example a group name).
    """
    prefix = f"{what}: " if what else ""
    for name, value in (
        ("block_size", block_size),
        ("decode_context_parallel_size", dcp_size),
        ("cp_kv_cache_interleave_size", interleave_size),
    ):
        check_int(f"{prefix}{name}", value)
    if kernel_block_size is not None:
        check_int(f"{prefix}kernel_block_size", kernel_block_size)
        if block_size % kernel_block_size:
            raise ConfigError(f"{prefix}kernel_block_size ({kernel_block_size}) must divide block_size ({block_size})")
    if replicated or dcp_size == 1:
        return
    if interleave_size > block_size:
        raise ConfigError(f"{prefix}cp_kv_cache_interleave_size ({interleave_size}) must be <= block_size ({block_size})")
    if block_size % interleave_size:
        raise ConfigError(f"{prefix}block_size ({block_size}) must be a multiple of cp_kv_cache_interleave_size ({interleave_size})")


_validated = functools.lru_cache(maxsize=4096, typed=True)(_validate_layout)


def _check_rank(dcp_size: int, dcp_rank: int) -> None:
    if not 0 <= dcp_rank < dcp_size:
        raise ConfigError(f"dcp_rank must be in [0, {dcp_size}) for decode_context_parallel_size {dcp_size}, got {dcp_rank}")


def owner_rank(positions, *, dcp_size: int, interleave_size: int = 1) -> np.ndarray:
    """Rank that stores each position of a sharded group: ``(p // I) % W``."""
    pos = np.asarray(positions, dtype=np.int64)
    return (pos // interleave_size) % dcp_size


def kernel_block_table(block_table, *, block_size: int, kernel_block_size: int) -> np.ndarray:
    """Expand KV-manager block ids to attention-kernel block ids.

    KV block ``b`` becomes kernel blocks ``b * k + [0, k)`` with ``k = B // Bk``.
    """
    bt = np.asarray(block_table, dtype=np.int64)
    k = block_size // kernel_block_size
    return (bt[:, None] * k + np.arange(k, dtype=np.int64)[None, :]).reshape(-1)


def _as_positions(positions) -> tuple[np.ndarray | None, range | None]:
    """Split the input into an array, or a step-1 range for the fast path (a ``range``, or
    an array of consecutive increasing positions)."""
    if isinstance(positions, range) and positions.step == 1:
        return None, positions
    pos = np.asarray(positions, dtype=np.int64)
    if pos.ndim != 1:
        raise ValueError(f"positions must be one-dimensional, got shape {pos.shape}")
    rng = _contiguous_range(pos)
    return (None, rng) if rng is not None else (pos, None)


_CHECK_CHUNK = 1 << 16


def _contiguous_range(pos: np.ndarray) -> range | None:
    """``range(pos[0], pos[-1] + 1)`` if ``pos`` is exactly that run (sorted, step 1), else None.

    The endpoints rule out almost every other array at once; the rest is checked in
    cache-sized chunks, so no array of the input's size is allocated and a mismatch
    stops the scan early.
    """
    n = pos.size
    if n < 2:
        return None
    first, last = int(pos[0]), int(pos[-1])
    if last - first != n - 1:
        return None
    # n integers spanning exactly n - 1 are that run iff each is above the one before: a
    # strict comparison (a byte per position) instead of a difference (eight)
    rising = np.empty(min(_CHECK_CHUNK, n - 1), dtype=bool)
    for lo in range(0, n - 1, _CHECK_CHUNK):
        hi = min(lo + _CHECK_CHUNK, n - 1)
        r = rising[: hi - lo]
        np.greater(pos[lo + 1 : hi + 1], pos[lo:hi], out=r)
        if not r.all():
            return None
    return range(first, last + 1)


def _check_span(lo: int, hi: int, span: int, num_blocks: int) -> None:
    """Positions [lo, hi] must be >= 0 and covered by the block table."""
    if lo < 0:
        raise ValueError(f"positions must be >= 0, got {lo}")
    needed = hi // span + 1
    if needed > num_blocks:
        raise ValueError(
            f"position {hi} needs block-table entry {needed - 1}, but the block table "
            f"has {plural(num_blocks, 'entry', 'entries')} (each covers {plural(span, 'position')})"
        )


def slot_mapping(
    positions,
    block_table,
    *,
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave_size: int = 1,
    kernel_block_size: int | None = None,
    replicated: bool = False,
) -> np.ndarray:
    """Slots of one request's ``positions`` on rank ``dcp_rank`` (``PAD`` = not stored here).

    ``block_table`` is the request's row of KV-manager block ids. ``positions``
    may be any int array. A ``range`` with step 1, or an array of consecutive
    increasing positions, takes a fast path that only writes this rank's runs of
    ``I`` positions (the rest stays PAD).
    Ownership is always computed in KV-block coordinates (``B * W``), never in
    kernel-block coordinates.
    """
    validate_layout(
        block_size=block_size,
        dcp_size=dcp_size,
        interleave_size=interleave_size,
        kernel_block_size=kernel_block_size,
        replicated=replicated,
    )
    _check_rank(dcp_size, dcp_rank)
    bt = np.asarray(block_table, dtype=np.int64)
    if bt.ndim != 1:
        raise ValueError(f"block_table must be one request's row (1-D), got shape {bt.shape}")
    sharded = dcp_size > 1 and not replicated
    span = block_size * (dcp_size if sharded else 1)
    pos, rng = _as_positions(positions)
    if rng is not None:
        if len(rng) == 0:
            return np.empty(0, dtype=np.int64)
        _check_span(rng.start, rng.stop - 1, span, len(bt))
        if sharded:
            return _sharded_range(rng, bt, block_size, dcp_size, dcp_rank, interleave_size)
        return _plain_range(rng, bt, block_size)
    if pos.size == 0:
        return np.empty(0, dtype=np.int64)
    _check_span(int(pos.min()), int(pos.max()), span, len(bt))
    return _general(pos, bt, block_size, dcp_size, dcp_rank, interleave_size, sharded)


def _general(pos, bt, B, W, r, I, sharded) -> np.ndarray:
    """Any positions: integer ops on fresh buffers, few passes, no kernel-table expansion.

    Kernel blocks never move a slot (see ``_sharded_range``), so ``Bk`` plays no part.
    (The naive masked version computes owner, offset and slot for every position and
    then masks; this one is 3-4x faster on shuffled positions, see the benchmark.)
    Sharded: ``vb = p // (B*W)``; the offset ``p - vb*B*W`` indexes a table of one
    virtual block's local offsets on rank ``r``, where the offsets of other ranks hold a
    sentinel so negative that ``bt[vb]*B + sentinel < 0``; a clamp at ``PAD`` then marks
    them, with no boolean mask over the positions.
    Plain: ``bt[vb]*B + p % B`` with ``vb = p // B``. A power-of-two ``B*W`` (or ``B``)
    divides by a shift and a mask.
    """
    if not sharded:  # slot = bt[vb] * B + p % B: the table scaled once (it is short), then 4 passes
        if B & (B - 1) == 0:
            vb, off = np.right_shift(pos, B.bit_length() - 1), np.bitwise_and(pos, B - 1)
        else:
            vb, off = np.divmod(pos, B)
        slots = np.take(bt * B, vb, out=vb, mode="clip")  # in range: _check_span; "clip" skips a bounds pass
        slots += off
        return slots
    span = B * W
    sentinel = -(int(np.abs(bt).max()) + 1) * B - 1
    owned = _local_offsets(B, W, I, r)
    local = np.where(owned >= 0, owned, sentinel)
    if span & (span - 1) == 0:  # B and W powers of two (the usual case): a shift and a mask
        vb = np.right_shift(pos, span.bit_length() - 1)
        off = np.bitwise_and(pos, span - 1)
    else:
        vb, off = np.divmod(pos, span)
    # both lookups write over their own index array (read before written, one element at a
    # time): two buffers in all; "clip" skips a bounds pass (indices checked by _check_span)
    np.take(local, off, out=off, mode="clip")
    slots = np.take(bt * B, vb, out=vb, mode="clip")
    if bt.min() < 0:  # not a real block id, but then the clamp could hide a slot: mask instead
        owned = off >= 0
        slots += off
        slots[~owned] = PAD
        return slots
    slots += off
    np.maximum(slots, PAD, out=slots)
    return slots


def _plain_range(rng: range, bt: np.ndarray, B: int) -> np.ndarray:
    """Contiguous positions, plain geometry: whole blocks at a time."""
    first_block = rng.start // B
    last_block = (rng.stop - 1) // B
    blocks = bt[first_block : last_block + 1]
    grid = blocks[:, None] * B + np.arange(B, dtype=np.int64)[None, :]
    lo = rng.start - first_block * B
    return grid.reshape(-1)[lo : lo + len(rng)]


def _sharded_range(rng: range, bt: np.ndarray, B: int, W: int, r: int, I: int) -> np.ndarray:
    """Contiguous positions, sharded: fill PAD, then write only rank r's runs.

    Positions are grouped in rounds of ``W * I``; in round ``m`` rank ``r`` owns
    the run ``[m*W*I + r*I, m*W*I + (r+1)*I)`` and stores it at local offsets
    ``(m % (B // I)) * I + [0, I)`` of virtual block ``m // (B // I)``.
    (Kernel-block expansion does not move a slot: kernel block ``b*k + j`` at
    offset ``t`` is slot ``b*B + j*Bk + t``, so the fast path needs no Bk.)
    """
    round_len = W * I
    first_round = rng.start // round_len
    last_round = (rng.stop - 1) // round_len
    n_rounds = last_round - first_round + 1
    buf = np.empty(n_rounds * round_len, dtype=np.int64)
    buf.fill(PAD)
    rounds = np.arange(first_round, last_round + 1, dtype=np.int64)
    runs_per_block = B // I
    vb, run_in_block = np.divmod(rounds, runs_per_block)
    base = bt[vb] * B + run_in_block * I
    view = buf.reshape(n_rounds, W, I)[:, r, :]
    np.add(base[:, None], np.arange(I, dtype=np.int64)[None, :], out=view)
    lo = rng.start - first_round * round_len
    return buf[lo : lo + len(rng)]


def runs_slot_mapping(
    starts, stops, block_rows, *, block_size: int, dcp_size: int = 1, dcp_rank: int = 0, interleave_size: int = 1, replicated: bool = False
):
    """``slot_mapping`` of several requests' runs ``[starts[i], stops[i])`` at once (a
    step's writes in one group; ``block_rows[i]``: request ``i``'s row), concatenated:
    ``(slots, positions, ends)``, run ``i`` being ``[ends[i - 1], ends[i])`` of both.
    The caller has validated the layout and checked that each row covers its run (what
    ``slot_mapping`` does per call); the formulas are ``_general``'s over every run."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(stops, dtype=np.int64) - starts
    ends = lengths.cumsum()
    total = int(ends[-1]) if len(ends) else 0
    req = np.arange(len(lengths), dtype=np.int64).repeat(lengths)
    pos = (starts - ends + lengths)[req] + np.arange(total, dtype=np.int64)
    table = np.zeros((len(lengths), max((len(r) for r in block_rows), default=1) or 1), dtype=np.int64)
    for i, row in enumerate(block_rows):
        table[i, : len(row)] = row
    B, W, I = block_size, dcp_size, interleave_size
    if replicated or W == 1:
        vb, off = np.divmod(pos, B)
        return table[req, vb] * B + off, pos, ends
    vb, off = np.divmod(pos, B * W)
    local = _local_offsets(B, W, I, dcp_rank)[off]
    return np.where(local >= 0, table[req, vb] * B + local, PAD), pos, ends


@functools.lru_cache(maxsize=256)
def _local_offsets(B: int, W: int, I: int, r: int) -> np.ndarray:
    """Rank ``r``'s local offset of each offset of a virtual block (``B * W``), -1 where
    another rank stores it (read-only: shared by every call)."""
    off = np.arange(B * W, dtype=np.int64)
    local = np.where((off // I) % W == r, (off // (W * I)) * I + off % I, -1)
    local.flags.writeable = False
    return local


def local_seq_lens(seq_lens, *, dcp_size: int, interleave_size: int = 1, dcp_rank: int | None = None) -> np.ndarray:
    """Number of positions ``< L`` that a rank stores, for each sequence length ``L``.

    Returns a vector for one rank, or a matrix ``[num_reqs, dcp_size]`` when
    ``dcp_rank`` is None.
    """
    # Only W and I matter here; block_size=1 with replicated=True skips the I <= B checks
    # (a block_size equal to I would report an invalid I as an invalid block_size).
    validate_layout(block_size=1, dcp_size=dcp_size, interleave_size=interleave_size, replicated=True)
    lens = np.asarray(seq_lens, dtype=np.int64)
    if lens.size and lens.min() < 0:
        raise ValueError("seq_lens must be >= 0")
    W, I = dcp_size, interleave_size
    base = (lens // (I * W)) * I
    # np.minimum(np.maximum(.)) is np.clip without its wrapper's cost on short arrays
    if dcp_rank is None:
        ranks = np.arange(W, dtype=np.int64)
        return base[..., None] + np.minimum(np.maximum(lens[..., None] - base[..., None] * W - ranks * I, 0), I)
    _check_rank(W, dcp_rank)
    return base + np.minimum(np.maximum(lens - base * W - dcp_rank * I, 0), I)


def query_local_seq_lens(
    history_len: int,
    num_query_tokens: int,
    *,
    dcp_size: int,
    dcp_rank: int,
    interleave_size: int = 1,
) -> np.ndarray:
    """Local KV bound of each query token of a multi-token step on one rank.

    Query token ``j`` (history ``H`` before the step) sees global length
    ``H + j + 1`` and so ``local(H + j + 1, r)`` local positions. This is not
    ``local(H + q, r) - (q - 1 - j)``: the two differ under interleaving.
    """
    if history_len < 0 or num_query_tokens < 0:
        raise ValueError("history_len and num_query_tokens must be >= 0")
    lens = history_len + 1 + np.arange(num_query_tokens, dtype=np.int64)
    return local_seq_lens(lens, dcp_size=dcp_size, interleave_size=interleave_size, dcp_rank=dcp_rank)


# --- compressed records (tokens_per_state = R > 1) ---------------------------------


def records_emitted(start: int, stop: int, tokens_per_state: int) -> np.ndarray:
    """Record indices emitted by writing positions ``[start, stop)``.

    Record ``c`` is emitted at position ``(c + 1) * R - 1``.
    """
    R = tokens_per_state
    return np.arange(start // R, stop // R, dtype=np.int64)


def record_emit_positions(records, tokens_per_state: int) -> np.ndarray:
    """The position whose write emits each record."""
    return (np.asarray(records, dtype=np.int64) + 1) * tokens_per_state - 1


def record_slot_mapping(
    records,
    block_table,
    *,
    block_size: int,
    tokens_per_state: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave_size: int = 1,
    kernel_block_size: int | None = None,
    replicated: bool = False,
) -> np.ndarray:
    """Slots of compressed records: a page of ``B`` tokens holds ``B // R`` records.

    Under DCP a sharded compressed cache assigns records (not tokens) to ranks:
    owner ``(c // I) % W``, inside virtual blocks of ``(B // R) * W`` records.
    """
    R = tokens_per_state
    check_int("tokens_per_state", R)
    if block_size % R:
        raise ConfigError(f"block_size ({block_size}) must be a multiple of tokens_per_state ({R})")
    kbs = None
    if kernel_block_size is not None:
        if kernel_block_size % R:
            raise ConfigError(f"kernel_block_size ({kernel_block_size}) must be a multiple of tokens_per_state ({R})")
        kbs = kernel_block_size // R
    return slot_mapping(
        records,
        block_table,
        block_size=block_size // R,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave_size=interleave_size,
        kernel_block_size=kbs,
        replicated=replicated,
    )


# --- compressor ring (CircularBufferSpec) ---------------------------------------------


def ring_states_to_write(start: int, stop: int, capacity: int) -> np.ndarray:
    """States of ``[start, stop)`` a ring of ``capacity`` rows must write: the last ``capacity``."""
    return np.arange(max(start, stop - capacity), stop, dtype=np.int64)


def ring_slot_mapping(states, block_id: int, capacity: int) -> np.ndarray:
    """State ``s`` of a ring lives at ``block_id * C + s % C``."""
    if capacity < 1:
        raise ConfigError(f"ring capacity must be >= 1, got {capacity}")
    return block_id * capacity + np.asarray(states, dtype=np.int64) % capacity


# --- Mamba / linear-attention recurrent state (MambaSpec) -------------------------------


def state_writes(start: int, stop: int, num_drafts: int, *, block_size: int, align: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, columns)`` of the states a step of ``[start, stop)`` writes: the state
    after ``positions[i]`` goes to block-table column ``columns[i]``.

    A prefill chunk (more than one true token) writes one state, after its last token, at
    the base column; a decode step (one true token and ``num_drafts`` drafts) writes the
    state after each of its tokens, token ``j`` at ``base + j`` (vLLM's speculative state
    blocks). The base column is 0 in ``none`` mode and ``(stop - 1) // block_size`` (the
    block holding the step's last token) in ``align`` mode.
    """
    base = (stop - 1) // block_size if align else 0
    if stop - start - num_drafts > 1:
        return np.array([stop - 1], dtype=np.int64), np.array([base], dtype=np.int64)
    positions = np.arange(start, stop, dtype=np.int64)
    return positions, base + positions - start


def state_slot_mapping(columns, block_table) -> np.ndarray:
    """A state page holds one state: the slot of column ``c`` is ``block_table[c]``;
    a column past the row reads the null block 0, as vLLM's zero-padded table does."""
    bt = np.asarray(block_table, dtype=np.int64)
    cols = np.asarray(columns, dtype=np.int64)
    short = max(0, int(cols.max(initial=-1)) + 1 - len(bt))
    return np.concatenate([bt, np.zeros(short, dtype=np.int64)])[cols]
