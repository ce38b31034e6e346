"""vLLM's KV-cache core from a source tree: ``KVCacheManager`` with its coordinator, the
per-spec managers and the ``BlockPool``, the spec classes, ``Request`` and its block
hashing, run as vLLM wrote them (``SourceTree``: the modules named here execute for real,
everything around them is a stub).

The loader's stubs include vLLM's KV events (``vllm.distributed.kv_events``, which needs
msgspec and zmq) as plain records of the same names, so the events the block pool emits
can be read back; ``SamplingParams`` is duck-typed here. An exception raised inside vLLM's code becomes an ``EngineError``
naming vLLM's function, file and line (``engine_error``).
"""

from __future__ import annotations

import contextlib
import linecache
import threading
import traceback
from pathlib import Path

from dcpsim.engine.interface import EngineError
from dcpsim.engine.vllm.loader import SourceTree

MANAGER_MODULE = "vllm.v1.core.kv_cache_manager"
UTILS_MODULE = "vllm.v1.core.kv_cache_utils"
SINGLE_TYPE_MODULE = "vllm.v1.core.single_type_kv_cache_manager"
SPECS_MODULE = "vllm.v1.kv_cache_interface"
COORDINATOR_MODULE = "vllm.v1.core.kv_cache_coordinator"
REQUEST_MODULE = "vllm.v1.request"
HASHING_MODULE = "vllm.utils.hashing"
CORE_MODULES = (
    "vllm.utils",
    "vllm.utils.math_utils",
    "vllm.utils.gc_utils",
    HASHING_MODULE,
    "vllm.v1.utils",
    "vllm.v1.kv_cache_layout",
    "vllm.v1.kv_cache_spec_registry",
    SPECS_MODULE,
    "vllm.v1.structured_output.request",
    "vllm.v1.token_buffer",
    REQUEST_MODULE,
    "vllm.v1.hisparse.block_pool",
    UTILS_MODULE,
    "vllm.v1.core.kv_cache_metrics",
    "vllm.v1.core.block_pool",
    SINGLE_TYPE_MODULE,
    COORDINATOR_MODULE,
    MANAGER_MODULE,
)
"""The modules of ``vllm/`` that run for real (the rest are stubs), where the tree has them."""
REQUIRED_CORE = (MANAGER_MODULE, UTILS_MODULE, SINGLE_TYPE_MODULE, SPECS_MODULE, REQUEST_MODULE, HASHING_MODULE)
"""The core modules every tree must have (a missing one is exit 2 naming its file)."""
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
OUTPUTS_MODULE = "vllm.v1.outputs"
SCHEDULER_MODULES = (
    "vllm.v1.core.sched.interface",
    "vllm.v1.core.sched.output",
    "vllm.v1.core.sched.request_queue",
    "vllm.v1.core.sched.utils",
    "vllm.v1.core.encoder_cache_manager",
    OUTPUTS_MODULE,
    SCHEDULER_MODULE,
)
"""With ``--vllm-scheduler full``, vLLM's v1 ``Scheduler`` and what it runs besides the core."""
_NONE_HASH_LOCK = threading.Lock()
HASH_ALGO = "sha256"
"""vLLM 0.33.0's default ``cache_config.prefix_caching_hash_algo``."""


class SamplingParams:
    """What ``vllm.v1.request.Request`` and the v1 scheduler's stop check read of a
    ``SamplingParams`` (greedy, no structured output, no logprobs, no stop tokens: a
    request stops at ``max_tokens``)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.min_tokens = 0
        self.eos_token_id = None
        self.stop_token_ids = None
        self.repetition_detection = None
        self.num_logprobs = None
        self.extra_args = None
        self.structured_outputs = None
        self.logprobs = None
        self.prompt_logprobs = None
        self.prompt_logprob_token_ids = None  # 0.34.0
        self.prompt_logprob_start = None
        self.n = 1
        self.skip_reading_prefix_cache = False

    def clone(self) -> SamplingParams:
        return self


class VllmCore:
    """The loaded modules and the handful of names dcpsim calls."""

    def __init__(self, tree: SourceTree, mods: dict):
        """``mods``: the loaded modules (``load_with_core``: every module of one load, so
        the spec classes the worker side builds are the ones the manager registered)."""
        self.tree = tree
        self.modules = mods
        self.specs = mods[SPECS_MODULE]
        self.utils = mods[UTILS_MODULE]
        self.KVCacheManager = mods[MANAGER_MODULE].KVCacheManager
        self.Request = mods[REQUEST_MODULE].Request
        self.RequestStatus = mods[REQUEST_MODULE].RequestStatus
        self.BlockStored = mods["vllm.v1.core.block_pool"].BlockStored  # the loader's record (STUBS)
        self.hash_fn = mods[HASHING_MODULE].get_hash_fn_by_name(HASH_ALGO)
        self.scheduler_module = mods.get(SCHEDULER_MODULE)
        """vLLM's v1 scheduler module (``--vllm-scheduler full``), else None."""
        self.outputs = mods.get(OUTPUTS_MODULE)
        self.around: dict[str, object] = {}
        """The context a call of that name runs in (a context-manager factory; none: no
        context): a plugin whose code in the core imports lazily there (vllm-ascend's managers,
        built with the ``KVCacheManager``) makes its trees importable for that call only."""

    def init_none_hash(self) -> None:
        """vLLM's ``init_none_hash``, once per loaded core. It draws the root of every block
        hash chain at random (``os.urandom`` without ``PYTHONHASHSEED``) into a module global:
        drawn again by each rank's scheduler, ranks that are threads of one process (sharing
        the module) would hash one request's blocks under two roots and find different
        prefix hits, so their schedules would part."""
        with _NONE_HASH_LOCK:
            if not getattr(self.utils, "_dcpsim_none_hash", False):
                self.utils.init_none_hash(self.hash_fn)
                self.utils._dcpsim_none_hash = True

    def call(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, an exception inside vLLM's code an ``EngineError``."""
        try:
            with self.around.get(what, contextlib.nullcontext)():
                return fn(*args, **kwargs)
        except Exception as exc:  # vLLM's code refused or crashed: the engine's failure
            raise engine_error(exc, self.tree, what) from exc


def load_with_core(tree: SourceTree, names: list[str], scheduler: bool = False) -> tuple[dict, VllmCore]:
    """Load ``names`` and vLLM's KV-cache core in one go (with ``scheduler``, vLLM's v1
    ``Scheduler`` too); the modules, and the core."""
    extra = SCHEDULER_MODULES if scheduler else ()
    core = [m for m in CORE_MODULES if m in REQUIRED_CORE or tree.exists(m)]  # what a release has of the rest
    mods = tree.load(list(dict.fromkeys([*names, *core, *extra])), warm=_register_spec_managers)
    return mods, VllmCore(tree, mods)


def _register_spec_managers(mods: dict) -> None:
    """vLLM's spec-manager registry registers on first use, importing lazily; warm it while
    the tree is importable (``SourceTree.load``'s ``warm``)."""
    mods[SINGLE_TYPE_MODULE].register_all_kvcache_specs(None)


def engine_error(exc: BaseException, tree: SourceTree, what: str) -> EngineError:
    """An ``EngineError`` for ``exc`` raised under ``what``: the innermost frame inside the
    tree names the function, the file (relative to the tree) and the line, and an
    assertion without a message is quoted from its source line."""
    frames = tree.frames(exc)
    where = frames[-1] if frames else None
    message = str(exc).strip()
    if not message and where is not None:
        message = linecache.getline(where.filename, where.lineno).strip()
    return EngineError(
        what=what,
        function=f"{_module_of(tree, where.filename)}.{_qualname(exc, tree) or where.name}" if where else what,
        file=tree.relative(where.filename) if where else "",
        line=where.lineno if where else 0,
        message=f"{type(exc).__name__}: {message}" if message else type(exc).__name__,
        frames=tuple(f"{tree.relative(f.filename)}:{f.lineno} {f.name}" for f in frames),
    )


def _qualname(exc: BaseException, tree: SourceTree) -> str | None:
    """The qualified name (``Scheduler.__init__``) of the innermost frame inside the tree."""
    names = [f.f_code.co_qualname for f, _ in traceback.walk_tb(exc.__traceback__) if tree.contains(f.f_code.co_filename)]
    return names[-1] if names else None


def _module_of(tree: SourceTree, filename: str) -> str:
    return ".".join(Path(tree.relative(filename)).with_suffix("").parts)
