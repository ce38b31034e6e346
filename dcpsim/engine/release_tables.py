"""Every real engine's releases and its table of code shapes, for ``dcpsim engine releases``.

``RELEASE_TABLES``: per engine, the releases dcpsim binds and the table of each decision's shapes
(``dcpsim.engine.vllm.releases``, ``dcpsim.engine.sglang.releases``). ``table_document`` is the
table as data; ``tree_document`` binds a source tree (without loading it) and says, per decision,
which shape it holds, or that the reference decides and why, or that the tree holds it in no
known shape (what ``--engine-partial`` would hand the reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dcpsim.engine.loading.bindings import Bindings, Decision, bind
from dcpsim.engine.loading.tree import SourceTree
from dcpsim.engine.sglang.releases import SGLANG_RELEASES, SGLANG_TABLE
from dcpsim.engine.vllm.releases import VLLM_RELEASES, vllm_table
from dcpsim.engine.vllm_ascend.releases import ASCEND_RELEASES, ASCEND_TABLE


@dataclass(frozen=True)
class ReleaseTable:
    engine: str
    label: str
    releases: tuple[str, ...]
    tables: dict
    """``--vllm-runner`` (or ``""``) -> the decisions of that variant."""


RELEASE_TABLES = {
    "vllm": ReleaseTable("vllm", "vLLM", VLLM_RELEASES, {"v2": vllm_table("v2"), "v1": vllm_table("v1")}),
    "sglang": ReleaseTable("sglang", "SGLang", SGLANG_RELEASES, {"": SGLANG_TABLE}),
    "vllm-ascend": ReleaseTable("vllm-ascend", "vllm-ascend", ASCEND_RELEASES, {"": ASCEND_TABLE}),
}


def _decision_document(d: Decision) -> dict:
    return dict(
        decision=d.name,
        shapes=[dict(name=s.name, code=s.describe(), releases=list(s.releases)) for s in d.shapes],
        absent=list(d.absent),
        absent_reason=d.absent_reason,
    )


def table_document(engine: str) -> dict:
    """``engine``'s releases and, per variant, every decision's shapes with their releases."""
    t = RELEASE_TABLES[engine]
    return dict(
        engine=engine,
        releases=list(t.releases),
        newest=t.releases[-1],
        variants={v: [_decision_document(d) for d in table] for v, table in t.tables.items()},
    )


def tree_bindings(engine: str, root, variant: str = "") -> tuple[Bindings, str]:
    """``engine``'s table bound for the tree at ``root`` (``partial``: mismatches are listed,
    not raised), and the version the tree names (``unknown`` for a checkout)."""
    t = RELEASE_TABLES[engine]
    tree = SourceTree(root, package=engine.replace("-", "_"), label=t.label, flag=f"--{engine}-source")
    version = tree.version
    release = version if version in t.releases else None
    table = t.tables[variant or next(iter(t.tables))]
    return bind(Path(tree.root), table, release=release, label=t.label, flag=f"--{engine}-source", partial=True), version


def tree_document(engine: str, root, variant: str = "") -> dict:
    """Per decision of the tree at ``root``: ``bound`` (the shape), ``reference`` (absent in the
    release: why) or ``mismatch`` (what was found, what is known)."""
    bindings, version = tree_bindings(engine, root, variant)
    label = RELEASE_TABLES[engine].label
    mismatched = {m.decision.name: m for m in bindings.mismatches}
    rows = []
    for name, b in bindings.bound.items():
        if name in mismatched:
            rows.append(dict(decision=name, state="mismatch", detail=mismatched[name].describe()))
        elif b.shape is None:
            rows.append(dict(decision=name, state="reference", detail=b.why))
        else:
            rows.append(dict(decision=name, state="bound", shape=b.shape.name, detail=b.describe(label)))
    return dict(
        engine=engine, source=str(Path(root).resolve()), version=version, known_release=bindings.release is not None, decisions=rows
    )


def release_matrix(engine: str, variant: str = "") -> list[list[str]]:
    """The table as rows: a header (``release`` and each decision), then per release the name
    of the shape each decision binds to there, or ``reference`` where the release lacks it (what
    ``docs/engines.md`` shows; measured on each release's tree by tests/dist/test_engine_releases.py)."""
    t = RELEASE_TABLES[engine]
    table = t.tables[variant or next(iter(t.tables))]
    rows = [["release", *(d.name for d in table)]]
    for release in t.releases:
        cells = []
        for d in table:
            shape = next((s.name for s in d.shapes if release in s.releases), None)
            cells.append(shape or ("reference" if release in d.absent else "?"))
        rows.append([release, *cells])
    return rows


def release_markdown(engine: str, variant: str = "") -> str:
    rows = release_matrix(engine, variant)
    lines = ["| " + " | ".join(f"`{c}`" if k else c for k, c in enumerate(rows[0])) + " |", "|" + " --- |" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)
