"""The engine's attention (``--attention``): per-rank attention over the local shard and
the LSE merge across ranks.

* ``compute``: ``attend``, float32 softmax attention over the keys a rank reads.
* ``merge``: the pure LSE merge (``merge_attention_states``, semantics section 6).
* ``shard``: ``ShardAttention``, the per-step driver on a rank: read K/V through the
  engine's attention metadata, attend, merge sharded groups over the process group.

The checker's side (reference and verdict) is ``dcpsim.verify.attention``.
"""
