"""What the session's ``-m`` expression selects, asked before the items exist: a test module
whose parametrization is costly to build (the full matrix's grid) skips building it when every
item it would make is deselected anyway."""

from __future__ import annotations


def deselected_by_marks(config, marks: set[str]) -> bool:
    """Whether ``-m`` deselects every item that carries exactly ``marks`` (by pytest's own
    expression, as its deselection evaluates it); on any doubt, False."""
    expr = config.getoption("markexpr")
    if not expr:
        return False
    try:
        from _pytest.mark.expression import Expression  # no public API evaluates -m

        return not Expression.compile(expr).evaluate(lambda mark, /, **kwargs: not kwargs and mark in marks)
    except Exception:  # another pytest's internals: build everything, as without -m
        return False
