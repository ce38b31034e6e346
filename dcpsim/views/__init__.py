"""Read-only analyses of a scenario: pure arithmetic and statistics over the spec model and
over what a run's schedule wrote, for the ``capacity`` and ``interleave`` commands.

Imports only the pure model (and the scenario data); the commands in ``dcpsim.cli`` feed
it and print its results.
"""
