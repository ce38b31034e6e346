"""The example scenario of docs/scenarios.md (its first ```toml block) loads, runs and passes; a
misspelled field gets a clear message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dcpsim.campaigns.fuzz import check
from dcpsim.errors import ScenarioError
from dcpsim.scenarios.load import load_scenario

SCENARIOS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "scenarios.md"


def example_toml() -> str:
    blocks = re.findall(r"```toml\n(.*?)```", SCENARIOS_PAGE.read_text(), flags=re.S)
    assert blocks, "docs/scenarios.md has no TOML example"
    return blocks[0]


def test_readme_example_runs_and_passes(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(example_toml())
    scenario = load_scenario(str(path))
    assert scenario.aliases == {} and len(scenario.layers) >= 2
    report = check(scenario)
    assert report.passed, report.text()
    assert report.schedule["preemptions"] >= 1 and report.schedule["finished"] == len(scenario.requests)


def test_readme_example_with_a_typo_names_file_field_and_fix(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text(example_toml().replace("sliding_window = 64", "sliding_windw = 64"))
    with pytest.raises(ScenarioError) as exc:
        load_scenario(str(path))
    msg = str(exc.value)
    assert f"{path}: layers[1].sliding_windw: unknown field (did you mean 'sliding_window'?)" in msg
    assert f"{path}: layers[1].sliding_window: is required" in msg
