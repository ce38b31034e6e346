"""dcpsim's checks of this repository's DCP code: copy this file to ``tests/dcpsim/`` of a vLLM
checkout or fork (docs/api.md). With dcpsim installed, pytest loads its plugin by itself: no
conftest. The engine under test is the session's ``--dcpsim-engine`` (``vllm`` with
``--dcpsim-vllm-source .`` for this checkout); the two commands are in README.md here."""

import pytest


@pytest.mark.parametrize("dcp, interleave", [(2, 1), (4, 16)])
def test_deepseek_v3_layout(dcpsim_run, dcp, interleave):
    """The MLA model at W ranks: every rank writes the right positions into the right slots."""
    dcpsim_run("dsv3", dcp=dcp, interleave=interleave).raise_for_failure()


def test_hybrid_model_with_attention(dcpsim_run):
    """Sliding-window, compressed and Mamba layers, and the attention merge across the ranks."""
    dcpsim_run("dsv41-hybrid", dcp=4, attention=True).raise_for_failure()


def test_a_failure_names_the_first_bad_position(dcpsim_run):
    """What a failing run reports (on the reference engine with a known bug switched on)."""
    report = dcpsim_run("dsv3", dcp=2, interleave=4, engine="reference", inject="interleave-off-by-one")
    assert not report.passed
    assert (report.failure.kind, report.failure.first_bad_index) == ("wrong-content", 0)
