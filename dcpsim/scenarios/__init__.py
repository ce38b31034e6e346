"""Scenarios: the model's layer specs, the engine config and the workload.

``scenario`` (the frozen data), ``load`` (TOML files, every problem at once),
``dump`` (back to a dict or TOML), ``registry`` (spec kinds by scenario name, built-ins).
The built-in scenario files live in ``builtin/``.
"""
