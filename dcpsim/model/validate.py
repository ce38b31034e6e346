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
