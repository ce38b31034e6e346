"""Report files: their schema version, and reading one a user names (``layout --from-report``,
``merge``) with one clear exit-2 message for a missing or unreadable file."""

from __future__ import annotations

from pathlib import Path

from dcpsim.errors import ConfigError

SCHEMA_VERSION = 1
"""The version of the report documents (``docs/report.schema.json``): every run report
(``run``/``worker``/``replay --json``, each matrix cell's, ``dcpsim.Report.to_json``) and the
``selftest --json`` document carry it as ``schema_version``; it goes up when a field changes
meaning or goes away (a new field keeps it)."""


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
