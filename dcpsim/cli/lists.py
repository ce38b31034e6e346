"""Comma lists of sizes on the command line (``--dcp 1,2,4,8``, ``--interleave 1,8,B``).

One rule for every list flag: a member is judged as the value alone would be, so ``--dcp 1,-2``
is the same error as ``--dcp -2`` (``NAME must be an integer >= 1, got -2``), with the flag and
the list it came from (``dcpsim.model.validate.check_sizes``, which the Python API's lists go
through too); nothing runs.
"""

from __future__ import annotations

from dcpsim.errors import ConfigError
from dcpsim.model.validate import PAGE, check_sizes


def size_list(text: str, flag: str, name: str, *, page: bool = False) -> list:
    """The members of ``text`` in order: ints ``>= 1`` (``name`` is the field they set), and
    ``"B"`` where ``page`` allows it. A member that is empty, not an integer or below 1 is a
    ``ConfigError`` naming ``flag``."""
    values: list = []
    for token in (t.strip() for t in text.split(",")):
        if page and token == PAGE:
            values.append(PAGE)
            continue
        try:
            values.append(int(token))
        except ValueError:
            what = "an integer or B" if page else "an integer"
            raise ConfigError(f"{flag}: {token!r} is not {what} (in {text!r})") from None
    return check_sizes(flag, name, values, page=page)
