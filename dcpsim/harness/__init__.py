"""The harness: jobs, a rank's main loop, worlds of gloo ranks (or threads), replay.

It drives the engine under test and the checker side by side on every rank, and is the
only place that touches the process group.
"""
