"""Registries: the names scenario files use, mapped to spec kinds and built-in files."""

from __future__ import annotations

from pathlib import Path

from dcpsim.model.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    IndexerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseMLAAttentionSpec,
)

SPEC_KINDS = {
    "full_attention": FullAttentionSpec,
    "mla": MLAAttentionSpec,
    "sparse_mla": SparseMLAAttentionSpec,
    "indexer": IndexerSpec,
    "sliding_window": SlidingWindowSpec,
    "sliding_window_mla": SlidingWindowMLASpec,
    "chunked_local": ChunkedLocalAttentionSpec,
    "ring": CircularBufferSpec,
    "mamba": MambaSpec,
}

_BUILTIN_DIR = Path(__file__).parent / "builtin"


def builtin_scenario_names() -> list[str]:
    return sorted(p.stem for p in _BUILTIN_DIR.glob("*.toml"))


def builtin_scenario_path(name: str) -> Path | None:
    """The file of a built-in scenario (``""`` gives a path inside the built-in folder)."""
    if not name:
        return _BUILTIN_DIR / "_"
    path = _BUILTIN_DIR / f"{name}.toml"
    return path if path.is_file() else None
