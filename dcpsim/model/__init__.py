"""The pure model both sides share: config, KV-cache specs, grouping, layout math,
content fingerprints and vectors, the scenario (``scenario``: layer specs, config and
workload), and the plan records the scheduler hands the ranks.

No torch.distributed and no I/O here. The engine uses the fast layout math
(``layout``); the checker may use the specs, the grouping and the plan records,
never ``layout``.
"""
