"""``python -m dcpsim list``: one line per built-in scenario, as docs/commands.md says; ``--verbose``
adds its layers, requests and groups."""

from __future__ import annotations

import json

from dcpsim.cli import main
from dcpsim.scenarios.registry import builtin_scenario_names


def test_list_prints_one_line_per_scenario(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = builtin_scenario_names()
    assert [line.split()[0] for line in lines] == names
    dsv3 = lines[names.index("dsv3")]
    assert "DeepSeek-V3" in dsv3 and "groups:" not in dsv3


def test_list_verbose_adds_layers_requests_and_groups(capsys):
    assert main(["list", "--verbose"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * len(builtin_scenario_names())
    i = [line.split()[0] for line in lines].index("dsv3")
    assert lines[i + 1].split() == ["61", "layers,", "9", "requests;", "groups:", "MLAAttention", "(sharded)"]
    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["dsv3"]["layers"] == 61 and rows["dsv3"]["requests"] == 9
