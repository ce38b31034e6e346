"""Reading a report file a user names (``layout --from-report``, ``merge``): one clear
exit-2 message for a missing or unreadable file."""

from __future__ import annotations

from pathlib import Path

from dcpsim.errors import ConfigError


def read_report_text(path: str) -> str:
    """The text of the report at ``path``."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such report file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a report file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the report: {exc}") from None
