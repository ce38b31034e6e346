"""vLLM's DCP combine wrappers, run over a rank's dcpsim collectives.

``cp_lse_ag_out_rs`` (all-gather the LSEs, correct this rank's output with vLLM's
``CorrectAttnCPOutKernel`` through its own JIT launcher, reduce-scatter over heads) and
``dcp_a2a_lse_reduce`` (pack output and LSE, one all-to-all, unpack and combine), from
``vllm/v1/attention/ops/dcp.py``, are called as vLLM's ``MLADCPManager`` calls them, with
the LSE base of the run's attention backend (``dcpsim.engine.vllm.backends``). What they
take from around them:

* ``cp_group``: ``CpGroup``, a stand-in for vLLM's ``GroupCoordinator`` holding what the
  wrappers use (``world_size``, ``rank_in_group``, ``all_gather``, ``reduce_scatter``,
  ``all_reduce``, ``device_group``) over the rank's ``Collectives`` (gloo, or threads);
* ``torch.distributed`` as the module's global ``dist``: ``_Dist``, whose
  ``all_to_all_single`` (the one call ``dcp_a2a_lse_reduce`` makes) runs over the group's
  collectives;
* the interpreter lock (ranks that are threads launch one kernel at a time, see
  ``dcpsim.engine.vllm.loader``): held around each kernel launch only, never across a
  collective, so the ranks' wrappers meet in their collectives.

Triton's interpreter runs one Python call per (token, head) program, so a merge runs vLLM's
code on at most ``programs`` of them: all its rows when ``rows * heads <= programs``, else
an evenly spaced sample of ``programs // heads`` rows (its first and last among them), the
same rows on every rank; the reference merges the whole batch and vLLM's rows replace its
rows (``dcpsim.engine.interface.MergedBy`` says so in the result).
"""

from __future__ import annotations

import torch

from dcpsim.collectives import Collectives
from dcpsim.engine.vllm.loader import INTERPRETER_LOCK

MODULE = "vllm.v1.attention.ops.dcp"
ALLGATHER, ALLTOALL = "cp_lse_ag_out_rs", "dcp_a2a_lse_reduce"
WRAPPERS = {"allgather": ALLGATHER, "alltoall": ALLTOALL}
KERNELS = ("_dcp_a2a_pack_send_kernel", "_dcp_a2a_unpack_combine_kernel")
"""The module's Triton kernels launched as ``kernel[grid](...)`` (wrapped with the lock);
the correction kernel launches through ``CPTritonContext.call_kernel``."""
DEFAULT_PROGRAMS = 64


class CpGroup:
    """vLLM's ``GroupCoordinator`` as the combine wrappers use it, over ``Collectives``."""

    def __init__(self, collectives: Collectives):
        self.collectives = collectives
        self.world_size = collectives.world_size
        self.rank_in_group = collectives.rank
        self.device_group = self
        """What the wrappers hand ``torch.distributed`` as ``group=``: this stand-in."""

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.collectives.all_gather_tensor(tensor.contiguous()), dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        chunks = torch.stack(tensor.chunk(self.world_size, dim=dim))  # [W, ...]: chunk i goes to rank i
        return self.collectives.reduce_scatter_tensor(chunks.contiguous())

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.collectives.all_gather_tensor(tensor.contiguous())).sum(dim=0)


class _Done:
    def wait(self) -> None:
        pass


class _Dist:
    """The ``torch.distributed`` the wrappers see: its all-to-all over a ``CpGroup``."""

    @staticmethod
    def all_to_all_single(output, input, group=None, async_op=False):  # torch.distributed's parameter names
        world = group.world_size
        output.view(world, -1).copy_(group.collectives.all_to_all_tensor(input.reshape(world, -1).contiguous()))
        return _Done() if async_op else None


class _LockedKernel:
    """A Triton kernel whose launches (``kernel[grid](...)``) hold the interpreter lock."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def locked(*args, **kwargs):
            with INTERPRETER_LOCK:
                return launch(*args, **kwargs)

        return locked

    def __getattr__(self, name):
        return getattr(self.kernel, name)


class VllmCombine:
    """The loaded ``vllm.v1.attention.ops.dcp``, set up to run its wrappers in ranks."""

    def __init__(self, allgather, alltoall, lse_base_on_e: bool, programs: int = DEFAULT_PROGRAMS):
        """``allgather``, ``alltoall``: the loaded modules that hold each wrapper (one module,
        ``vllm/v1/attention/ops/dcp.py``, from 0.29.0 on; ``ops/common.py`` and
        ``ops/dcp_alltoall.py`` before)."""
        self.modules = {"allgather": allgather, "alltoall": alltoall}
        self.lse_base_on_e = lse_base_on_e
        self.programs = programs
        alltoall.dist = _Dist()
        for name in KERNELS:
            kernel = getattr(alltoall, name)
            if not isinstance(kernel, _LockedKernel):
                setattr(alltoall, name, _LockedKernel(kernel))

        class LockedContext(allgather.CPTritonContext):  # vLLM's context; each launch under the lock
            def call_kernel(self, *args, **kwargs):
                with INTERPRETER_LOCK:
                    return super().call_kernel(*args, **kwargs)

        self._context = LockedContext

    def wrapper(self, variant: str) -> str:
        """``module.function`` of the wrapper of ``variant``."""
        return f"{self.modules[variant].__name__}.{WRAPPERS[variant]}"

    def merge(self, variant: str, out: torch.Tensor, lse: torch.Tensor, collectives: Collectives):
        """vLLM's wrapper for ``variant`` on ``out [q, H, D]``, ``lse [q, H]``: this rank's
        ``H / W`` heads ``(out, lse)``, merged."""
        group = CpGroup(collectives)
        d = out.shape[-1]
        dp = 1 << max(0, (d - 1).bit_length())  # HEAD_DIM is a tl.arange bound: a power of two
        if dp != d:
            out = torch.cat([out, out.new_zeros((*out.shape[:-1], dp - d))], dim=-1)
        out, lse = out.contiguous(), lse.contiguous()
        if variant == "alltoall":
            got, merged = self.modules[variant].dcp_a2a_lse_reduce(out, lse, group, return_lse=True, is_lse_base_on_e=self.lse_base_on_e)
        else:
            got, merged = self.modules[variant].cp_lse_ag_out_rs(
                out, lse, group, ctx=self._context(), return_lse=True, is_lse_base_on_e=self.lse_base_on_e
            )
        return got[..., :d], merged
