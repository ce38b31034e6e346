"""``write_loaded`` with the blocks an engine's connector scheduler chose (``PromptLoads.pulls``, filled
by vLLM's NIXL scheduler side): the received entries land in the chosen block ids, lined up from the
first block the local hit does not cover; a block the connector did not choose is not written."""

from __future__ import annotations

import types

import numpy as np

from dcpsim.engine.connector import PromptLoads, pulled_row, write_loaded
from dcpsim.engine.worker.kv_store import KVStore
from dcpsim.model.kv_entry import CONTENT, EMPTY, FIELDS, GROUP

PAGE = 4


def _runner(num_blocks: int = 8):
    store = KVStore(0, num_blocks, PAGE)
    return types.SimpleNamespace(geometries=[types.SimpleNamespace(group_id=0)], stores=[store])


def _entries(n: int) -> np.ndarray:
    rows = np.zeros((n, len(FIELDS)), np.int64)
    rows[:, CONTENT] = np.arange(100, 100 + n)  # a distinct content per entry
    return rows


def _plan(row):
    return types.SimpleNamespace(loaded=((0, 10),), rows_before=({0: np.asarray(row, np.int64)},))


def _block(runner, block_id: int) -> np.ndarray:
    return runner.stores[0].data[block_id].numpy()[:, CONTENT]


def test_entries_go_to_the_chosen_blocks_not_the_plans_row():
    runner, local = _runner(), np.arange(10)
    received = {0: {0: (local, _entries(10))}}
    loads = PromptLoads("nixl")
    loads.pulls[0] = {0: (0, [5, 6, 7])}
    assert write_loaded(_plan([1, 2, 3]), runner, received, loads.pulls) == 10
    assert _block(runner, 5).tolist() == [100, 101, 102, 103] and _block(runner, 7).tolist()[:2] == [108, 109]
    assert (runner.stores[0].data[1:4, :, GROUP] == EMPTY).all()  # the plan's row was not used


def test_blocks_before_the_first_chosen_and_past_the_last_are_not_written():
    runner, local = _runner(), np.arange(12)
    received = {0: {0: (local, _entries(12))}}
    pulls = {0: {0: (1, [6])}}  # the local hit covers block 0; the connector chose one block only
    assert pulled_row(pulls[0][0]).tolist() == [-1, 6]
    assert write_loaded(_plan([1, 2, 3]), runner, received, pulls) == PAGE
    assert _block(runner, 6).tolist() == [104, 105, 106, 107]
    assert (runner.stores[0].data[[0, 1, 2, 3, 4, 5, 7], :, GROUP] == EMPTY).all()


def test_without_pulls_the_plans_row_is_used():
    runner, local = _runner(), np.arange(6)
    assert write_loaded(_plan([3, 4]), runner, {0: {0: (local, _entries(6))}}) == 6
    assert _block(runner, 3).tolist() == [100, 101, 102, 103]
