"""Read scenarios from TOML files (standard library ``tomllib``).

A scenario file has top-level ``name``, ``description``, ``seed``,
``verify_every``, ``num_gpu_blocks``; a ``[config]`` table (vLLM field names);
``[[layers]]`` entries (``kind`` from ``dcpsim.scenarios.registry.SPEC_KINDS`` plus the
spec's fields; ``name`` may contain ``{i}`` with ``layers = [..]`` or
``"0-39"`` to stamp out many layers); and ``[[requests]]`` entries (``id`` may
contain ``{i}`` with ``count``). Every problem is reported at once as
``file.toml: path.to.field: what is wrong``, with a suggestion for a
misspelled key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
from fractions import Fraction
from pathlib import Path

from dcpsim.errors import ConfigError, ScenarioError
from dcpsim.model.config import SimConfig
from dcpsim.model.scenario import RequestSpec, Scenario
from dcpsim.model.specs import CircularBufferSpec, MambaSpec
from dcpsim.model.validate import is_int
from dcpsim.scenarios.pd import check_disaggregation, parse_disaggregated
from dcpsim.scenarios.registry import SPEC_KINDS, builtin_scenario_names, builtin_scenario_path

TOP_KEYS = {
    "name",
    "description",
    "seed",
    "verify_every",
    "num_gpu_blocks",
    "kv_cache_tokens",
    "max_steps",
    "config",
    "layers",
    "aliases",
    "requests",
    "disaggregated",
}
CONFIG_KEYS = {f.name for f in dataclasses.fields(SimConfig)} - {"draft_layers"}
"""``draft_layers`` is not written in [config]: layers say ``draft = true`` themselves."""
REQUEST_KEYS = {"id", "count", "prompt_len", "output_len", "arrival_step", "prefix", "shared_prefix_len", "acceptance", "preempt_at_steps"}


class _Problems:
    def __init__(self, source: str):
        self.source = source
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{self.source}: {path}: {message}")

    def unknown_keys(self, path: str, table: dict, allowed: set[str]) -> None:
        for key in table:
            if key not in allowed:
                close = difflib.get_close_matches(key, sorted(allowed), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.add(f"{path}.{key}" if path else key, f"unknown field{hint}")

    def raise_if_any(self) -> None:
        if self.items:
            raise ScenarioError("\n".join(self.items))


def resolve(name_or_path: str) -> Path:
    """A scenario file path, or the path of a built-in scenario by name."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if path.is_dir():
            raise ScenarioError(f"{name_or_path}: is a directory, not a scenario file")
        if not path.is_file():
            raise ScenarioError(f"{name_or_path}: no such scenario file")
        return path
    builtin = builtin_scenario_path(name_or_path)
    if builtin is None:
        names = builtin_scenario_names()
        close = difflib.get_close_matches(name_or_path, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ScenarioError(f"{name_or_path}: not a scenario file nor a built-in scenario{hint}; built-ins: {', '.join(names)}")
    return builtin


def load_scenario(name_or_path: str) -> Scenario:
    path = resolve(name_or_path)
    source = str(path) if path.parent != builtin_scenario_path("").parent else path.name
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{source}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{source}: cannot read: {exc}") from None
    return scenario_from_dict(data, source=source, default_name=path.stem)


MAX_STAMPED = 100_000  # layers from one entry, or requests from one count


def _layer_indices(value, problems: _Problems, path: str) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        if len(value) > MAX_STAMPED:
            problems.add(path, f"at most {MAX_STAMPED} layers per entry, got {len(value)}")
            return None
        return value
    match = re.fullmatch(r"\s*([0-9]{1,7})\s*-\s*([0-9]{1,7})\s*", value) if isinstance(value, str) else None
    if match:
        lo, hi = int(match.group(1)), int(match.group(2))
        if lo <= hi and hi - lo < MAX_STAMPED:
            return list(range(lo, hi + 1))
    problems.add(path, f'expected a list of layer numbers >= 0 or a range like "0-39", got {value!r}')
    return None


def _spec_fields(kind_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(kind_cls)}


def _tables(entries, table: str, problems: _Problems, required: bool = True):
    """(index, path, entry) of each ``[[table]]`` entry; reports a missing list or a non-table entry."""
    if entries is None and not required:
        return
    if not isinstance(entries, list) or (required and not entries):
        problems.add(table, f"needs at least one [[{table}]] entry" if required else f"must be a list of [[{table}]] tables")
        return
    for n, entry in enumerate(entries):
        if isinstance(entry, dict):
            yield n, f"{table}[{n}]", entry
        else:
            problems.add(f"{table}[{n}]", "must be a table")


def _mamba_defaults(fields: dict, config: SimConfig | None) -> None:
    """What vLLM derives for a Mamba layer from the engine config, when the file leaves it
    out: ``block_size`` (``mamba_block_size``) is ``max_model_len`` in ``none`` mode, and
    ``num_speculative_blocks`` is ``num_speculative_tokens``."""
    if config is None:
        return
    if fields.get("mamba_cache_mode", "none") != "align":
        fields.setdefault("block_size", config.max_model_len)
    fields.setdefault("num_speculative_blocks", config.num_speculative_tokens)


def _cache_block_size_default(cls, fields: dict, config: SimConfig | None) -> None:
    """An attention layer without ``block_size`` takes the cache block size (``[config]
    block_size``, vLLM's ``--block-size``) in states per page: ``B * R`` tokens for a
    compressed one. A ring's ``block_size`` is its capacity and is never defaulted."""
    if config is None or config.block_size is None or cls is CircularBufferSpec or "block_size" in fields:
        return
    tps = fields.get("tokens_per_state", 1)
    fields["block_size"] = config.block_size * (tps if isinstance(tps, int) and tps > 1 else 1)


def _parse_layers(entries, problems: _Problems, config: SimConfig | None = None, draft_layers: list[str] | None = None) -> dict:
    """The named layer specs; the names of ``draft = true`` entries go to ``draft_layers``."""
    draft_layers = [] if draft_layers is None else draft_layers
    layers: dict = {}
    for _, path, entry in _tables(entries, "layers", problems):
        parsed = _parse_layer(entry, problems, path, config)
        if parsed is None:
            continue
        names, spec, draft = parsed
        for nm in names:
            if nm in layers:
                problems.add(f"{path}.name", f"layer {nm!r} is defined twice")
            layers[nm] = spec
            if draft:
                draft_layers.append(nm)
    return layers


def _parse_layer(entry: dict, problems: _Problems, path: str, config: SimConfig | None):
    """One ``[[layers]]`` entry: its layer names, its spec and whether they are draft layers
    (a ``draft`` that is not a boolean is reported, and the layers are not draft layers);
    None if the entry has a problem that leaves no spec (every one reported)."""
    cls = _layer_kind(entry, problems, path)
    if cls is None:
        return None
    before = len(problems.items)
    problems.unknown_keys(path, entry, _layer_keys(cls))
    fields = _layer_fields(entry, cls, problems, path, config)
    names = _layer_names(entry, problems, path)
    if len(problems.items) > before:
        return None
    spec = _build_spec(cls, fields, problems, path, config)
    if spec is None:
        return None
    return names, spec, _draft_flag(entry, problems, path)


def _layer_kind(entry: dict, problems: _Problems, path: str):
    """The spec class the entry's ``kind`` names; None (reported, with a suggestion) if it names none."""
    kind = entry.get("kind")
    if isinstance(kind, str) and kind in SPEC_KINDS:
        return SPEC_KINDS[kind]
    close = difflib.get_close_matches(str(kind), sorted(SPEC_KINDS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    problems.add(f"{path}.kind", f"unknown kind {kind!r}{hint}; one of {sorted(SPEC_KINDS)}")
    return None


def _layer_keys(cls) -> set[str]:
    """The keys an entry of this spec class may have: the spec's fields, what names the
    layers, ``draft``, and ``dcp_sharded`` where the spec has ``dcp_replicated``."""
    allowed = _spec_fields(cls) | {"kind", "name", "names", "layers", "draft"}
    if "dcp_replicated" in _spec_fields(cls):
        allowed.add("dcp_sharded")
    return allowed


def _layer_fields(entry: dict, cls, problems: _Problems, path: str, config: SimConfig | None) -> dict:
    """The spec's fields as the entry gives them, with the defaults the config gives; reports
    a bad ``dcp_sharded``, both ``alignment`` and ``page_size_padded``, a required field
    missing and a ``tokens_per_state`` that is no fraction."""
    fields = {k: v for k, v in entry.items() if k in _spec_fields(cls)}
    _upstream_sharded_flag(entry, fields, problems, path)
    if fields.get("alignment") is not None and fields.get("page_size_padded") is not None:
        problems.add(f"{path}.page_size_padded", "alignment derives the padded page; give one of the two")
    if cls is MambaSpec:
        _mamba_defaults(fields, config)
    else:
        _cache_block_size_default(cls, fields, config)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in fields:
            problems.add(f"{path}.{f.name}", f"is required for kind {entry['kind']!r}")
    _fraction_tokens_per_state(fields, problems, path)
    return fields


def _fraction_tokens_per_state(fields: dict, problems: _Problems, path: str) -> None:
    """A ``tokens_per_state`` written as a string (``"1/4"``) becomes a ``Fraction``; one that
    is no fraction is reported."""
    tps = fields.get("tokens_per_state")
    if isinstance(tps, str):
        try:
            fields["tokens_per_state"] = Fraction(tps)
        except (ValueError, ZeroDivisionError):
            problems.add(f"{path}.tokens_per_state", f'expected an int or a fraction like "1/4", got {tps!r}')


def _build_spec(cls, fields: dict, problems: _Problems, path: str, config: SimConfig | None):
    """The spec built from ``fields`` (a Mamba spec also checked against the config); None
    if the spec refuses them, reported at the field its message names."""
    try:
        spec = cls(**fields)
        if isinstance(spec, MambaSpec) and config is not None:
            spec.check_config(config)
    except ConfigError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0].removeprefix(cls.__name__ + ".")
        problems.add(f"{path}.{field}" if field in fields else path, message)
        return None
    except (TypeError, ValueError) as exc:  # a value of the wrong type deep inside a check
        problems.add(path, f"invalid field value: {exc}")
        return None
    return spec


def _draft_flag(entry: dict, problems: _Problems, path: str) -> bool:
    """Whether the entry's layers are draft layers (``draft = true``); any other value than
    true or false is reported."""
    draft = entry.get("draft", False)
    if not isinstance(draft, bool):
        problems.add(f"{path}.draft", f"must be true or false, got {draft!r}")
    return draft is True


def _upstream_sharded_flag(entry: dict, fields: dict, problems: _Problems, path: str) -> None:
    """Upstream vLLM 0.33.0 spells the flag the other way round (``dcp_sharded``, true by
    default on attention specs); dcpsim keeps the seed's ``dcp_replicated`` as its one
    internal flag, so ``dcp_sharded = b`` reads as ``dcp_replicated = not b``."""
    if "dcp_sharded" not in entry:
        return
    sharded = entry["dcp_sharded"]
    if not isinstance(sharded, bool):
        problems.add(f"{path}.dcp_sharded", f"must be true or false, got {sharded!r}")
        return
    if "dcp_replicated" in entry and entry["dcp_replicated"] is sharded:
        problems.add(
            f"{path}.dcp_sharded",
            f"dcp_sharded = {str(sharded).lower()} contradicts dcp_replicated = "
            f"{str(entry['dcp_replicated']).lower()} (upstream's dcp_sharded is the inverse of the "
            "seed's dcp_replicated); give one of them",
        )
        return
    fields["dcp_replicated"] = not sharded


def _layer_names(entry: dict, problems: _Problems, path: str) -> list[str]:
    """``name`` (with ``{i}`` and ``layers``) or an explicit ``names`` list."""
    if "names" in entry:
        names = entry["names"]
        if "name" in entry or "layers" in entry:
            problems.add(f"{path}.names", "give either names or name (+ layers), not both")
            return []
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            problems.add(f"{path}.names", f"must be a non-empty list of layer names, got {names!r}")
            return []
        return names
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        problems.add(f"{path}.name", "needs a layer name")
        return []
    if "layers" not in entry:
        return [name]
    idx = _layer_indices(entry["layers"], problems, f"{path}.layers")
    if idx is None:
        return []
    if "{i}" not in name:
        problems.add(f"{path}.name", "must contain {i} when layers is given")
        return []
    return [name.replace("{i}", str(i)) for i in idx]


def _parse_aliases(entries, layers: dict, problems: _Problems) -> dict[str, str]:
    """Reader layers that use another layer's cache (vLLM's kv_sharing_target_layer_name)."""
    aliases: dict[str, str] = {}
    for _, path, entry in _tables(entries, "aliases", problems, required=False):
        problems.unknown_keys(path, entry, {"name", "names", "layers", "target"})
        target = entry.get("target")
        if not isinstance(target, str) or not target:
            problems.add(f"{path}.target", "needs the name of the layer whose cache is read")
            continue
        names = _layer_names(entry, problems, path)
        indices = _layer_indices(entry["layers"], _Problems(""), "") if "layers" in entry else None
        for i, nm in enumerate(names):
            tgt = target.replace("{i}", str(indices[i])) if indices else target
            if nm in layers or nm in aliases:
                problems.add(f"{path}.name", f"layer {nm!r} is defined twice")
            elif tgt not in layers:
                problems.add(f"{path}.target", f"layer {nm!r} aliases {tgt!r}, which is not a layer with a cache")
            else:
                aliases[nm] = tgt
    return aliases


def _parse_requests(entries, problems: _Problems) -> list[tuple[str, RequestSpec]]:
    """(path of the entry, request) for every request, ``count`` stamped out."""
    out: list[tuple[str, RequestSpec]] = []
    for n, path, entry in _tables(entries, "requests", problems):
        before = len(problems.items)
        problems.unknown_keys(path, entry, REQUEST_KEYS)
        stamp = _request_stamp(n, entry, problems, path)
        if stamp is None:
            continue
        fields = _request_fields(entry, problems, path)
        if len(problems.items) > before:
            continue
        count, rid = stamp
        out += _stamped_requests(path, count, rid, fields, problems)
    return out


def _request_stamp(n: int, entry: dict, problems: _Problems, path: str) -> tuple[int, str] | None:
    """``(count, id)`` of the ``n``-th entry: how many requests it stamps out, and their id
    (``{i}`` marks where each one's number goes; default ``req{n}``, ``req{n}-{i}``); None if
    either is malformed (reported)."""
    count = entry.get("count", 1)
    if not is_int(count) or not 1 <= count <= MAX_STAMPED:
        problems.add(f"{path}.count", f"must be an integer from 1 to {MAX_STAMPED}, got {count!r}")
        return None
    rid = entry.get("id", f"req{n}" + ("-{i}" if count != 1 else ""))
    if not isinstance(rid, str) or not rid:
        problems.add(f"{path}.id", f"must be a non-empty string, got {rid!r}")
        return None
    if count > 1 and "{i}" not in str(rid):
        problems.add(f"{path}.id", "must contain {i} when count > 1")
        return None
    return count, rid


def _request_fields(entry: dict, problems: _Problems, path: str) -> dict:
    """The ``RequestSpec`` fields the entry gives; reports a value of the wrong type and a
    missing ``prompt_len`` or ``output_len``."""
    fields = _request_ints(entry, problems, path) | _request_int_lists(entry, problems, path)
    if "prefix" in entry:
        fields["prefix"] = str(entry["prefix"])
    for key in ("prompt_len", "output_len"):
        if key not in entry:
            problems.add(f"{path}.{key}", "is required")
    return fields


def _request_ints(entry: dict, problems: _Problems, path: str) -> dict:
    """The integer fields the entry gives (one that is not an integer is reported)."""
    fields = {}
    for key in ("prompt_len", "output_len", "arrival_step", "shared_prefix_len"):
        if key in entry:
            if not is_int(entry[key]):
                problems.add(f"{path}.{key}", f"must be an integer, got {entry[key]!r}")
            fields[key] = entry[key]
    return fields


def _request_int_lists(entry: dict, problems: _Problems, path: str) -> dict:
    """The integer-list fields the entry gives, as tuples (one that is not a list of
    integers is reported and left out)."""
    fields = {}
    for key in ("acceptance", "preempt_at_steps"):
        if key in entry:
            v = entry[key]
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                problems.add(f"{path}.{key}", f"must be a list of integers, got {v!r}")
                continue
            fields[key] = tuple(v)
    return fields


def _stamped_requests(path: str, count: int, rid: str, fields: dict, problems: _Problems) -> list[tuple[str, RequestSpec]]:
    """The entry's ``count`` requests, ``{i}`` of the id replaced by each one's number; the
    first the spec refuses is reported, and ends the stamping."""
    out: list[tuple[str, RequestSpec]] = []
    for i in range(count):
        try:
            out.append((path, RequestSpec(request_id=str(rid).replace("{i}", str(i)), **fields)))
        except ConfigError as exc:
            problems.add(path, str(exc))
            break
    return out


CONFIG_TYPES = {f.name: f.type for f in dataclasses.fields(SimConfig)}


def _parse_config(cfg, problems: _Problems) -> SimConfig | None:
    """Each field checked on its own (all problems at once), then the cross-field rules."""
    if not isinstance(cfg, dict):
        problems.add("config", "must be a table")
        return None
    problems.unknown_keys("config", cfg, CONFIG_KEYS)
    before = len(problems.items)
    values = {k: v for k, v in cfg.items() if k in CONFIG_KEYS}
    for key, value in values.items():
        if CONFIG_TYPES[key] in (bool, "bool"):
            if not isinstance(value, bool):
                problems.add(f"config.{key}", f"must be true or false, got {value!r}")
        elif CONFIG_TYPES[key] in (str, "str"):
            if not isinstance(value, str):
                problems.add(f"config.{key}", f"must be a string, got {value!r}")
        elif value is not None and not is_int(value):
            problems.add(f"config.{key}", f"must be an integer, got {value!r}")
    if len(problems.items) > before:
        return None
    try:
        return SimConfig(**values)
    except ConfigError as exc:
        field = str(exc).split(" ", 1)[0]
        problems.add(f"config.{field}" if field in CONFIG_KEYS else "config", str(exc))
        return None


def _check_requests(stamped: list[tuple[str, RequestSpec]], config: SimConfig | None, problems: _Problems) -> None:
    """The workload rules that need the whole scenario, reported by request path."""
    seen: dict[str, str] = {}
    for path, r in stamped:
        if r.request_id in seen:
            problems.add(f"{path}.id", f"request id {r.request_id!r} is used twice (also by {seen[r.request_id]})")
        seen.setdefault(r.request_id, path)
        if config is None:
            continue
        total = r.prompt_len + r.output_len
        if total > config.max_model_len:
            problems.add(path, f"request {r.request_id!r}: prompt_len + output_len = {total} exceeds max_model_len {config.max_model_len}")
        if any(a > config.num_speculative_tokens for a in r.acceptance):
            problems.add(f"{path}.acceptance", f"an acceptance count exceeds num_speculative_tokens {config.num_speculative_tokens}")


def scenario_from_dict(data: dict, *, source: str, default_name: str = "scenario") -> Scenario:
    problems = _Problems(source)
    problems.unknown_keys("", data, TOP_KEYS)
    config = _parse_config(data.get("config", {}), problems)
    draft_layers: list[str] = []
    layers = _parse_layers(data.get("layers"), problems, config, draft_layers)
    if config is not None and draft_layers:
        config = dataclasses.replace(config, draft_layers=tuple(draft_layers))
    elif config is not None and config.draft_decode_context_parallel_size is not None:
        problems.add("config.draft_decode_context_parallel_size", "is set but no layer says draft = true")
    aliases = _parse_aliases(data.get("aliases"), layers, problems)
    stamped = _parse_requests(data.get("requests"), problems)
    requests = [r for _, r in stamped]
    top = {}
    for key, minimum in (("seed", 0), ("verify_every", 1), ("num_gpu_blocks", 1), ("kv_cache_tokens", 1), ("max_steps", 1)):
        if key in data:
            if not is_int(data[key]):
                problems.add(key, f"must be an integer, got {data[key]!r}")
            elif data[key] < minimum:
                problems.add(key, f"must be >= {minimum}, got {data[key]}")
            else:
                top[key] = data[key]
    if "num_gpu_blocks" in top and "kv_cache_tokens" in top:
        problems.add("kv_cache_tokens", "set num_gpu_blocks or kv_cache_tokens, not both")
    _check_requests(stamped, config, problems)
    if "disaggregated" in data:
        top["disaggregated"] = parse_disaggregated(data["disaggregated"], problems.add)
    problems.raise_if_any()
    try:
        scenario = Scenario(
            name=str(data.get("name", default_name)),
            description=str(data.get("description", "")),
            source=source,
            layers=layers,
            aliases=aliases,
            config=config,
            requests=tuple(requests),
            **top,
        )
    except ConfigError as exc:
        raise ScenarioError(f"{source}: {exc}") from None
    if scenario.disaggregated is not None:
        try:
            check_disaggregation(scenario)
        except ConfigError as exc:
            raise ScenarioError(f"{source}: {exc}") from None
    return scenario
