"""JUnit XML for matrix cells: one ``testcase`` per cell, which CI systems show and count.

A cell entry is the dict of ``matrix --json`` (``cell``, ``status``, ``reason``,
``seconds``, and on a shard ``index`` and ``matrix``). A failed cell is a ``failure``
(the reason as message, the report's text as body), a broken world an ``error``, a
skipped cell ``skipped``. The shard record goes in each testcase's ``properties``, so
``read`` gives back entries that ``shard.merge`` accepts.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from dcpsim.errors import ConfigError

SUITE = "dcpsim matrix"


def to_xml(entries: list[dict], *, details: dict[str, str] | None = None) -> ET.ElementTree:
    """The JUnit tree of ``entries``; ``details`` maps a cell id to the body of its failure."""
    details = details or {}
    count = {s: sum(e["status"] == s for e in entries) for s in ("fail", "error", "skipped")}
    root = ET.Element("testsuites")
    suite = ET.SubElement(
        root,
        "testsuite",
        name=SUITE,
        tests=str(len(entries)),
        failures=str(count["fail"]),
        errors=str(count["error"]),
        skipped=str(count["skipped"]),
        time=f"{sum(e.get('seconds') or 0 for e in entries):.3f}",
    )
    for e in entries:
        scenario = e["cell"].split("-dcp")[0]
        case = ET.SubElement(suite, "testcase", classname=f"dcpsim.matrix.{scenario}", name=e["cell"], time=f"{e.get('seconds') or 0:.3f}")
        if "index" in e:
            props = ET.SubElement(case, "properties")
            ET.SubElement(props, "property", name="dcpsim.index", value=str(e["index"]))
            ET.SubElement(props, "property", name="dcpsim.matrix", value=json.dumps(e["matrix"], sort_keys=True))
        if e["status"] == "fail":
            ET.SubElement(case, "failure", message=e.get("reason", "")).text = details.get(e["cell"], e.get("reason", ""))
        elif e["status"] == "error":
            ET.SubElement(case, "error", message=e.get("reason", "")).text = e.get("reason", "")
        elif e["status"] == "skipped":
            ET.SubElement(case, "skipped", message=e.get("reason", ""))
    ET.indent(root)
    return ET.ElementTree(root)


def write(entries: list[dict], path: str, *, details: dict[str, str] | None = None) -> None:
    try:
        to_xml(entries, details=details).write(path, encoding="utf-8", xml_declaration=True)
    except OSError as exc:
        raise ConfigError(f"--junit: cannot write {path}: {exc}") from None


def read(path: str) -> list[dict]:
    """Cell entries of a JUnit file written by ``write`` (for merging shards)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise ConfigError(f"{path}: not a JUnit XML report: {exc}") from None
    entries = []
    for case in root.iter("testcase"):
        entry = {"cell": case.get("name"), "status": "pass", "reason": "", "seconds": float(case.get("time") or 0), "report": None}
        for kind, status in (("failure", "fail"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(kind)
            if node is not None:
                entry["status"], entry["reason"] = status, node.get("message", "")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        try:
            if "dcpsim.index" in props:
                entry["index"] = int(props["dcpsim.index"])
                entry["matrix"] = json.loads(props["dcpsim.matrix"])
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"{path}: testcase {entry['cell']!r}: bad shard properties: {exc}") from None
        entries.append(entry)
    return entries
