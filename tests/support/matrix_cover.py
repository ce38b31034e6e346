"""Which cells of ``matrix``'s default grid the full matrix runs too.

The default grid leaves each group at its own page; the full grid names the page ``B`` of
every cell (``--block-size B``). Where that override changes nothing (the scenario is the
same but for ``config.block_size``, and the groups' geometries are equal) the two cells of one
id are one run of the reference engine, so a session that collects both runs it once.
"""

from __future__ import annotations

import dataclasses

from dcpsim.campaigns import matrix as mx
from dcpsim.engine.reference import ReferenceEngine


def same_run(default: mx.CellResult, full: mx.CellResult) -> bool:
    """The two cells are one run: the same id, the scenarios equal once the full cell's
    ``config.block_size`` is set on the default's, and the same group geometries."""
    if default.cell.id != full.cell.id or default.scenario is None or full.scenario is None:
        return False
    a, b = default.scenario, full.scenario
    if dataclasses.replace(a, config=dataclasses.replace(a.config, block_size=b.config.block_size)) != b:
        return False
    engine = ReferenceEngine()
    return engine.geometries(a.layers, a.config) == engine.geometries(b.layers, b.config)


def covered(default_cells: list[mx.CellResult], full_cells: list[mx.CellResult]) -> set[str]:
    """The ids of the default cells that one of ``full_cells`` runs."""
    by_id = {c.cell.id: c for c in full_cells}
    return {c.cell.id for c in default_cells if c.cell.id in by_id and same_run(c, by_id[c.cell.id])}
