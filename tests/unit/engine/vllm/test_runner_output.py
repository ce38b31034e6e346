"""``dcpsim.engine.vllm.runner_output``: what a step vLLM's scheduler decided writes and samples
(``--vllm-scheduler full``). The contents are the scenario's whatever vLLM decides: a position
the request has no token for never holds a true fingerprint, rejected drafts roll the commit
back, vLLM's ``-1`` padding drafts are never accepted."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.interface import EngineError
from dcpsim.engine.scheduler.request import Request
from dcpsim.engine.vllm import runner_output
from dcpsim.model.scenario import RequestSpec


def request(prompt=40, output=8, acceptance=(1,), computed=None, outputs=0) -> Request:
    req = Request(0, RequestSpec("r", prompt, output, acceptance=acceptance), seed=7, prefix_tokens=None)
    req.num_output = outputs
    req.num_computed = prompt + outputs - 1 if computed is None else computed
    return req


def test_a_prefill_chunk_writes_the_prompt_and_samples_nothing():
    req = request(computed=0)
    write, sampled = runner_output.run(req, 0, 16, [], step=0, events=[])
    assert sampled == [] and req.num_computed == 16 and write.prefill
    assert np.array_equal(write.contents, req.fingerprints[:16])


def test_a_decode_verifies_its_drafts_and_commits_the_accepted_ones():
    req = request(acceptance=(1,))  # 40 known, 39 computed
    events = []
    write, sampled = runner_output.run(req, 39, 3, [11, 12], step=5, events=events)
    assert sampled == [int(t) for t in req.tokens[40:42]]  # one accepted draft and the bonus token
    assert req.num_computed == 41 and req.num_known == 42
    assert write.contents[1] == req.fingerprints[40] and write.contents[2] != req.fingerprints[41]  # the rejected draft
    assert [str(e) for e in events] == ["r: 1/2 drafts accepted"]


def test_a_position_without_a_token_never_holds_a_true_fingerprint():
    req = request()  # 40 known: a step of 2 from 39 computes position 40, which has no token yet
    write, sampled = runner_output.run(req, 39, 2, [], step=5, events=[])
    assert write.contents[0] == req.fingerprints[39] and write.contents[1] != req.fingerprints[40]
    assert req.num_computed == 41  # what vLLM's worker now holds as computed: the checker reads position 40
    assert sampled == [int(req.tokens[40])]


def test_vllms_padding_drafts_are_never_accepted():
    req = request(acceptance=(2,))
    write, sampled = runner_output.run(req, 39, 3, [-1, -1], step=5, events=[])
    assert len(sampled) == 1 and req.num_computed == 40
    assert not np.isin(write.contents[1:], req.fingerprints).any()


@pytest.mark.parametrize("n,drafts", [(1, [1, 2]), (20, [])])
def test_a_schedule_no_model_runner_can_execute_is_an_engine_error(n, drafts):
    req = request(prompt=40, output=8, outputs=0)  # 48 tokens in all
    with pytest.raises(EngineError, match="vLLM's scheduler scheduled"):
        runner_output.run(req, 39, n, drafts, step=5, events=[])
