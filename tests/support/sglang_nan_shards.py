"""An ``--engine MODULE:ATTR`` plugin for the empty-shard test: SGLang's engine whose shard
attention leaves what SGLang's Triton decode kernel stores for a request with no key on the
rank (``kernels/ops/attention/decode_attention.py::_fwd_kernel_stage2``: ``acc / e_sum`` with
``e_sum = 0``, so NaN, and an LSE of ``-inf``); dcpsim's own attention gives 0 there. The
source tree is ``$DCPSIM_SGLANG_SOURCE``."""

from __future__ import annotations

import torch

from dcpsim.engine.sglang.adapter import SglangEngine


class NanShardsSglangEngine(SglangEngine):
    def shard_output(self, out: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
        return torch.where(empty[:, None, None], torch.full_like(out, float("nan")), out)
