"""Support modules of the tests, imported as ``support.NAME`` (``tests`` is on pytest's path):
``helpers`` (builders and runners the test packages share), ``schedule_auditor`` (an independent
invariant auditor of the scheduler's plans), ``scheduler_mutations`` (planted prefix-cache
mistakes), ``attention_problems`` (random attention problems with a brute-force answer)."""
