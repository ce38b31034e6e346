"""``ThreadCollectives``: the in-process collectives the tests and ``--in-process`` run on."""

from __future__ import annotations

import torch

from dcpsim.harness.collectives import run_in_threads


def test_thread_collectives_all_to_all_and_reduce_scatter():
    W = 3

    def body(_, coll):
        r = coll.rank
        t = torch.arange(W * 2, dtype=torch.float32).reshape(W, 2) + 100 * r
        a2a = coll.all_to_all_tensor(t)
        rs = coll.reduce_scatter_tensor(t)
        return a2a, rs, coll.bytes_sent

    for r, (a2a, rs, sent) in enumerate(run_in_threads(body, None, W)):
        assert torch.equal(a2a, torch.tensor([[2 * r, 2 * r + 1]], dtype=torch.float32) + 100 * torch.arange(W)[:, None])
        assert torch.equal(rs, torch.tensor([2 * r, 2 * r + 1], dtype=torch.float32) * W + 300)
        assert sent == 2 * W * 2 * 4
