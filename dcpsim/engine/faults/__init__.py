"""Known DCP bugs, each a small variant of the reference engine that changes one decision.

A fault subclasses ``Fault`` (the reference engine plus catalogue metadata) and overrides
one ``Engine`` method: grouping (``kv_cache_groups``), geometry (``group_geometry``), a
prefix key, a release, the slots of a write, a query bound, a shard's LSE or a top-k. It never
touches the checker, which derives its expectation from the scenario alone. One module per
family (``layout``, ``prefix``, ``metadata``, ``attention``, ``mamba``, ``draft``, ``pcp``,
``pd``, ``sparse``, ``admission``); ``registry`` maps names to faults, so a new bug class is one new entry, and
``python -m dcpsim selftest`` runs every registered fault where it applies (see
``Fault.needs``, ``Fault.configs`` and ``Fault.scenarios``).
"""

from dcpsim.engine.faults.base import Fault
from dcpsim.engine.faults.pd import PDFault
from dcpsim.engine.faults.registry import FAULTS, PD_FAULTS, get_fault, get_pd_fault

__all__ = ["FAULTS", "PD_FAULTS", "Fault", "PDFault", "get_fault", "get_pd_fault"]
