"""What a waiting world says: which ranks it still waits for, grouped by where they are."""

from __future__ import annotations

from dcpsim.harness.world_failure import waiting_message


def test_ranks_at_the_same_place_are_named_together():
    progress = [(3, "verify"), (3, "verify"), (3, "write"), (None, "rendezvous")]
    assert waiting_message(5.04, [0, 1, 2], progress, 4) == (
        "waiting 5.0 s for 3 of 4 ranks: ranks 0, 1 at step 3 (verify); rank 2 at step 3 (write)"
    )
    assert waiting_message(12.6, [3], progress, 4) == "waiting 13 s for 1 of 4 ranks: rank 3 at 'rendezvous' (no step)"
    assert waiting_message(5.0, [0], [(None, "")], 1) == "waiting 5.0 s for 1 of 1 rank: rank 0 at start (no progress yet)"
