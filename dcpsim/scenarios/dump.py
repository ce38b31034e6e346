"""Write a scenario back out: a dict (for JSON reports and replays) or a TOML file.

``scenario_from_dict(scenario_to_dict(s))`` rebuilds an equal scenario; the
TOML text is what a person would write (only non-default fields), so a shrunk
failing example can be read, edited and rerun with ``dcpsim run``.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from dcpsim.model.scenario import RequestSpec, Scenario
from dcpsim.model.specs import KVCacheSpec
from dcpsim.scenarios.registry import SPEC_KINDS

_KIND_OF = {cls: kind for kind, cls in SPEC_KINDS.items()}


def _non_default(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        out[f.name] = value
    return out


def _spec_dict(spec: KVCacheSpec) -> dict:
    fields = _non_default(spec)
    if "head_size_v" in fields and fields["head_size_v"] == getattr(spec, "head_size", None):
        fields.pop("head_size_v")  # the default: V as wide as K
    if fields.get("alignment") is not None:
        fields.pop("page_size_padded", None)  # derived from alignment when the spec is built
    if isinstance(fields.get("tokens_per_state"), Fraction):
        fields["tokens_per_state"] = str(fields["tokens_per_state"])
    return {"kind": _KIND_OF[type(spec)], **fields}


def _request_dict(r: RequestSpec) -> dict:
    d = {"id": r.request_id}
    for key, value in _non_default(r).items():
        if key == "request_id":
            continue
        d[key] = list(value) if isinstance(value, tuple) else value
    return d


def scenario_to_dict(s: Scenario) -> dict:
    layers: list[dict] = []
    by_spec: dict[tuple[KVCacheSpec, bool], dict] = {}
    drafts = set(s.config.draft_layers)
    for name, spec in s.layers.items():
        key = (spec, name in drafts)
        entry = by_spec.get(key)
        if entry is None:
            entry = {"names": [], **_spec_dict(spec), **({"draft": True} if key[1] else {})}
            by_spec[key] = entry
            layers.append(entry)
        entry["names"].append(name)
    out = {"name": s.name}
    if s.description:
        out["description"] = s.description
    out["seed"] = s.seed
    out["verify_every"] = s.verify_every
    for key in ("num_gpu_blocks", "kv_cache_tokens"):
        if getattr(s, key) is not None:
            out[key] = getattr(s, key)
    if s.max_steps != Scenario.__dataclass_fields__["max_steps"].default:
        out["max_steps"] = s.max_steps
    out["config"] = {
        k: v for k, v in dataclasses.asdict(s.config).items() if v is not None and k != "draft_layers"
    }  # layers carry draft = true
    out["layers"] = layers
    if s.aliases:
        out["aliases"] = [{"names": [n], "target": t} for n, t in s.aliases.items()]
    out["requests"] = [_request_dict(r) for r in s.requests]
    if s.disaggregated is not None:
        pd = s.disaggregated
        out["disaggregated"] = {"kv_connector": pd.kv_connector, "prefill": _non_default(pd.prefill), "decode": _non_default(pd.decode)}
        if pd.load_steps:
            out["disaggregated"]["load_steps"] = pd.load_steps
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        escaped = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def scenario_to_toml(s: Scenario, header: str = "") -> str:
    d = scenario_to_dict(s)
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for key in ("name", "description", "seed", "verify_every", "num_gpu_blocks", "kv_cache_tokens", "max_steps"):
        if key in d:
            lines.append(f"{key} = {_toml_value(d[key])}")
    lines += ["", "[config]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in d["config"].items()]
    for table in ("layers", "aliases", "requests"):
        for entry in d.get(table, []):
            lines += ["", f"[[{table}]]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
    if "disaggregated" in d:
        pd = d["disaggregated"]
        lines += ["", "[disaggregated]", f"kv_connector = {_toml_value(pd['kv_connector'])}"]
        if "load_steps" in pd:
            lines.append(f"load_steps = {_toml_value(pd['load_steps'])}")
        for role in ("prefill", "decode"):
            lines += ["", f"[disaggregated.{role}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in pd[role].items()]
    return "\n".join(lines) + "\n"
