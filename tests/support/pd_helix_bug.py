"""A planted bug for the P/D relayout to Helix decode ranks (tests/dist/test_pd_helix_run.py):
a re-sharding connector that routes every prompt position to its owner under vLLM's layout of
the decode instance (its config's interleave) instead of Helix's (prompt blocks round-robin).
A module of its own, not the test's: a P/D world's ranks are forked by a forkserver and unpickle
the job by its class, which they import from here (``pythonpath = ["tests"]``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dcpsim.engine.connector import ReshardingConnector
from dcpsim.harness.pd_job import PDJob
from dcpsim.model.connector import token_routes


class VllmOwnerResharding(ReshardingConnector):
    """Routes by vLLM's owner of the decode instance: ``I`` = the decode config's interleave."""

    def __init__(self, interleave: int):
        self.interleave = interleave

    def routes(self, num_tokens, src, dst):
        believed = dataclasses.replace(dst, kv_cache_layout="vllm", cp_kv_cache_interleave_size=self.interleave)
        return token_routes(num_tokens, src, dst, dst_as=believed)


@dataclass(frozen=True)
class VllmOwnerJob(PDJob):
    """A P/D job whose connector is ``VllmOwnerResharding``."""

    def connector(self):
        return VllmOwnerResharding(self.instance("decode").config.cp_kv_cache_interleave_size)
