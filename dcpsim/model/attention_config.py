"""Options of the attention-level check (``--attention``): one object, validated once.

Picklable and part of a ``Job`` (``Job.attention``, a branch of the option tree,
``dcpsim.options``): the engine's attention reads the head counts, LSE base and merge
variant, the checker reads the tolerance and the sampling budget. The fields after
``max_step_keys`` are no run options: tests and benchmarks set them on the object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.validate import check_int
from dcpsim.options import option

LSE_BASES = ("e", "2")
MERGE_VARIANTS = ("allgather", "alltoall", "alternate")

DEFAULT_TOLERANCE = 1e-4
"""Max abs error allowed between the merged float32 result and the float64 reference,
on every output element and on the LSE.

Why 1e-4: vector entries have unit variance and |entry| <= sqrt(3), so output entries are
convex combinations bounded by 1.8, and logits (query gain 2 / sqrt(head_dim)) stay within
a few tens. float32 carries ~6e-8 relative error per operation; a softmax over <= 4096 keys,
an LSE of magnitude <= ~40 and a merge over <= 8 shards accumulate a few 1e-6 at worst
(observed: ~1e-6, see the README). 1e-4 leaves a margin of ~50x, while dropping or adding a
single key of a context of thousands moves the output by ~1e-3 (its weight ~1/n times
|v - o| ~ 1), and a wrong lse of an empty shard moves it by O(1)."""


DEFAULT_MAX_STEP_KEYS = 2**18
"""See ``AttentionConfig.max_step_keys``."""


@dataclass(frozen=True)
class AttentionConfig:
    enabled: bool = option(
        False,
        "also store K/V vectors and check every step's decode attention: per-rank attention over the local "
        "shard, LSE merge across ranks, full-context reference",
        key="attention",
    )
    lse_base: str | None = option(
        None,
        "base of the log-sum-exp the ranks compute and merge (default: the engine's: e for the reference, "
        "the --vllm-attention-backend's under --engine vllm)",
        choices=LSE_BASES,
    )
    """None: the engine's (``Engine.lse_base``, else e); a ``Job`` sets it."""
    merge: str = option(
        "alternate",
        "allgather: all-gather LSEs, reduce-scatter outputs over heads, gather the slices; alltoall: all-to-all "
        "over heads; alternate (default): allgather on even steps, alltoall on odd ones",
        key="attention_merge",
        choices=MERGE_VARIANTS,
    )
    heads: int = option(8, "query heads (one shared latent KV head per group; default 8)", key="attention_heads", metavar="H")
    """Query heads. Every group has one KV head (an MLA-style latent shared by all heads)."""
    head_dim: int = option(16, "width of K and of V vectors (default 16)", key="attention_head_dim", metavar="D")
    """K (and query) width."""
    max_step_keys: int = option(
        DEFAULT_MAX_STEP_KEYS,
        "the step rule: a (group, request) whose context is at most N keys is checked every step; a longer one "
        f"on its first and last step and every ceil(keys / N)-th step (default {DEFAULT_MAX_STEP_KEYS})",
        key="attention_max_step_keys",
        metavar="N",
    )
    """Per (group, request): check every step while the reference reads at most this many
    keys (the last query token's context); beyond it, only the request's first and last
    step and every ``ceil(keys / max_step_keys)``-th step (``step % stride == 0``;
    ``dcpsim.verify.attention_reference.check_step``). Bounds the time of long contexts."""
    padded_rows: bool = option(
        False,
        "with CUDA-graph padding (--max-cudagraph-capture-size): the merge also runs each padded decode step's "
        "padding rows, which see no key on any rank (vLLM pads seq_lens with 0) and must merge to 0 with lse -inf",
        key="attention_padded_rows",
    )
    """Run the padding rows of a padded decode step through every rank's shard attention and
    the merge, and judge them (``verify.attention.AttentionVerifier.judge_padding``)."""
    tolerance: float = DEFAULT_TOLERANCE
    query_gain: float = 2.0
    """Logits are ``query_gain / sqrt(head_dim) * q . k``: logit std ~ query_gain."""
    max_query_keys: int = 2**20
    """Per (group, request, step): check every query token while ``tokens x context keys``
    stays within this; beyond it (a 16K-token chunk of a 256K context) check a deterministic
    sample of the tokens (``dcpsim.verify.attention_reference.select_queries``). Bounds memory and time."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"attention must be true or false, got {self.enabled!r}")
        # named as the run options (``Job`` fields, replay options) that set them
        for name, field in (("attention_heads", "heads"), ("attention_head_dim", "head_dim")):
            check_int(name, getattr(self, field))
        if self.lse_base is not None and self.lse_base not in LSE_BASES:
            raise ConfigError(f"lse_base must be 'e' or '2', got {self.lse_base!r}")
        if self.merge not in MERGE_VARIANTS:
            raise ConfigError(f"attention_merge must be allgather, alltoall or alternate, got {self.merge!r}")
        check_int("max_query_keys", self.max_query_keys)
        check_int("attention_max_step_keys", self.max_step_keys)
        if not self.tolerance > 0:
            raise ConfigError(f"attention tolerance must be > 0, got {self.tolerance!r}")

    @property
    def value_dim(self) -> int:
        """V width (the output width): ``head_dim``, as ``--attention-head-dim`` sets both."""
        return self.head_dim

    @property
    def base(self) -> str:
        """The LSE base the ranks compute and merge in (``lse_base``, e when unset)."""
        return self.lse_base or "e"

    @property
    def softmax_scale(self) -> float:
        return self.query_gain / math.sqrt(self.head_dim)

    @property
    def kv_width(self) -> int:
        return self.head_dim + self.value_dim

    def variant_for_step(self, step: int) -> str:
        if self.merge == "alternate":
            return "allgather" if step % 2 == 0 else "alltoall"
        return self.merge

    def summary(self) -> dict:
        return dict(
            heads=self.heads,
            head_dim=self.head_dim,
            value_dim=self.value_dim,
            lse_base=self.base,
            merge=self.merge,
            tolerance=self.tolerance,
            max_query_keys=self.max_query_keys,
            max_step_keys=self.max_step_keys,
        )
