"""The engine's worker on one rank: block tables, KV stores, the write path, and the
read-only view of them that the checker gets."""
