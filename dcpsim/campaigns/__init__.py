"""Campaigns over many runs: the fault catalogue, selftest, the correctness matrix, fuzz."""
