"""``dcpsim merge``: join the reports of ``matrix --shard K/N`` runs into one.

Takes each shard's ``--json`` output or ``--junit`` file (either kind, told apart by
content; the pytest plugin's ``--junitxml`` files carry the same shard record), checks that they are shards 1..N of one matrix, each once
(``campaigns.shard.merge``), writes the whole matrix's JSON list and/or JUnit file, and
exits 1 if any cell failed (2 if the shards do not make one matrix).
"""

from __future__ import annotations

import json
from pathlib import Path

from dcpsim.campaigns import junit
from dcpsim.campaigns.shard import merge
from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError
from dcpsim.plural import plural
from dcpsim.report_file import read_report_text


def add_arguments(p) -> None:
    p.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT",
        help="each shard's matrix --shard K/N --json output or --junit file (or pytest --dcpsim-matrix --junitxml file)",
    )
    p.add_argument("--json-out", metavar="FILE", help="write the merged cells as one matrix --json list")
    p.add_argument("--junit-out", metavar="FILE", help="write the merged cells as one JUnit XML file")


def read_report(path: str) -> list[dict]:
    """A shard's cell entries, from its JSON list or its JUnit XML."""
    text = read_report_text(path)
    if text.lstrip().startswith("<"):
        return junit.read(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: neither a matrix --json report nor JUnit XML ({exc})") from None


def run(args) -> int:
    cells = merge([(path, read_report(path)) for path in args.reports])
    for entry in cells:
        entry.pop("index", None)
        entry.pop("matrix", None)
    if args.json_out:
        try:
            Path(args.json_out).write_text(json.dumps(cells, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--json-out: cannot write {args.json_out}: {exc}") from None
    if args.junit_out:
        junit.write(cells, args.junit_out)
    bad = [e for e in cells if e["status"] in ("fail", "error")]
    counts = {s: sum(e["status"] == s for e in cells) for s in ("pass", "fail", "error", "skipped")}
    for e in bad:
        print(f"{e['cell']} {e['status'].upper()}: {e.get('reason', '')}")
    print(
        f"merged {plural(len(args.reports), 'shard')}: {plural(len(cells), 'cell')}: {counts['pass']} passed, "
        f"{counts['fail']} failed, {plural(counts['error'], 'error')}, {counts['skipped']} skipped"
    )
    return EXIT_CHECK_FAILED if bad else EXIT_OK
