"""Which cells a matrix run takes, and the JSON entries it reports: shared by ``dcpsim matrix``,
``dcpsim.matrix`` and the pytest plugin's ``--dcpsim-matrix``.

``matrix_cells`` lists the whole matrix (``--full``: ``campaigns.grid``; else the lists
given, each defaulting to ``campaigns.matrix``'s); ``shard_indices`` picks ``--shard K/N``;
``entries`` gives the cells as ``matrix --json`` prints them, stamped with the shard record
``dcpsim merge`` checks (``campaigns.shard``).
"""

from __future__ import annotations

import json

from dcpsim.campaigns import matrix as mx
from dcpsim.campaigns import shard as sh
from dcpsim.campaigns.grid import full_grid
from dcpsim.engine.choice import EngineChoice
from dcpsim.errors import ConfigError
from dcpsim.model.validate import check_sizes
from dcpsim.options import flatten
from dcpsim.scenarios.registry import builtin_scenario_names
from dcpsim.verify.options import CheckOptions


def matrix_cells(
    scenarios=None, *, dcps=None, interleaves=None, block_sizes=None, pcps=None, full: bool = False, force: bool = False,
    dry_run: bool = True,
) -> list[mx.CellResult]:  # fmt: skip
    """The matrix's full cell list: ``scenarios`` (default every built-in) x ``dcps`` x
    ``interleaves`` (integers, or ``"B"``: the scenario's page) x ``block_sizes`` x ``pcps``;
    ``full``: the full grid instead (no other list may be given)."""
    scenarios = list(scenarios or builtin_scenario_names())
    if full:
        given = [f for f, v in (("--dcp", dcps), ("--interleave", interleaves), ("--block-size", block_sizes), ("--pcp", pcps)) if v]
        if given:
            raise ConfigError(f"--full fixes the grid: drop {', '.join(given)}")
        return full_grid(scenarios)  # no dry runs: the layouts and pools are validated
    dcps = check_sizes("--dcp", "decode_context_parallel_size", dcps or mx.DEFAULT_DCP)
    block_sizes = block_sizes and check_sizes("--block-size", "block_size", block_sizes)
    pcps = pcps and check_sizes("--pcp", "prefill_context_parallel_size", pcps)
    given = [_size(i) for i in (interleaves or mx.DEFAULT_INTERLEAVE)]
    interleaves = [str(i) for i in check_sizes("--interleave", "cp_kv_cache_interleave_size", given, page=True)]
    return mx.expand(scenarios, dcps, interleaves, list(block_sizes or [None]), pcps=list(pcps or [None]), force=force, dry_run=dry_run)


def _size(value):
    """An interleave list member as given (``4``, ``"4"``, ``"B"``): a numeral as its int."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return value.strip()
    return value


def shard_indices(cells: list[mx.CellResult], shard: tuple[int, int] | None) -> list[int]:
    """The indices of shard ``(K, N)`` of ``cells`` (every index without a shard)."""
    return sh.select(cells, *shard) if shard is not None else list(range(len(cells)))


def matrix_digest(cells: list[mx.CellResult], engine: EngineChoice, check: CheckOptions) -> str:
    """The hash that marks every shard of one matrix: its cell ids and the engine options."""
    return sh.matrix_hash([r.cell.id for r in cells], dict(flatten(engine), verify=check.mode))


def entry(res: mx.CellResult) -> dict:
    """One cell of the ``matrix --json`` list."""
    return {
        "cell": res.cell.id,
        "status": res.status,
        "reason": res.reason,
        "seconds": round(res.seconds, 3),
        "report": json.loads(res.report.to_json()) if res.report else None,
    }


def entries(
    results: list[mx.CellResult], everything: list[mx.CellResult], indices: list[int], *, shard: tuple[int, int] | None,
    engine: EngineChoice, check: CheckOptions,
) -> list[dict]:  # fmt: skip
    """The ``matrix --json`` list of ``results`` (the cells ``indices`` of ``everything``),
    each stamped with its shard record when ``shard`` is given."""
    out = [entry(r) for r in results]
    if shard is not None:
        sh.stamp(out, indices, digest=matrix_digest(everything, engine, check), total=len(everything), shard=shard)
    return out
