"""The context gather on real gloo worlds: the 256K built-in's prompt runs in 16K chunks, so
from its fifth chunk on each prefill attends to a cached context past vLLM's default 64K-row
workspace, which the gather splits; the reference passes, and the whole-local-length fault
(vllm#28526) fails at that step naming the rank's chunk."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["run", "long-context-256k", "--dcp", "2", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_long_context_gather_passes_and_its_fault_is_caught(capsys):
    code, report = run_json(capsys)
    assert code == 0, report["failure"]
    code, report = run_json(capsys, "--inject", "context-gather-whole-local-len")
    assert code == 1
    failure = report["failure"]
    assert failure["kind"] == "attention-metadata" and failure["request_id"] == "book", failure
    # 5 chunks of 16K before: an 80K context, its first 64K in chunk 0 (32K rows a rank)
    assert failure["step"] == 5
    assert any("context gather chunk 0 local_seq_lens is 40960, expected 32768" in line for line in failure["details"]), failure
