"""vllm-ascend's decode merge across the DCP ranks (``attention/context_parallel/common_cp.py``),
run over the rank's gloo group.

The plugin's decode attention (``mla_cp.py``, ``attention_cp.py``) merges in two calls:
``_process_attn_out_lse`` packs each rank's partial output and LSE as ``[q, H, D + 1]`` and sends
head slice ``i`` to DCP rank ``i`` (``dist.all_to_all_single``), then ``_npu_attention_update``
unpacks every rank's partials of this rank's ``H / W`` heads and combines them with
``torch_npu.npu_attention_update``. Here the collective is the rank's group (dcpsim's
``all_to_all_tensor``, gloo's ``all_to_all_single``), the DCP/PCP groups are this rank's, and the
NPU op is the plugin's own plain-torch combine, ``_update_out_and_lse``
(``LSE = logsumexp_i LSE_i``, ``O = sum_i exp(LSE_i - LSE) O_i``): every line of the merge is the
plugin's. The plugin's LSEs are natural logs; a run in base 2 is converted on the way in and out.

With PCP (``W == P``, the plugin's PCP ``P`` with DCP 1: ``engine.vllm.parallel_rules``) the rank's
group is the plugin's PCP group: no all-to-all, every rank's partials of every head all-gathered
(``get_pcp_group().all_gather``) and combined on each rank, which then keeps its slice of the heads
as dcpsim's merge hands one on.

The module's globals (``dist``, ``torch_npu``, the group getters) are set once, to stand-ins that
read the calling rank's group from a thread-local: ranks that are threads share the module. The
merge is plain torch, so it runs without the interpreter lock (``call_unlocked``): thread ranks
must all enter the all-to-all.
"""

from __future__ import annotations

import math
import threading
import types

import torch

from dcpsim.engine.interface import MergedBy
from dcpsim.engine.vllm.functions import call_unlocked

PROCESS = "vllm_ascend.attention.context_parallel.common_cp._process_attn_out_lse"
UPDATE = "vllm_ascend.attention.context_parallel.common_cp._npu_attention_update"


class _RankGroup(threading.local):
    """The calling rank's DCP group (dcpsim ``Collectives``) and its last combined LSE."""

    collectives = None
    merged_lse: torch.Tensor | None = None
    pcp = 1
    """The plugin's PCP size in the merge under way (its DCP size is the group's over it)."""


class AscendMerge:
    """The plugin's merge on one rank: ``merge(out, lse, group, base)``."""

    def __init__(self, module, process, update, combine):
        self.process, self.update, self.combine = process, update, combine
        self._rank = _RankGroup()
        rank = self._rank

        def all_to_all_single(output, input, group=None):  # torch.distributed's parameter names
            world = rank.collectives.world_size
            output.copy_(rank.collectives.all_to_all_tensor(input.reshape(world, -1).contiguous()).reshape(output.shape))

        def npu_attention_update(lse_list, out_list, update_type):
            out, lse = combine(torch.stack(list(out_list)), torch.stack(list(lse_list)).unsqueeze(-1))
            rank.merged_lse = lse.squeeze(-1)  # _npu_attention_update keeps only the output
            return out, lse

        def dcp_group():
            return types.SimpleNamespace(device_group=rank.collectives, world_size=rank.collectives.world_size // rank.pcp)

        def pcp_all_gather(tensor, dim=0):
            return torch.cat(list(rank.collectives.all_gather_tensor(tensor)), dim=dim)

        module.dist = types.SimpleNamespace(all_to_all_single=all_to_all_single)
        module.torch_npu = types.SimpleNamespace(npu_attention_update=npu_attention_update)
        module.get_pcp_group = lambda: types.SimpleNamespace(world_size=rank.pcp, all_gather=pcp_all_gather)
        module.get_dcp_group = dcp_group
        module.get_decode_context_model_parallel_world_size = lambda: rank.collectives.world_size // rank.pcp

    def merge(self, out: torch.Tensor, lse: torch.Tensor, group, base: str, pcp: int = 1):
        """This rank's ``H / W`` merged heads of ``out [q, H, D]``, ``lse [q, H]``: ``(out, lse,
        slice, MergedBy)``; ``pcp``: the plugin's PCP size (``group`` is then its PCP group)."""
        q, h, d = out.shape
        ln2 = math.log(2.0)
        natural = lse * ln2 if base == "2" else lse
        self._rank.collectives, self._rank.pcp = group, pcp
        packed = call_unlocked(PROCESS, self.process, out, natural.unsqueeze(-1))
        merged = call_unlocked(UPDATE, self.update, d, packed)
        merged_lse = self._rank.merged_lse.reshape(q, -1)
        if pcp > 1:  # every head merged on every PCP rank: this rank's slice of them
            share = h // group.world_size
            merged = merged[:, group.rank * share : (group.rank + 1) * share]
            merged_lse = merged_lse[:, group.rank * share : (group.rank + 1) * share]
        if base == "2":
            merged_lse = merged_lse / ln2
        return merged.to(out.dtype), merged_lse.to(lse.dtype), group.rank, MergedBy(f"vllm-ascend {UPDATE}", q, q)
