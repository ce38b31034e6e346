"""``dcpsim.engine.vllm.merge``: the ``GroupCoordinator`` stand-in and the
``torch.distributed`` all-to-all the combine wrappers see, over thread collectives, do what
vLLM's do; the row sample of a big merge is deterministic and keeps its first and last row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcpsim.engine.loading.interpreter import sample_rows
from dcpsim.engine.vllm.merge import CpGroup, _Dist
from dcpsim.harness.collectives import run_in_threads


@pytest.mark.parametrize("W", [1, 2, 3])
def test_the_stand_in_gathers_scatters_and_reduces_like_a_group_coordinator(W):
    data = [torch.arange(W * 4 * 2 * W, dtype=torch.float32).reshape(4, 2 * W, W) + 100 * r for r in range(W)]

    def body(_, coll):
        g = CpGroup(coll)
        x = data[g.rank_in_group]
        return g.all_gather(x, dim=0), g.reduce_scatter(x, dim=1), g.all_reduce(x)

    total = sum(data)
    for r, (gathered, scattered, reduced) in enumerate(run_in_threads(body, None, W)):
        assert torch.equal(gathered, torch.cat(data, dim=0))
        assert torch.equal(scattered, total[:, 2 * r : 2 * r + 2])  # this rank's heads, summed over ranks
        assert torch.equal(reduced, total)


def test_all_to_all_single_exchanges_chunks():
    W = 3

    def body(_, coll):
        g = CpGroup(coll)
        send = torch.tensor([[10 * g.rank_in_group + k] * 2 for k in range(W)], dtype=torch.float32)
        recv = torch.empty_like(send)
        _Dist.all_to_all_single(recv.view(-1), send.view(-1), group=g.device_group, async_op=True).wait()
        return recv

    for r, recv in enumerate(run_in_threads(body, None, W)):
        assert recv[:, 0].tolist() == [10 * s + r for s in range(W)]  # chunk s came from rank s


def test_the_row_sample():
    assert sample_rows(5, 8, 64).tolist() == [0, 1, 2, 3, 4]  # 40 programs: every row
    rows = sample_rows(1000, 8, 64)
    assert len(rows) == 8 and rows[0] == 0 and rows[-1] == 999 and np.all(np.diff(rows) > 0)
    assert sample_rows(10, 128, 64).tolist() == [0]  # more heads than the budget: one row
