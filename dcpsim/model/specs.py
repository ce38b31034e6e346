"""KV-cache specs: frozen dataclasses named and shaped as in vLLM v1.

A spec describes one attention layer's cache (or, for ``UniformTypeKVCacheSpecs``,
the layers of one KV-cache group). Every spec answers its page size, how many
block-table entries a request needs, and the worst-case memory one request can
use, under DCP sharding or ``dcp_replicated``.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fractions import Fraction

from dcpsim.errors import ConfigError
from dcpsim.model.arith import cdiv
from dcpsim.model.config import SimConfig
from dcpsim.model.validate import check_int

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
    "uint8": 1,
}


def get_block_table_width(max_num_blocks: int, block_size: int, *, token_alignment: int | None = 128) -> int:
    """Entries of a worker block-table row: ``max_num_blocks`` rounded up so the row spans
    a multiple of ``token_alignment`` tokens (vLLM 0.33.0 aligns rows to 128 tokens for
    attention kernels; ``None`` keeps the count, e.g. for rings and Mamba state)."""
    if token_alignment is None:
        return max_num_blocks
    if token_alignment <= 0:
        raise ConfigError(f"token_alignment must be positive, got {token_alignment}")
    unit = token_alignment // math.gcd(token_alignment, block_size)  # entries per aligned span
    return cdiv(max_num_blocks, unit) * unit


def _check_padded_page(spec, name: str) -> None:
    """``page_size_padded``, when set, is positive and at least the real page."""
    if spec.page_size_padded is not None:
        _positive_int(name, "page_size_padded", spec.page_size_padded)
        if spec.page_size_padded < spec.real_page_size_bytes:
            raise ConfigError(
                f"{name}.page_size_padded ({spec.page_size_padded}) must be >= the real page size ({spec.real_page_size_bytes})"
            )


def _positive_int(owner: str, name: str, value) -> None:
    check_int(f"{owner}.{name}", value)


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of every spec: the KV-manager block size ``B`` in tokens."""

    block_size: int

    def __post_init__(self) -> None:
        _positive_int(type(self).__name__, "block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_num_blocks_per_req(self, config: SimConfig, max_len: int) -> int:
        raise NotImplementedError

    @property
    def block_table_token_alignment(self) -> int | None:
        """Tokens a block-table row is aligned to (``get_block_table_width``)."""
        return 128

    def block_table_width(self, config: SimConfig, max_len: int) -> int:
        """Entries of the worker's block-table row: ``max_num_blocks_per_req``, aligned."""
        return get_block_table_width(
            self.max_num_blocks_per_req(config, max_len), self.block_size, token_alignment=self.block_table_token_alignment
        )

    def max_memory_usage_bytes(self, config: SimConfig) -> int:
        raise NotImplementedError

    def is_same_kind(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Whether every spec in ``kv_cache_specs`` may share a group with this one."""
        raise NotImplementedError

    @classmethod
    def merge(cls, specs: list[KVCacheSpec]) -> KVCacheSpec:
        """Merge the layer specs of one group into a single spec.

        The specs must be of one kind and one geometry; the result keeps every
        field of the first, ``dcp_replicated`` included (a merge that dropped it
        would silently turn a replicated group into a sharded one).
        """
        if not specs:
            raise ConfigError("cannot merge an empty list of specs")
        first = specs[0]
        named = {str(i): s for i, s in enumerate(specs)}
        if not first.is_same_kind(named):
            raise ConfigError(f"cannot merge specs of different kinds into one group: {_kinds(specs)}")
        for other in specs[1:]:
            for f in dataclasses.fields(first):
                if getattr(other, f.name) != getattr(first, f.name):
                    raise ConfigError(
                        f"cannot merge {type(first).__name__} specs: field {f.name} differs "
                        f"({getattr(first, f.name)!r} vs {getattr(other, f.name)!r})"
                    )
        values = {f.name: getattr(first, f.name) for f in dataclasses.fields(first)}
        return type(first)(**values)


def _kinds(specs) -> str:
    return ", ".join(f"{type(s).__name__}(dcp_replicated={getattr(s, 'dcp_replicated', None)})" for s in specs)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer's paged cache.

    Page bytes are ``H * N * C`` with ``H = num_head_slots or num_kv_heads``,
    ``N = block_size / tokens_per_state`` states per page and
    ``C = state_content_bytes or (head_size + head_size_v) * dtype bytes``;
    ``page_size_padded`` replaces the result when set.
    """

    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    head_size_v: int | None = None
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    tokens_per_state: int | Fraction = 1
    dcp_replicated: bool = False
    """DCP: every rank holds the layer's full KV instead of a 1/W shard; the
    group keeps its plain block geometry and every rank writes every position."""

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _positive_int(name, "num_kv_heads", self.num_kv_heads)
        _positive_int(name, "head_size", self.head_size)
        check_int(f"{name}.head_size_v", self.head_size_v, 0)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"{name}.dtype {self.dtype!r} is not known; use one of {sorted(DTYPE_BYTES)}")
        if not isinstance(self.dcp_replicated, bool):
            raise ConfigError(f"{name}.dcp_replicated must be true or false, got {self.dcp_replicated!r}")
        for opt in ("num_head_slots", "state_content_bytes"):
            if getattr(self, opt) is not None:
                _positive_int(name, opt, getattr(self, opt))
        tps = self.tokens_per_state
        if isinstance(tps, bool) or not isinstance(tps, (int, Fraction)) or tps <= 0:
            raise ConfigError(f"{name}.tokens_per_state must be a positive int or Fraction, got {tps!r}")
        if isinstance(tps, Fraction) and tps.denominator == 1:
            object.__setattr__(self, "tokens_per_state", int(tps))
        n = Fraction(self.block_size) / Fraction(self.tokens_per_state)
        if n.denominator != 1:
            raise ConfigError(
                f"{name}: block_size ({self.block_size}) must hold a whole number of states (tokens_per_state={self.tokens_per_state})"
            )
        _check_padded_page(self, name)

    @property
    def states_per_block(self) -> int:
        return int(Fraction(self.block_size) / Fraction(self.tokens_per_state))

    @property
    def real_page_size_bytes(self) -> int:
        heads = self.num_head_slots or self.num_kv_heads
        content = self.state_content_bytes or ((self.head_size + self.head_size_v) * DTYPE_BYTES[self.dtype])
        return heads * self.states_per_block * content

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.real_page_size_bytes

    def kv_shard_count(self, config: SimConfig) -> int:
        """How many ranks split this layer's positions: 1 when replicated."""
        return 1 if self.dcp_replicated else config.decode_context_parallel_size

    def max_num_blocks_per_req(self, config: SimConfig, max_len: int) -> int:
        return cdiv(max_len, self.block_size * self.kv_shard_count(config))

    def _same_fields(self, spec: KVCacheSpec, *names: str) -> bool:
        return isinstance(spec, type(self)) and all(getattr(spec, n) == getattr(self, n) for n in ("dcp_replicated", *names))


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Keeps every position. Sharded by default under DCP."""

    def max_memory_usage_bytes(self, config: SimConfig) -> int:
        max_model_len = config.max_model_len
        if config.decode_context_parallel_size > 1 and not self.dcp_replicated:
            max_model_len = cdiv(max_model_len, config.decode_context_parallel_size)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    def is_same_kind(self, kv_cache_specs) -> bool:
        # MLA and plain full attention are both "full"; a group never mixes
        # replicated and sharded layers, nor compression ratios.
        return all(
            isinstance(s, FullAttentionSpec) and s.dcp_replicated == self.dcp_replicated and s.tokens_per_state == self.tokens_per_state
            for s in kv_cache_specs.values()
        )


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent "head", no separate V."""

    num_kv_heads: int = 1
    head_size_v: int | None = 0
    cache_dtype_str: str | None = None
    alignment: int | None = None
    """Pad the page to a multiple of this many bytes (DeepSeek-V4: 576 for the
    fp8_ds_mla layout, 512 otherwise); sets ``page_size_padded``."""
    qk_rope_head_dim: int = 64
    """The rope part of the latent entry (vLLM's and SGLang's ``qk_rope_head_dim``), the end
    of the entry: DeepSeek's 64 of 576 (``kv_lora_rank`` 512 + 64); 0 for a model whose entry
    has no rope part (GLM-5.3-Flash). No page size depends on it (``head_size`` is the whole
    entry); SGLang writes an entry without one with another kernel
    (``set_mla_kv_buffer_kernel_norope``)."""

    def __post_init__(self) -> None:
        if self.alignment is not None:  # derived below (a rebuilt spec's old value is stale)
            object.__setattr__(self, "page_size_padded", None)
        super().__post_init__()
        check_int(f"{type(self).__name__}.qk_rope_head_dim", self.qk_rope_head_dim, 0)
        _apply_alignment_padding(self)


@dataclass(frozen=True, kw_only=True)
class SparseMLAAttentionSpec(MLAAttentionSpec):
    """An MLA cache read by sparse attention (DeepSeek-V3.2's DSA): each query token attends
    to the ``index_topk`` keys the model's indexer scores highest (``IndexerSpec``), not to
    its whole context. The cache itself is an MLA cache (vLLM: ``MLAAttentionSpec``); only
    the attention over it differs (semantics section 14)."""

    index_topk: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(f"{type(self).__name__}.index_topk", self.index_topk)


@dataclass(frozen=True, kw_only=True)
class IndexerSpec(MLAAttentionSpec):
    """The lightning indexer's K cache of sparse attention: one ``head_size``-wide key per
    position (DeepSeek-V3.2: 128, plus a scale per 128 in fp8), shared by ``index_n_heads``
    indexer query heads. vLLM stores it as an ``MLAAttentionSpec`` (sharded like the MLA
    cache under DCP); SGLang keeps it replicated in the global slot space
    (``dcp_replicated = true``). No softmax reads it: it only scores keys."""

    index_n_heads: int = 64
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(f"{type(self).__name__}.index_n_heads", self.index_n_heads)


def _apply_alignment_padding(spec) -> None:
    """``page_size_padded = round_up(real page, alignment)`` (vLLM 0.33.0's MLA rule). With
    ``alignment`` set the padded page is derived, so a spec rebuilt with another block size
    (``dataclasses.replace``) gets its own; the scenario loader refuses both fields given."""
    if spec.alignment is None:
        return
    _positive_int(type(spec).__name__, "alignment", spec.alignment)
    padded = cdiv(spec.real_page_size_bytes, spec.alignment) * spec.alignment
    object.__setattr__(spec, "page_size_padded", None if padded == spec.real_page_size_bytes else padded)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Needs only the last ``sliding_window`` positions (plus ``extra_retained_tokens``)."""

    sliding_window: int
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int(type(self).__name__, "sliding_window", self.sliding_window)
        check_int(f"{type(self).__name__}.extra_retained_tokens", self.extra_retained_tokens, 0)

    def max_admission_blocks_per_request(self, *, max_in_flight_tokens: int, max_model_len: int) -> int:
        tokens = min(
            self.sliding_window - 1 + self.extra_retained_tokens + max_in_flight_tokens,
            max_model_len,
        )
        # +1: a window that does not start on a block boundary straddles one more block.
        return cdiv(tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, config: SimConfig) -> int:
        if config.decode_context_parallel_size > 1 and not self.dcp_replicated:
            raise ConfigError(
                f"{type(self).__name__}: DCP (decode_context_parallel_size="
                f"{config.decode_context_parallel_size}) does not support a sharded sliding "
                "window; mark the spec dcp_replicated"
            )
        blocks = self.max_admission_blocks_per_request(max_in_flight_tokens=config.max_in_flight_tokens, max_model_len=config.max_model_len)
        return blocks * self.page_size_bytes

    def first_needed_position(self, num_committed: int) -> int:
        """Positions below this are no longer needed after ``num_committed`` tokens."""
        return max(0, num_committed - self.sliding_window + 1 - self.extra_retained_tokens)

    def is_same_kind(self, kv_cache_specs) -> bool:
        return all(self._same_fields(s, "sliding_window", "extra_retained_tokens") for s in kv_cache_specs.values())


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window cache of MLA latents (DeepSeek-V4.1's per-layer SWA cache)."""

    num_kv_heads: int = 1
    head_size_v: int | None = 0
    cache_dtype_str: str | None = None
    alignment: int | None = None
    """As ``MLAAttentionSpec.alignment``."""

    def __post_init__(self) -> None:
        if self.alignment is not None:  # derived below (a rebuilt spec's old value is stale)
            object.__setattr__(self, "page_size_padded", None)
        super().__post_init__()
        _apply_alignment_padding(self)


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attends within fixed chunks of ``attention_chunk_size`` positions."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int(type(self).__name__, "attention_chunk_size", self.attention_chunk_size)

    def max_memory_usage_bytes(self, config: SimConfig) -> int:
        tokens = min(self.attention_chunk_size + config.max_in_flight_tokens, config.max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size_bytes

    def first_needed_position(self, num_committed: int) -> int:
        return (num_committed // self.attention_chunk_size) * self.attention_chunk_size

    def is_same_kind(self, kv_cache_specs) -> bool:
        return all(self._same_fields(s, "attention_chunk_size") for s in kv_cache_specs.values())


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """A compressor ring: one block per request for its whole life.

    ``block_size`` is the ring capacity ``C``; state ``s`` lives at
    ``block * C + s % C``. Never prefix-cached.
    """

    @property
    def capacity(self) -> int:
        return self.block_size

    def max_num_blocks_per_req(self, config: SimConfig, max_len: int) -> int:
        return 1

    @property
    def block_table_token_alignment(self) -> int | None:
        return None  # one entry for life: never widened

    def max_memory_usage_bytes(self, config: SimConfig) -> int:
        return self.page_size_bytes

    def is_same_kind(self, kv_cache_specs) -> bool:
        return all(self._same_fields(s) for s in kv_cache_specs.values())


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Several layer specs of one kind sharing a group (their pages may differ).

    One block size, one kind, one ``dcp_replicated``; the group page is the sum
    of the layer pages.
    """

    kv_cache_specs: dict[str, KVCacheSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.kv_cache_specs:
            raise ConfigError("UniformTypeKVCacheSpecs needs at least one layer spec")
        if not self.is_uniform_type(self.kv_cache_specs):
            raise ConfigError(
                "UniformTypeKVCacheSpecs: layers are not of one kind, block size and "
                f"dcp_replicated: {_kinds(self.kv_cache_specs.values())}"
            )
        sizes = {s.block_size for s in self.kv_cache_specs.values()}
        if sizes != {self.block_size}:
            raise ConfigError(
                f"UniformTypeKVCacheSpecs.block_size ({self.block_size}) differs from its layers' block sizes {sorted(sizes)}"
            )

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        specs = list(kv_cache_specs.values())
        if not specs or any(isinstance(s, UniformTypeKVCacheSpecs) for s in specs):
            return False
        first = specs[0]
        return (
            len({s.block_size for s in specs}) == 1
            and all(type(s) is type(first) for s in specs)
            and first.is_same_kind(kv_cache_specs)
            and all(getattr(s, "dcp_replicated", None) == getattr(first, "dcp_replicated", None) for s in specs)
        )

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=dict(kv_cache_specs))

    @property
    def first(self) -> KVCacheSpec:
        return next(iter(self.kv_cache_specs.values()))

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    @property
    def block_table_token_alignment(self) -> int | None:
        return self.first.block_table_token_alignment

    def max_num_blocks_per_req(self, config: SimConfig, max_len: int) -> int:
        """One block table serves every layer, so every layer must need the same width
        (vLLM 0.33.0 asserts it; taking the max would size the table wider than the
        per-layer metadata builders expect)."""
        widths = {s.max_num_blocks_per_req(config, max_len) for s in self.kv_cache_specs.values()}
        if len(widths) != 1:
            raise ConfigError(
                "UniformTypeKVCacheSpecs: the layers of one KV-cache group need different "
                f"block-table widths {sorted(widths)} (layers {sorted(self.kv_cache_specs)})"
            )
        return widths.pop()

    def max_memory_usage_bytes(self, config: SimConfig) -> int:
        """Every layer gets the same number of pages (one block id addresses a page in
        each): the most any layer needs, times the group page (vLLM 0.33.0's rule)."""
        pages = max(cdiv(s.max_memory_usage_bytes(config), s.page_size_bytes) for s in self.kv_cache_specs.values())
        return pages * self.page_size_bytes

    def is_same_kind(self, kv_cache_specs) -> bool:
        return all(
            isinstance(s, UniformTypeKVCacheSpecs) and s.block_size == self.block_size and self.first.is_same_kind(s.kv_cache_specs)
            for s in kv_cache_specs.values()
        )


def iter_layer_specs(kv_cache_spec: KVCacheSpec) -> list[KVCacheSpec]:
    """The layer specs a group spec stands for (itself, unless uniform-type)."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        return list(kv_cache_spec.kv_cache_specs.values())
    return [kv_cache_spec]


def is_dcp_replicated_spec(kv_cache_spec: KVCacheSpec) -> bool:
    """Every layer is an attention spec marked ``dcp_replicated``, or a Mamba state
    (replicated by nature)."""
    layers = iter_layer_specs(kv_cache_spec)
    return bool(layers) and all((isinstance(s, AttentionSpec) and s.dcp_replicated) or isinstance(s, MambaSpec) for s in layers)


def is_dcp_sharded_spec(kv_cache_spec: KVCacheSpec) -> bool:
    """Every layer is full attention (MLA included) and not replicated."""
    layers = iter_layer_specs(kv_cache_spec)
    return bool(layers) and all(isinstance(s, FullAttentionSpec) and not s.dcp_replicated for s in layers)


MAMBA_CACHE_MODES = ("none", "align")
"""vLLM's ``mamba_cache_mode``: ``none`` (no prefix caching of the state; one block holds
a request's whole state) or ``align`` (state blocks indexed by position, ``block_size``
tokens each, for prefix-cache checkpoints at block boundaries)."""

MAMBA_TYPES = ("mamba1", "mamba2", "short_conv", "linear", "gdn_attn")
"""vLLM's ``MambaAttentionBackendEnum`` members, lower case (metadata only)."""


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """The recurrent state of a Mamba or linear-attention (Gated DeltaNet) layer.

    A page is one state: the layer's state tensors (``shapes`` with ``dtypes``, e.g. a
    conv state and an SSM state), ``page_size_padded`` bytes when set. The state
    summarises the whole prefix, so it is replicated on every DCP rank and never sharded;
    the manager block size is never scaled by ``W``. A request holds one state block plus
    ``num_speculative_blocks`` (one per speculative token); in ``align`` mode the block
    table is indexed by position (``cdiv(max_len, block_size)`` entries, only the last
    ``1 + num_speculative_blocks`` of them holding blocks). ``block_size`` is vLLM's
    ``mamba_block_size``: ``max_model_len`` in ``none`` mode.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        shapes = self.shapes
        if (
            not isinstance(shapes, (list, tuple))
            or not shapes
            or not all(
                isinstance(s, (list, tuple)) and s and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in s)
                for s in shapes
            )
        ):
            raise ConfigError(
                f"{name}.shapes must be a non-empty list of state shapes, each a non-empty list of "
                f"integers >= 1 (e.g. [[3, 8192], [32, 128, 128]]), got {shapes!r}"
            )
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in shapes))
        dtypes = self.dtypes
        if not isinstance(dtypes, (list, tuple)) or len(dtypes) != len(self.shapes):
            raise ConfigError(f"{name}.dtypes must list one dtype per state shape ({len(self.shapes)}), got {dtypes!r}")
        for d in dtypes:
            if not isinstance(d, str) or d not in DTYPE_BYTES:
                raise ConfigError(f"{name}.dtypes entry {d!r} is not known; use one of {sorted(DTYPE_BYTES)}")
        object.__setattr__(self, "dtypes", tuple(dtypes))
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ConfigError(f"{name}.mamba_cache_mode must be one of {list(MAMBA_CACHE_MODES)}, got {self.mamba_cache_mode!r}")
        if self.mamba_type not in MAMBA_TYPES:
            raise ConfigError(f"{name}.mamba_type must be one of {list(MAMBA_TYPES)}, got {self.mamba_type!r}")
        check_int(f"{name}.num_speculative_blocks", self.num_speculative_blocks, 0)
        _check_padded_page(self, name)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of the state tensors (vLLM's ``state_content_size_bytes``)."""
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = 1
            for d in shape:
                n *= d
            total += n * DTYPE_BYTES[dtype]
        return total

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.real_page_size_bytes

    @property
    def dcp_replicated(self) -> bool:
        """Always: a recurrent state summarises the whole prefix and cannot be split."""
        return True

    @property
    def num_state_blocks(self) -> int:
        """Blocks holding states at once: the running state and the speculative ones."""
        return 1 + self.num_speculative_blocks

    def check_config(self, config: SimConfig) -> None:
        """What vLLM fixes about a Mamba spec from the engine config."""
        name = type(self).__name__
        if self.mamba_cache_mode == "none" and self.block_size < config.max_model_len:
            raise ConfigError(
                f"{name}.block_size ({self.block_size}) must be >= max_model_len ({config.max_model_len}) "
                "in mamba_cache_mode 'none': one block holds a request's whole state (vLLM sets "
                "mamba_block_size = max_model_len); leave block_size out"
            )
        if self.num_speculative_blocks != config.num_speculative_tokens:
            raise ConfigError(
                f"{name}.num_speculative_blocks ({self.num_speculative_blocks}) must equal "
                f"num_speculative_tokens ({config.num_speculative_tokens}): vLLM gives a Mamba layer one "
                "state block per speculative token; leave it out"
            )

    def max_memory_usage_bytes(self, config: SimConfig) -> int:
        # align: the state being read (the previous step's) and the new one, plus drafts
        resident = self.num_state_blocks + (self.mamba_cache_mode == "align")
        return resident * self.page_size_bytes

    @property
    def block_table_token_alignment(self) -> int | None:
        return None  # no slot mapping: rows are never widened (vLLM 0.33.0)

    def max_num_blocks_per_req(self, config: SimConfig, max_len: int) -> int:
        # never scaled by W: the state is replicated on every DCP rank
        if self.mamba_cache_mode == "align":
            return cdiv(max_len, self.block_size) + self.num_speculative_blocks
        return cdiv(self.max_memory_usage_bytes(config), self.page_size_bytes)

    def is_same_kind(self, kv_cache_specs) -> bool:
        return all(
            isinstance(s, MambaSpec)
            and (s.block_size, s.mamba_cache_mode, s.num_speculative_blocks)
            == (self.block_size, self.mamba_cache_mode, self.num_speculative_blocks)
            for s in kv_cache_specs.values()
        )
