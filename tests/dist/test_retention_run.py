"""A window released one token early at the step's allocation, on a real gloo world: caught by
the retention judge at the read (``retention-at-read``), without ``--attention``."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main

pytestmark = pytest.mark.dist


@pytest.mark.slow
def test_a_window_released_one_early_is_caught_at_the_read_on_gloo(capsys):
    code = main(["run", "gpt-oss-hybrid", "--dcp", "2", "--inject", "sliding-window-release-one-early", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and not report["passed"]
    f = report["failure"]
    assert f["kind"] == "retention-at-read"
    assert (f["step"], f["query_position"], f["index"], f["request_id"]) == (7, 686, 559, "long-1")
    assert f["group"].startswith("SlidingWindow") and f["expected_owner"] == "all"
    assert [d.split(":")[0].split(" group")[0] for d in f["details"]] == ["rank 0 step 7", "rank 1 step 7"]
