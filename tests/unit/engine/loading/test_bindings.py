"""Binding an engine's decisions to the code shapes a source tree holds (``bindings.bind``),
on small trees written here: the first known shape wins, a release that lacks a decision
leaves it to the reference, and anything else is one error listing every mismatch (or, with
``partial``, exactly those decisions handed to the reference)."""

from __future__ import annotations

import pytest

from dcpsim.engine.loading.bindings import BindingError, Decision, Shape, bind, parameters
from dcpsim.errors import ConfigError

NEW = Shape("new", "pkg.mod", "kernel", ("a", "b", "flag"), ("2.0",))
OLD = Shape("old", "pkg.mod", "kernel", ("a", "b"), ("1.0", "1.1"), exact=True)
MOVED = Shape("moved", "pkg.other", "Owner.method", ("self", "x"), ("1.0",))
TABLE = (
    Decision("write", (NEW, OLD)),
    Decision("method", (MOVED,)),
    Decision(
        "extra", (Shape("extra", "pkg.extra", "helper", ("y",), ("2.0",)),), absent=("1.0", "1.1"), absent_reason="has no helper; reference"
    ),
)


def tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path


OLD_TREE = {
    "pkg/mod.py": "def kernel(a, b):\n    pass\n",
    "pkg/other.py": "class Owner:\n    def method(self, x, y=1):\n        pass\n",
}
NEW_TREE = {
    "pkg/mod.py": "import x\nif x:\n    def kernel(a, b, flag, *, extra=1):\n        pass\n",
    "pkg/other.py": "class Owner:\n    def method(self, x):\n        pass\n",
    "pkg/extra.py": "def helper(y):\n    pass\n",
}


def test_each_decision_binds_to_the_shape_its_tree_holds(tmp_path):
    old = bind(tree(tmp_path / "old", OLD_TREE), TABLE, release="1.1", label="Eng", flag="--eng-source")
    assert {d: old.shape(d) for d in old.bound} == {"write": "old", "method": "moved", "extra": None}
    assert old.why("extra") == "Eng 1.1 has no helper; reference" and old.partial == ()
    new = bind(tree(tmp_path / "new", NEW_TREE), TABLE, release=None, label="Eng", flag="--eng-source")
    assert {d: new.shape(d) for d in new.bound} == {"write": "new", "method": "moved", "extra": "extra"}
    assert new.modules() == ["pkg.mod", "pkg.other", "pkg.extra"]


def test_an_unknown_tree_lists_every_mismatch_at_once(tmp_path):
    files = {**NEW_TREE, "pkg/mod.py": "def kernel(a, c):\n    pass\n", "pkg/other.py": "class Owner:\n    pass\n"}
    root = tree(tmp_path, files)
    with pytest.raises(BindingError) as caught:
        bind(root, TABLE, release=None, label="Eng", flag="--eng-source")
    message = str(caught.value)
    assert "2 decision(s) in no known shape" in message and "--engine-partial" in message
    assert (
        "write: found pkg/mod.py::kernel is (a, c); known: pkg/mod.py::kernel(a, b, flag, ...) in 2.0; pkg/mod.py::kernel(a, b) in 1.0..1.1"
        in message
    )
    assert "method: found pkg/other.py has no Owner.method" in message
    assert [m.decision.name for m in caught.value.mismatches] == ["write", "method"]
    partial = bind(root, TABLE, release=None, label="Eng", flag="--eng-source", partial=True)
    assert partial.partial == ("write", "method") and partial.shape("extra") == "extra"
    assert partial.why("write").startswith("--engine-partial: Eng tree holds it in no known shape")


def test_a_release_that_lacks_a_decision_is_absent_only_when_it_names_itself(tmp_path):
    root = tree(tmp_path, OLD_TREE)
    assert bind(root, TABLE, release="1.0", label="Eng", flag="--eng-source").shape("extra") is None
    with pytest.raises(BindingError, match="extra: found pkg/extra.py is missing"):
        bind(root, TABLE, release=None, label="Eng", flag="--eng-source")  # a checkout: no version to trust


def test_exact_shapes_and_parameters(tmp_path):
    root = tree(tmp_path, {**OLD_TREE, "pkg/mod.py": "def kernel(a, b, more):\n    pass\n"})
    with pytest.raises(BindingError, match=r"write: found pkg/mod.py::kernel is \(a, b, more\)"):
        bind(root, TABLE[:1], release=None, label="Eng", flag="--eng-source")
    spec = tree(tmp_path / "dc", {"m.py": "class Spec:\n    block_size: int\n    dcp_sharded: bool = True\n"})
    path = spec / "m.py"
    assert parameters(str(path), path.stat().st_mtime_ns, "Spec") == ("block_size", "dcp_sharded")
    assert parameters(str(path), path.stat().st_mtime_ns, "Spec.nothing") is None


def test_a_tree_that_does_not_parse_is_exit_2_naming_file_and_line(tmp_path):
    root = tree(tmp_path, {**OLD_TREE, "pkg/mod.py": "def kernel(a, b:\n"})
    with pytest.raises(ConfigError, match=r"Eng source .*: pkg/mod.py:1: SyntaxError"):
        bind(root, TABLE, release=None, label="Eng", flag="--eng-source")


def test_answers_are_kept_between_processes_by_the_file_content(tmp_path, monkeypatch):
    """A process that binds a tree another bound (a rank after its parent) reads the parameters
    found before ($DCPSIM_CACHE/signatures, by the file's SHA-256) instead of parsing; a file
    whose content changed is parsed again, and a missing definition is kept as missing."""
    from dcpsim.engine.loading import bindings

    monkeypatch.setenv("DCPSIM_CACHE", str(tmp_path / "cache"))
    path = tree(tmp_path, {"m.py": "def kernel(a, b):\n    pass\n"}) / "m.py"
    assert parameters(str(path), path.stat().st_mtime_ns, "kernel") == ("a", "b")
    assert parameters(str(path), path.stat().st_mtime_ns, "gone") is None
    assert len(list((tmp_path / "cache" / "signatures").rglob("*.json"))) == 1

    def no_parse(*args):
        raise AssertionError("parsed again")

    for fn in (bindings.parameters, bindings._kept, bindings._module):  # as a new process
        fn.cache_clear()
    monkeypatch.setattr(bindings, "_module", no_parse)
    assert parameters(str(path), path.stat().st_mtime_ns, "kernel") == ("a", "b")
    assert parameters(str(path), path.stat().st_mtime_ns, "gone") is None
    path.write_text("def kernel(a, b, c):\n    pass\n")  # another content: never the kept answer
    with pytest.raises(AssertionError, match="parsed again"):
        parameters(str(path), path.stat().st_mtime_ns + 1, "kernel")
    monkeypatch.undo()
    for fn in (bindings.parameters, bindings._kept, bindings._module):
        fn.cache_clear()
    assert parameters(str(path), path.stat().st_mtime_ns, "kernel") == ("a", "b", "c")
