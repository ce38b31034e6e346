"""Engines by name: ``reference``, ``vllm`` (vLLM's own code from a source tree), ``sglang``
(SGLang's), or
``MODULE:ATTR`` (a plugin: an ``Engine`` subclass or instance importable as MODULE.ATTR).

``engine_spec_error`` validates a name and its options in the parent, before any rank
starts (``ConfigError``, exit 2, naming the module, attribute or file); ``build_engine``
builds the engine in a rank (cached per process, so a batch of jobs loads vLLM once).
"""

from __future__ import annotations

import importlib
import inspect

from dcpsim.engine.interface import ENGINE_DECISIONS, PCP_DECISIONS, Engine
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.sglang.adapter import SglangEngine
from dcpsim.engine.vllm.adapter import VllmEngine
from dcpsim.engine.vllm_ascend.adapter import VllmAscendEngine
from dcpsim.errors import ConfigError

BUILTIN_ENGINES = ("reference", "vllm", "sglang", "vllm-ascend")
VLLM_RUNNERS = ("v2", "v1")

_CACHE: dict[tuple, Engine] = {}


def _plugin(name: str) -> Engine:
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--engine {name!r}: expected reference, vllm, sglang, vllm-ascend, or MODULE:ATTR for a plugin")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--engine {name}: cannot import module {module_name!r}: {exc}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"--engine {name}: module {module_name} ({getattr(module, '__file__', '?')}) has no attribute {attr!r}") from None
    engine = obj() if inspect.isclass(obj) else obj
    if not isinstance(engine, Engine):
        raise ConfigError(
            f"--engine {name}: {module_name}.{attr} is not a dcpsim.engine.interface.Engine "
            f"(subclass Engine, or ReferenceEngine to change one decision)"
        )
    missing = [m for m in unimplemented(engine)]
    if missing:
        raise ConfigError(
            f"--engine {name}: {type(engine).__name__} does not implement {', '.join(missing)} (see dcpsim.engine.interface.Engine)"
        )
    for problem in signature_mismatches(engine):
        raise ConfigError(f"--engine {name}: {problem} (see dcpsim.engine.interface.Engine)")
    return engine


OPTIONAL_DECISIONS = (
    "geometries",
    "step_write_slots",
    "make_scheduler",
    "check_scenario",
    "max_admissible_tokens",
    "context_gather",
    "spec_decode_mask",
    "prefix_hit_tokens",
    "merge_variant",
    "merge_path",
    "attention_query_rows",
    "attention_heads",
    *PCP_DECISIONS,
)
"""Interface methods an engine may leave to the base class (defaults, or not checked)."""


def unimplemented(engine: Engine) -> list[str]:
    """The interface methods ``engine`` leaves to the base class (which raises)."""
    out = []
    for name, member in inspect.getmembers(Engine, inspect.isfunction):
        if name.startswith("_") or name in OPTIONAL_DECISIONS:
            continue
        if getattr(type(engine), name) is member:
            out.append(name)
    return out


def signature_mismatches(engine: Engine) -> list[str]:
    """The interface methods ``engine`` overrides with a signature the harness cannot call
    as it calls the interface's: required positional parameters positionally, keyword-only
    and optional ones by keyword
    (e.g. ``make_scheduler`` without ``connector``, which only a P/D run passes, so a plugin
    written before it would fail there alone, inside a rank)."""
    out = []
    for name, member in inspect.getmembers(Engine, inspect.isfunction):
        override = getattr(type(engine), name, member)
        if name.startswith("_") or override is member or not inspect.isfunction(override):
            continue
        params = list(inspect.signature(member).parameters.values())[1:]
        required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        by_name = {p.name: None for p in params if p not in required and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        try:
            inspect.signature(override).bind(None, *[None] * len(required), **by_name)
        except TypeError as exc:
            wanted = ", ".join(p.name + ("=..." if p.default is not p.empty else "") for p in params)
            out.append(f"{type(engine).__name__}.{name} cannot be called as Engine.{name}({wanted}): {exc}")
    return out


def build_engine(name: str = "reference", **options) -> Engine:
    """The engine called ``name`` (see the module docstring); raises ``ConfigError``.
    ``options``: ``EngineChoice``'s ``vllm_*`` fields for ``--engine vllm``, its ``sglang_*``
    fields for ``--engine sglang`` (the others are ignored)."""
    key = (name, tuple(sorted(options.items())))
    if key in _CACHE:
        return _CACHE[key]
    if name == "reference":
        engine: Engine = ReferenceEngine()
    elif name == "vllm-ascend":
        o = {k.removeprefix("vllm_"): v for k, v in options.items() if k.startswith("vllm_") and not k.startswith("vllm_ascend_")}
        engine = VllmAscendEngine(
            options.get("vllm_ascend_source"), o.pop("source", None), partial=bool(options.get("engine_partial", False)), **o
        )
    elif name in ("vllm", "sglang"):
        o = {k.removeprefix(f"{name}_"): v for k, v in options.items() if k.startswith(f"{name}_") and not k.startswith("vllm_ascend_")}
        partial = bool(options.get("engine_partial", False))
        engine = (VllmEngine if name == "vllm" else SglangEngine)(o.pop("source", None), partial=partial, **o)
    else:
        engine = _plugin(name)
    _CACHE[key] = engine
    return engine


def engine_info(engine: Engine, scenario=None) -> dict:
    """What a report says of the engine: its name, version and who makes each decision
    (the engine's own ``decisions``, else ``reference`` for a decision it inherits from the
    reference engine, else its class). With ``scenario``, an engine that says which KV cache
    manager layout it picks for it (``manager_layout``) says so among its scheduler decisions."""
    own = getattr(engine, "decisions", {})
    decisions = {}
    for name in ENGINE_DECISIONS:
        inherited = isinstance(engine, ReferenceEngine) and getattr(type(engine), name) is getattr(ReferenceEngine, name)
        decisions[name] = own.get(name) or ("reference" if inherited else type(engine).__name__)
    info = dict(name=engine.name, version=getattr(engine, "version", None), decisions=decisions)
    bindings = getattr(engine, "bindings", None)
    if bindings is not None:  # which code shape of the tree each decision is bound to
        info["bindings"] = bindings.describe(engine.name)
        info["partial"] = list(bindings.partial)
    plugin = getattr(engine, "plugin_bindings", None)
    if plugin is not None:  # a plugin engine over a core (vllm-ascend over vLLM): its own decisions' shapes
        info["plugin_bindings"] = plugin.describe(engine.name)
        info["partial"] = [*info.get("partial", []), *(f"plugin:{d}" for d in plugin.partial)]
        info["core_version"] = getattr(engine, "vllm_version", None)
    scheduler_decisions = getattr(engine, "scheduler_decisions", None)
    if scheduler_decisions:  # each scheduler-side decision and the function that makes it
        info["scheduler_decisions"] = dict(scheduler_decisions)
        layout = getattr(engine, "manager_layout", None)
        if scenario is not None and layout is not None and "manager layout" in scheduler_decisions:
            try:
                info["scheduler_decisions"]["manager layout"] = layout(scenario).describe()
            except ConfigError as exc:  # a scenario the engine refused before it ran: keep the rule's words
                info["scheduler_decisions"]["manager layout"] += f" (this scenario: {exc})"
    return info
