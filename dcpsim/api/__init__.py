"""dcpsim's Python API, re-exported as ``dcpsim.run``, ``dcpsim.Report``, ... (docs/api.md).

``run`` (one world, as ``dcpsim run``), ``matrix``, ``selftest`` and ``layout``; the typed
reports; the errors the command line maps to its exit codes (``ConfigError`` 2,
``HarnessError`` 3, ``CheckFailed`` 1); ``Engine`` and ``ReferenceEngine`` for plugin authors.
"""

from dcpsim.api.layout import Layout, layout
from dcpsim.api.matrix import MatrixCell, MatrixReport, matrix
from dcpsim.api.report import Failure, Holding, RankFigures, Report
from dcpsim.api.run import run
from dcpsim.api.selftest import SelftestReport, selftest
from dcpsim.engine.interface import Engine
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.errors import CheckFailed, ConfigError, DcpsimError, HarnessError
from dcpsim.model.scenario import Scenario

__all__ = [
    "CheckFailed",
    "ConfigError",
    "DcpsimError",
    "Engine",
    "Failure",
    "HarnessError",
    "Holding",
    "Layout",
    "MatrixCell",
    "MatrixReport",
    "RankFigures",
    "ReferenceEngine",
    "Report",
    "Scenario",
    "SelftestReport",
    "layout",
    "matrix",
    "run",
    "selftest",
]
