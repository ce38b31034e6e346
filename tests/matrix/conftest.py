"""A default-grid cell (``test_matrix.py::test_cell``) that a collected full-matrix chunk
(``test_matrix_full.py::test_full_matrix_chunk``) runs as the same run is deselected: every
valid default cell is one of the full grid's (``test_every_default_cell_runs_in_the_full_matrix``),
so in the default test command each default cell runs once, in the full matrix's worlds.
``pytest tests/matrix/test_matrix.py`` alone, ``--dcpsim-skip-full-matrix`` or
``--dcpsim-shard`` (the full matrix's chunks then hold only some cells) keep what is not run."""

from __future__ import annotations

from support.matrix_cover import covered


def _param(item, name):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(name) if callspec is not None else None


def _is(item, file: str, test: str) -> bool:
    return getattr(item, "originalname", None) == test and item.path.name == file


def pytest_collection_modifyitems(config, items):
    chunks = [_param(item, "chunk") for item in items if _is(item, "test_matrix_full.py", "test_full_matrix_chunk")]
    full = [cell for chunk in chunks if isinstance(chunk, list) for cell in chunk]  # not "off" or "deselected"
    defaults = [item for item in items if _is(item, "test_matrix.py", "test_cell")]
    if not full or not defaults:
        return
    ran = covered([_param(item, "cell") for item in defaults], full)
    deselected = {id(item) for item in defaults if _param(item, "cell").cell.id in ran}
    if deselected:
        config.hook.pytest_deselected(items=[item for item in items if id(item) in deselected])
        items[:] = [item for item in items if id(item) not in deselected]
