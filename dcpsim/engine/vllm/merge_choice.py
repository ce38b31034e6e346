"""``--vllm-merge``: with ``vllm`` (the default) every cross-rank merge of ``--attention`` runs
vLLM's combine wrappers (``dcpsim.engine.vllm.merge``) on a sample of its rows, the reference
merging the rest; with ``reference`` the reference merges. At W = 1 vLLM combines nothing
(its layers skip the wrappers), and neither does dcpsim."""

from __future__ import annotations

import torch

from dcpsim.engine.interface import MergedBy
from dcpsim.engine.loading.interpreter import sample_rows
from dcpsim.engine.vllm.functions import VllmCallError
from dcpsim.engine.vllm.merge import ALLGATHER, ALLTOALL

VLLM_MERGES = ("vllm", "reference")
"""``--vllm-merge``: vLLM's combine wrappers (the default) or the reference merge."""
MERGE_HELPERS = ("vllm.model_executor.warmup.jit_warmup", "vllm.model_executor.warmup.jit_warmup_triton_helper")
"""vLLM's JIT launcher the correction kernel launches through (from 0.27.1 on; loaded where
the tree has it)."""


def merge_decision(merge: str, backend, programs: int, modules: dict) -> str:
    """Who makes ``merge_across_ranks`` (``engine info``, reports); ``modules``: the module
    of each wrapper (``allgather``, ``alltoall``)."""
    if merge != "vllm":
        return "reference (--vllm-merge reference)"
    return (
        f"vllm {modules['allgather']}.{ALLGATHER} (allgather) and {modules['alltoall']}.{ALLTOALL} (alltoall) with "
        f"is_lse_base_on_e={backend.lse_base_on_e} ({backend.name}), over the rank's group, on at most "
        f"{programs} token x head programs of each merge (evenly spaced rows; the rest: reference)"
    )


def merge_with_vllm(combine, merged, out, lse, group, variant):
    """The reference's ``merged`` (output, LSE, the slice handed out) with vLLM's wrapper of
    ``variant`` run on a sample of the rows (``sample_rows``), whose results replace the
    reference's rows; a ``MergedBy`` appended says how many."""
    ref_out, ref_lse, c = merged
    q, heads, _ = out.shape
    rows = torch.from_numpy(sample_rows(q, heads, combine.programs))
    try:
        got, got_lse = combine.merge(variant, out[rows], lse[rows], group)
    except Exception as exc:  # reported with the wrapper's name (the rank fails, naming it)
        raise VllmCallError(f"vLLM {combine.wrapper(variant)} raised {type(exc).__name__}: {exc}") from exc
    if c != group.rank:  # the reference hands out slice c (to judge the final gather): rank c's vLLM rows
        got = group.all_gather_tensor(got.contiguous())[c]
        got_lse = group.all_gather_tensor(got_lse.contiguous())[c]
    ref_out, ref_lse = ref_out.clone(), ref_lse.clone()
    ref_out[rows], ref_lse[rows] = got.to(ref_out.dtype), got_lse.to(ref_lse.dtype)
    return ref_out, ref_lse, c, MergedBy(combine.wrapper(variant), len(rows), q)
