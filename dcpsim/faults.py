"""Known DCP bugs that can be switched on inside the simulated engine (never in the checker).

Each fault wraps the write path's slot computation of one rank. ``--inject
NAME`` turns one on; the checker must then fail the run. The registry maps
names to faults so a new bug class is one new entry.
"""

from __future__ import annotations

import numpy as np

from dcpsim.errors import ConfigError
from dcpsim.layout import PAD, owner_rank


class Fault:
    """The correct engine. A fault subclass overrides one hook to reproduce one bug.

    Hooks are called by the simulated engine only (scheduler, write path);
    the checker always works from the true, unfaulted layouts.
    """

    name = "none"
    bug_class = ""
    description = "no fault: the correct write path"

    def applies_to(self, layouts) -> bool:
        """Whether the bug can show on a scenario with these (true) group layouts."""
        return True

    def engine_layouts(self, scenario, layouts):
        """The group layouts the engine works with (a fault may derive wrong ones)."""
        return layouts

    def slots_for(self, runner, layout, write, row):
        """The write path's (slots, stored index, content) for one request and group."""
        return runner.slots_for(layout, write, row)


class InterleaveOffByOne(Fault):
    name = "interleave-off-by-one"
    bug_class = "off-by-one in the interleave: owner ((p // I) + 1) % W"
    description = "sharded groups place each run of I positions on the next rank"

    def applies_to(self, layouts) -> bool:
        return any(lay.sharded for lay in layouts)

    def slots_for(self, runner, layout, write, row):
        if not layout.sharded:
            return runner.slots_for(layout, write, row)
        return runner.slots_for(layout, write, row, rank=(runner.rank - 1) % layout.dcp_size)


class ReplicatedOwnerOnly(Fault):
    name = "replicated-owner-only"
    bug_class = "semantics section 8, bug 7: a replicated group masked like a sharded one"
    description = "in replicated groups only the position's owner rank writes it"

    def applies_to(self, layouts) -> bool:
        return any(lay.replicated and lay.dcp_size > 1 and lay.storage != "ring" for lay in layouts)

    def slots_for(self, runner, layout, write, row):
        slots, index, content = runner.slots_for(layout, write, row)
        if layout.replicated and layout.dcp_size > 1 and layout.storage != "ring":
            owner = owner_rank(index, dcp_size=layout.dcp_size, interleave_size=layout.interleave_size)
            slots = np.where(owner == runner.rank, slots, PAD)
        return slots, index, content


class ForeignBlock(Fault):
    name = "foreign-block"
    bug_class = "a write into a block the request does not hold (stale or off-by-one block index)"
    description = "positions that belong in the request's last block go to a block it does not hold"

    def slots_for(self, runner, layout, write, row):
        slots, index, content = runner.slots_for(layout, write, row)
        page = layout.states_per_page
        held = set(int(b) for b in row)
        stranger = next(b for b in range(1, len(held) + 2) if b not in held)
        last = int(row[-1])
        hit = (slots >= 0) & (slots // page == last)
        slots = np.where(hit, stranger * page + slots % page, slots)
        return slots, index, content


FAULTS: dict[str, Fault] = {f.name: f for f in (Fault(), InterleaveOffByOne(), ReplicatedOwnerOnly(), ForeignBlock())}


def get_fault(name: str | None) -> Fault:
    if name is None:
        return FAULTS["none"]
    try:
        return FAULTS[name]
    except KeyError:
        raise ConfigError(
            f"--inject: unknown fault {name!r}; known: {', '.join(n for n in FAULTS if n != 'none')}"
        ) from None
