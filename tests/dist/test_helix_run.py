"""Helix's layout (``kv_cache_layout = "helix"``) on real gloo worlds, through the command line
(``main`` in this process, the ranks gloo processes; the command in a process of its own:
``test_run.py``): the built-in passes at W = 2 and 4 (with ``--attention`` at 4), its fault is
caught by ``run --inject``, and what Helix cannot express is exit 2. The fault by ``selftest``
with a clean baseline on gloo: ``test_selftest.py``'s sample (it keeps every case of a fault that
applies on a few built-ins, helix-decode-owner-unclamped's one, and its baselines)."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def dcpsim(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m dcpsim ARGS``: the exit code, stdout and stderr."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("extra", [["--dcp", "2"], ["--dcp", "4", "--attention"]])
def test_helix_decode_passes_on_gloo(capsys, extra):
    code, out, err = dcpsim(capsys, "run", "helix-decode", *extra, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["passed"] and report["steps"] > 40


def test_unclamped_decode_owner_is_caught_on_gloo(capsys):
    code, out, err = dcpsim(capsys, "run", "helix-decode", "--dcp", "4", "--inject", "helix-decode-owner-unclamped", "--json")
    assert code == 1, err
    failure = json.loads(out)["failure"]
    assert failure["kind"] == "wrong-content" and failure["expected_owner"] == 0


@pytest.mark.parametrize(
    "extra,field",
    [
        (["--pcp", "2"], "prefill_context_parallel_size"),
        (["--max-cudagraph-capture-size", "8"], "max_cudagraph_capture_size"),
        (["--engine", "dcpsim.engine.example_plugin:ExampleEngine"], 'kv_cache_layout = "helix"'),
    ],
)
def test_what_helix_cannot_express_is_exit_2(capsys, extra, field):
    code, _, err = dcpsim(capsys, "run", "helix-decode", *extra)
    assert code == 2 and field in err, err


def test_a_vllm_layout_scenario_under_helix_names_what_helix_cannot_express(capsys):
    # (drafts are no longer refused: helix-spec-decode; dsv3's prefix cache is)
    code, _, err = dcpsim(capsys, "run", "dsv3", "--kv-cache-layout", "helix")
    assert code == 2 and "enable_prefix_caching" in err, err
