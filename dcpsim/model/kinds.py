"""How a spec's cache is stored and what it retains: facts of the spec type, named once.

``Storage``: ``paged`` (one state per token), ``records`` (compressed: one record per
``tokens_per_state = R`` tokens), ``ring`` (a compressor ring, ``CircularBufferSpec``) or
``state`` (a Mamba / linear-attention recurrent state, ``MambaSpec``: one state per block,
overwritten every step).
``Retention``: ``full`` (every position), ``window`` (sliding window), ``chunk``
(chunked local), ``ring`` or ``state`` (only the state after the last committed token).
Both sides of the harness classify specs with these two functions; neither derives any
geometry here.
"""

from __future__ import annotations

import enum

from dcpsim.errors import ConfigError
from dcpsim.model.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)


class Storage(enum.StrEnum):
    PAGED = "paged"
    RECORDS = "records"
    RING = "ring"
    STATE = "state"


class Retention(enum.StrEnum):
    FULL = "full"
    WINDOW = "window"
    CHUNK = "chunk"
    RING = "ring"
    STATE = "state"


def storage_of(spec: KVCacheSpec) -> Storage:
    """How a layer spec's cache is stored; refuses what the harness does not simulate."""
    if isinstance(spec, CircularBufferSpec):
        return Storage.RING
    if isinstance(spec, MambaSpec):
        return Storage.STATE
    tps = spec.tokens_per_state
    if not isinstance(tps, int):
        raise ConfigError(
            f"{type(spec).__name__}: tokens_per_state={tps} (several states per token) is "
            "modelled in page sizes only; the harness does not simulate it"
        )
    if tps > 1 and retention_of(spec) is not Retention.FULL:
        raise ConfigError(f"{type(spec).__name__}: compressed records are simulated for full attention only")
    return Storage.RECORDS if tps > 1 else Storage.PAGED


def retention_of(spec: KVCacheSpec) -> Retention:
    if isinstance(spec, CircularBufferSpec):
        return Retention.RING
    if isinstance(spec, MambaSpec):
        return Retention.STATE
    if isinstance(spec, SlidingWindowSpec):
        return Retention.WINDOW
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return Retention.CHUNK
    return Retention.FULL


def records_per_state(spec: KVCacheSpec) -> int:
    """Tokens per stored state as the harness simulates it: ``R`` for records, else 1."""
    return spec.tokens_per_state if storage_of(spec) is Storage.RECORDS else 1
