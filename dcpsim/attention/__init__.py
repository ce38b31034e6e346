"""The attention-level check (``--attention``): real K/V vectors in the KV stores, per-rank
attention over the local shard, the LSE merge across ranks, and a full-context reference.

* ``config``: ``AttentionConfig`` (head counts and dims, LSE base, merge variant, tolerance).
* ``vectors``: deterministic K/V and query vectors derived from content fingerprints.
* ``merge``: the pure LSE merge (``merge_attention_states``).
* ``compute``: the attention math (engine float32, reference float64) and which keys a
  query token sees, on one rank (engine) and over the full context (reference).
* ``check``: ``AttentionChecker``, the per-step driver: local attention during the step,
  the merge over the ``Collectives``, comparison with the reference, a consensus verdict.
"""
