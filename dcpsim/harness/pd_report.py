"""``PDReport``: what a P/D run found, each instance's report and the transfer between them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dcpsim.report_file import SCHEMA_VERSION
from dcpsim.verify.report import Failure, FailureKind, RunReport


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
    block_release: list[str] = field(default_factory=list)
    """What went wrong with the prefill ranks' release of the prompts' blocks during the transfer
    (``engine.connector.PrefillBlocks``): a block pulled after it was freed, or not freed exactly once."""
    notices: list[str] = field(default_factory=list)
    """What is wrong with the completions the decode ranks were notified of (``harness.pd.judge_notices``):
    a prompt a rank was never notified of, or with the wrong entry counts."""
    page_tails: list[str] = field(default_factory=list)
    """With asynchronous loads: stale slots past a running request's length in its pages on a decode
    rank (``verify.page_tail``), each rank's first failing step."""

    @property
    def passed(self) -> bool:
        return self.prefill.passed and not self.block_release and not self.notices and self.decode.passed and not self.page_tails

    @property
    def transfer_failure(self) -> Failure | None:
        for kind, problems, what in (
            (FailureKind.PD_BLOCK_RELEASE, self.block_release, "prefill block release"),
            (FailureKind.PD_NOTIFICATION, self.notices, "completion notice"),
        ):
            if problems:
                first, *rest = problems
                message = f"{len(problems)} {what} problem(s) in the kv transfer: {first}"
                return Failure(kind=kind, step=self.prefill.steps, message=message, details=rest[:10])
        return None

    @property
    def page_tail_failure(self) -> Failure | None:
        if not self.page_tails:
            return None
        first, *rest = self.page_tails
        step = int(first.split(":", 1)[0].removeprefix("step "))
        message = f"{len(self.page_tails)} page tail(s) not cleared on the decode instance: {first}"
        return Failure(kind=FailureKind.PD_PAGE_TAIL, step=step, message=message, details=rest[:10])

    @property
    def failure(self):
        return self.prefill.failure or self.transfer_failure or self.decode.failure or self.page_tail_failure

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
            block_release=self.block_release,
            notices=self.notices,
            page_tails=self.page_tails,
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
            *(f"kv transfer: {line}" for line in (self.block_release + self.notices)[:10]),
            f"decode instance: {self.decode.text()}",
            *(f"decode instance: {line}" for line in self.page_tails[:10]),
            "P/D PASSED" if self.passed else "P/D FAILED",
        ]
        return "\n".join(lines)
