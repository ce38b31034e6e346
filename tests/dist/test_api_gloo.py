"""``dcpsim.run`` on real gloo worlds (its default) gives the verdict and the document of
``python -m dcpsim run --json`` in a process of its own: a plain run and a P/D run, whose
documents follow docs/report.schema.json."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import dcpsim
from support.helpers import run_cli, without_timings

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "report.schema.json").read_text(encoding="utf-8"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, flags, kwargs",
    [
        ("llama-gqa", ("--dcp", "2", "--interleave", "4"), dict(dcp=2, interleave=4)),
        ("pd-dsv3", (), {}),
    ],
)
def test_a_gloo_run_gives_the_cli_verdict_and_document(name, flags, kwargs):
    proc = run_cli(["run", name, *flags, "--json"])
    assert proc.returncode == 0, proc.stderr
    cli = json.loads(proc.stdout)
    report = dcpsim.run(name, **kwargs)
    assert report.passed and cli["passed"]
    assert without_timings(report.to_dict()) == without_timings(cli)
    assert report.ranks and all(r.peak_rss_mb > 0 for r in report.ranks)
    jsonschema.Draft202012Validator(SCHEMA).validate(cli)  # a P/D report's only check against the schema


@pytest.mark.dist
@pytest.mark.slow
def test_a_broken_gloo_run_fails_with_its_kind():
    report = dcpsim.run("dsv3", dcp=2, inject="interleave-off-by-one", interleave=4)
    assert report.passed is False and report.failure.kind == "wrong-content"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, fault, kind, instance",
    [
        ("pd-dsv3", "nixl-one-source-rank", "wrong-content", "decode"),
        ("pd-dsv3", "nixl-skips-empty-rank-notice", "pd-notification", None),
        ("pd-async-recycled", "nixl-page-tail-not-cleared", "pd-page-tail", "decode"),
    ],
)
def test_a_broken_pd_run_names_its_failure_as_the_cli_does(name, fault, kind, instance):
    """A P/D run's failure in the instances, in the transfer between them and in the decode
    instance's page tails: the API's failure is the report's first, as ``run --json`` gives it."""
    report = dcpsim.run(name, inject=fault)
    assert report.passed is False and report.failure is not None, report.text()
    assert (report.failure.kind, report.failure.instance) == (kind, instance), report.failure
    assert report.failure.message == report.source.failure.message
