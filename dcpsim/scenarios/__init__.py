"""Scenarios: reading and writing the scenario files, and the built-ins.

``load`` (TOML files, every problem at once), ``dump`` (back to a dict or TOML),
``registry`` (spec kinds by scenario name, built-ins), ``disagg`` (the ``[disaggregated]``
table). The frozen data itself (``Scenario``, ``RequestSpec``) is ``dcpsim.model.scenario``,
which the engine's scheduler and the checker read too. The built-in scenario files live in
``builtin/``.
"""
