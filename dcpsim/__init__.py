"""dcpsim: a distributed simulation harness for Decode Context Parallel KV-cache layouts.

The Python API (docs/api.md) is here: ``dcpsim.run``, ``dcpsim.matrix``, ``dcpsim.selftest``,
``dcpsim.layout``, ``dcpsim.Report``, ``dcpsim.ConfigError``, ... Each name is imported from
``dcpsim.api`` on first use, so ``import dcpsim`` (and ``python -m dcpsim``) stays cheap.
"""

__version__ = "0.1.0"

_API = (
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
)


def __getattr__(name: str):
    if name in _API:
        import dcpsim.api

        return getattr(dcpsim.api, name)
    raise AttributeError(f"module 'dcpsim' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
