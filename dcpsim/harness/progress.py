"""``Progress``: where a rank is (step and phase), told to whoever supervises it.

The default tells nobody (thread ranks, torchrun workers); a rank of a gloo world started
here tells its parent over its pipe (``rank_process.PIPE_PROGRESS``), which names the step and
phase in a crash, hang or waiting report.
"""

from __future__ import annotations


class Progress:
    def set(self, step: int | None, phase: str = "") -> None:
        """This rank is now at ``step`` (None: outside the steps), in ``phase``."""

    def flush(self) -> None:
        """Make sure the supervisor has the latest ``set`` now (before a rank ends without a report)."""


NO_PROGRESS = Progress()
