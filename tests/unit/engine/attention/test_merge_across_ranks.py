"""``ReferenceEngine.merge_across_ranks`` over thread collectives: both variants merge the
ranks' partial states into the same heads as ``merge_attention_states`` does in one place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcpsim.engine.attention.merge import merge_attention_states
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.harness.collectives import run_in_threads


@pytest.mark.parametrize("variant", ["allgather", "alltoall"])
@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("W", [1, 2, 3])
def test_merge_across_ranks_equals_the_local_merge(variant, base, W):
    q, H, D = 5, 2 * W, 4
    rng = np.random.default_rng(W)
    outs = torch.from_numpy(rng.standard_normal((W, q, H, D)).astype(np.float32))
    lses = torch.from_numpy(rng.standard_normal((W, q, H)).astype(np.float32))
    lses[0, 1] = float("-inf")  # rank 0 holds no key for query 1
    want_o, want_l = merge_attention_states(outs, lses, base=base)
    hs = H // W

    def body(_, coll):
        r = coll.rank
        return ReferenceEngine().merge_across_ranks(outs[r].clone(), lses[r].clone(), coll, variant=variant, base=base)

    slices = set()
    for o, l, c in run_in_threads(body, None, W):
        assert o.shape == (q, hs, D) and l.shape == (q, hs)
        assert torch.allclose(o, want_o[:, c * hs : (c + 1) * hs], atol=1e-5)
        assert torch.allclose(l, want_l[:, c * hs : (c + 1) * hs], atol=1e-5)
        slices.add(c)
    assert slices == set(range(W))  # every slice of heads is some rank's
