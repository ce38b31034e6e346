"""Builds the ranks' forkserver makes once before it forks them (``dcpsim.engine.loading.forkserver``),
and the command line's guess of the engine to build there."""

from __future__ import annotations

from dcpsim.cli import engine_flags
from dcpsim.engine.loading import forkserver

BUILT: list = []


def record(**kwargs):
    BUILT.append(kwargs)


def refuse(**kwargs):
    raise ValueError("a build the forkserver cannot make")


def test_asked_builds_accumulate_once_each_and_run_in_order(monkeypatch):
    monkeypatch.delenv(forkserver.PRELOAD_ENV, raising=False)
    BUILT.clear()
    here = f"{__name__}:record"
    forkserver.ask([(here, {"n": 1})])
    forkserver.ask([(here, {"n": 1}), (f"{__name__}:refuse", {}), (here, {"n": 2})])
    assert forkserver.asked() == [(here, {"n": 1}), (f"{__name__}:refuse", {}), (here, {"n": 2})]
    assert forkserver.run_asked() == 2  # the refused build is left to the ranks
    assert BUILT == [{"n": 1}, {"n": 2}]


def test_an_unreadable_request_asks_for_nothing(monkeypatch):
    monkeypatch.setenv(forkserver.PRELOAD_ENV, "not json")
    assert forkserver.asked() == [] and forkserver.run_asked() == 0


def test_the_command_line_engine_flags_as_engine_choice_fields():
    argv = ["run", "dsv3", "--engine", "vllm", "--vllm-source=/x", "--vllm-merge-programs", "16", "--dcp", "4", "--vllm-runner"]
    assert engine_flags(argv) == {"name": "vllm", "vllm_source": "/x", "vllm_merge_programs": 16}
