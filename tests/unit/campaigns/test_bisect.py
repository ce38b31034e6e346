"""``engine bisect``'s campaign on stand-in runs (its rows, the first change, the range) and
``run --exit-codes git-bisect``'s mapping; the real sweep is tests/dist/test_engine_releases.py."""

from __future__ import annotations

import types

import pytest

from dcpsim.campaigns.bisect import bisect, release_range
from dcpsim.cli import exit_codes, main
from dcpsim.errors import ConfigError


def test_a_release_range_is_the_known_releases_between_both_ends():
    assert release_range("vllm", "0.31.0..0.33.0") == ["0.31.0", "0.32.0", "0.33.0"]
    assert release_range("sglang", "0.5.22..") == ["0.5.22", "0.5.23"]
    assert release_range("sglang", "..0.5.19") == ["0.5.18", "0.5.19"]
    with pytest.raises(ConfigError, match="0.31.5 is not a vLLM release dcpsim knows"):
        release_range("vllm", "0.31.5..0.33.0")
    with pytest.raises(ConfigError, match="0.33.0 comes after 0.31.0"):
        release_range("vllm", "0.33.0..0.31.0")
    with pytest.raises(ConfigError, match="expected A..B"):
        release_range("vllm", "0.33.0")


def _failure(kind):
    return types.SimpleNamespace(kind=kind, step=3, request_id="r0", index_kind="position", index=17, message="bad")


def test_bisect_rows_and_the_first_change():
    verdicts = {"0.5.20": None, "0.5.21": None, "0.5.22": "write-violation", "0.5.23": "write-violation"}
    fetched, ran = [], []

    def fetch(requirement):
        fetched.append(requirement)
        return f"/trees/{requirement}"

    def run(scenario, **options):
        ran.append(options)
        release = options["sglang_source"].rsplit("==", 1)[1]
        if release == "0.5.20":
            raise ConfigError("SGLang 0.5.20 cannot run this")
        kind = verdicts[release]
        return types.SimpleNamespace(failure=None if kind is None else _failure(kind))

    report = bisect("mla-norope", "sglang", ["0.5.20", "0.5.21", "0.5.22", "0.5.23"], options={"dcp": 2}, fetch=fetch, run=run)
    assert fetched == ["sglang==0.5.20", "sglang==0.5.21", "sglang==0.5.22", "sglang==0.5.23"]
    assert all(o["engine"] == "sglang" and o["dcp"] == 2 for o in ran)
    assert [(r.release, r.verdict, r.exit_code, r.kind) for r in report.rows] == [
        ("0.5.20", "refused", 2, None),
        ("0.5.21", "pass", 0, None),
        ("0.5.22", "fail", 1, "write-violation"),
        ("0.5.23", "fail", 1, "write-violation"),
    ]
    assert report.rows[2].where == "step 3, request r0, position 17"
    assert report.first_change == ("0.5.21", "refused", "pass")
    text = report.text()
    assert "first change: SGLang 0.5.21 (refused -> pass)" in text and "0.5.22     fail     [write-violation]" in text
    assert report.to_dict()["first_change"] == {"release": "0.5.21", "before": "refused", "after": "pass"}


def test_every_release_agreeing_has_no_change():
    run = lambda scenario, **o: types.SimpleNamespace(failure=None)
    report = bisect("dsv3", "vllm", ["0.33.0", "0.34.0"], options={}, fetch=lambda r: r, run=run)
    assert report.first_change is None and "every release: pass" in report.text()


@pytest.mark.parametrize("code, expected", [(0, 0), (1, 1), (2, 125), (3, 125), (130, 130)])
def test_git_bisect_exit_codes(code, expected):
    assert exit_codes.mapped(code, "git-bisect") == expected
    assert exit_codes.mapped(code, "dcpsim") == code


def test_run_speaks_git_bisect(capsys):
    assert main(["run", "dsv3", "--dcp", "0", "--exit-codes", "git-bisect"]) == 125  # could not judge: skip
    with pytest.raises(SystemExit) as usage:
        main(["run", "dsv3", "--no-such-flag", "--exit-codes", "git-bisect"])
    assert usage.value.code == 125
    capsys.readouterr()
