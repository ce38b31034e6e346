"""``PDReport``: what a P/D run found, each instance's report and the transfer between them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dcpsim.report_file import SCHEMA_VERSION
from dcpsim.verify.report import RunReport


@dataclass
class PDReport:
    scenario: str
    kv_connector: str
    prefill: RunReport
    decode: RunReport
    entries_sent: int = 0
    entries_written: int = 0
    inject: str | None = None
    wall_time_s: float = 0.0
    layouts: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.prefill.passed and self.decode.passed

    @property
    def failure(self):
        return self.prefill.failure or self.decode.failure

    def to_dict(self) -> dict:
        return dict(
            schema_version=SCHEMA_VERSION,
            scenario=self.scenario,
            passed=self.passed,
            kv_connector=self.kv_connector,
            inject=self.inject,
            layouts=self.layouts,
            entries_sent=self.entries_sent,
            entries_written=self.entries_written,
            wall_time_s=round(self.wall_time_s, 3),
            prefill=json.loads(self.prefill.to_json()),
            decode=json.loads(self.decode.to_json()),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def text(self) -> str:
        lay = " -> ".join(
            f"{role} W={v['decode_context_parallel_size']} I={v['cp_kv_cache_interleave_size']} "
            f"B={v['block_size']} PCP={v['prefill_context_parallel_size']} TP={v['tensor_parallel_size']}"
            for role, v in self.layouts.items()
        )
        lines = [
            f"P/D {self.scenario} via {self.kv_connector}: {lay}",
            f"prefill instance: {self.prefill.text()}",
            f"kv transfer: {self.entries_sent} entries sent, {self.entries_written} written on the decode ranks",
            f"decode instance: {self.decode.text()}",
            "P/D PASSED" if self.passed else "P/D FAILED",
        ]
        return "\n".join(lines)
