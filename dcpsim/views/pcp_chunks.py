"""The PCP part of ``dcpsim layout --pcp P``: for one prefill row, which PCP rank computes
each position's KV (chunks ``r`` and ``2P - 1 - r`` of rank ``r``), before the group
all-gathers it and each rank writes what its DCP slot mapping gives it. Pure: the numbers
come from ``dcpsim.model.parallel``."""

from __future__ import annotations

from dcpsim.errors import ConfigError
from dcpsim.model.parallel import chunk_computer, pcp_chunk_size, pcp_chunks, pcp_replicated

GRID_WIDTH = 64


def pcp_chunk_view(positions: list[int], pcp: int, dcp: int, start: int, stop: int | None) -> dict:
    """Who computes each of ``positions`` in a prefill row ``[start, stop)`` (default: up to
    the last position shown): a PCP rank, ``"all"`` (a replicated row) or ``None``
    (outside the row)."""
    if pcp < 1 or start < 0:
        raise ConfigError(f"--pcp must be >= 1 and --prefill-start >= 0, got {pcp} and {start}")
    stop = max(positions) + 1 if stop is None else stop
    if stop <= start:
        raise ConfigError(f"the prefill row [{start}, {stop}) is empty: --prefill-start must be below the last position shown")
    q = stop - start
    replicated = pcp_replicated(q, True, pcp, dcp)
    computer = None if replicated else chunk_computer(q, pcp)
    by_position = []
    for p in positions:
        if not start <= p < stop:
            by_position.append(None)
        else:
            by_position.append("all" if replicated else int(computer[p - start]))
    chunks = {} if replicated else {str(r): [[start + o, start + o + n] for o, n in pcp_chunks(q, pcp, r)] for r in range(pcp)}
    return dict(
        pcp=pcp,
        dcp=dcp,
        row=[start, stop],
        query_len=q,
        replicated=replicated,
        chunk_size=pcp_chunk_size(q, pcp),
        chunks=chunks,
        computed_by=by_position,
    )


def pcp_lines(v: dict, positions: list[int]) -> list[str]:
    """The text section: the rule, each rank's chunks, and a line of computing ranks."""
    P, (start, stop), q = v["pcp"], v["row"], v["query_len"]
    out = [
        "",
        f"PCP: prefill row {start}..{stop - 1} ({q} tokens), prefill_context_parallel_size={P}, decode_context_parallel_size={v['dcp']}",
    ]
    if v["replicated"]:
        why = (
            "PCP is off"
            if P == 1
            else (f"too short for {2 * P} chunks of {v['chunk_size']} with DCP on (vLLM replicates it): every PCP rank computes all of it")
        )
        out.append(f"  not split: {why}")
    else:
        out.append(
            f"  split into {2 * P} chunks of {v['chunk_size']}; PCP rank r computes chunks r and {2 * P - 1}-r, "
            "then the group all-gathers the chunks' KV and each rank writes its DCP slots"
        )
        for r, pieces in v["chunks"].items():
            out.append(f"  pcp rank {r}: " + ", ".join(f"{a}..{b - 1}" for a, b in pieces))
    marks = "".join("." if c is None else "*" if c == "all" else str(c) if c < 10 else "+" for c in v["computed_by"])
    out.append(f"  computed by (per position {positions[0]}..{positions[-1]}; * = every rank, . = outside the row):")
    out += [f"    {marks[i : i + GRID_WIDTH]}" for i in range(0, len(marks), GRID_WIDTH)]
    return out
