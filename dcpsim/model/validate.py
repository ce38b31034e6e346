"""The one integer validator every config, spec, layout and run option uses."""

from __future__ import annotations

import numbers

from dcpsim.errors import ConfigError


def is_int(value) -> bool:
    """An integer (Python or numpy), never a bool."""
    if type(value) is int:  # the common case, without the (slow) abstract-class check
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int if it is an integer ``>= minimum``; else a ``ConfigError``
    that names the field: ``NAME must be an integer >= MINIMUM, got VALUE``."""
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


PAGE = "B"
"""The size-list member that stands for a scenario's page size (``--interleave 1,B``)."""


def check_sizes(flag: str, name: str, values, *, page: bool = False) -> list:
    """``values`` (a list of sizes, as a flag such as ``--dcp 1,2,4`` gives them) checked
    member by member as the value alone would be: each an integer ``>= 1`` (``check_int``
    with ``name``), or ``"B"`` where ``page`` allows it; a ``ConfigError`` naming ``flag``
    and the list otherwise."""
    values = list(values)
    if not values:
        raise ConfigError(f"{flag}: expected at least one value")
    out = []
    for value in values:
        if page and value == PAGE:
            out.append(PAGE)
            continue
        try:
            out.append(check_int(name, value))
        except ConfigError as exc:
            raise ConfigError(f"{flag}: {exc} (in {_shown(values)})") from None
    return out


def _shown(values: list) -> str:
    return ",".join(str(v) for v in values)
