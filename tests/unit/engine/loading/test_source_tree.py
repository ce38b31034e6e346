"""The engine-neutral source loader (``dcpsim.engine.loading``): single modules of a package run
under their real names, the rest are stubs; code that imports when called runs inside
``importable()``; fetch names what it takes."""

from __future__ import annotations

import sys

import pytest

from dcpsim.engine.loading.fetch import default_dest, package_of
from dcpsim.engine.loading.placeholders import is_placeholder
from dcpsim.engine.loading.tree import SourceTree
from dcpsim.errors import ConfigError


def fake_tree(tmp_path, body: str) -> SourceTree:
    pkg = tmp_path / "fakepkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('a package __init__ is not run')\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text(body)
    return SourceTree(tmp_path, package="fakepkg", label="Fake", flag="--fake-source")


def test_a_module_runs_under_its_real_name_beside_stubs(tmp_path):
    tree = fake_tree(tmp_path, "from fakepkg.elsewhere import helper\nNAME = __name__\nUSES = helper\n")
    mod = tree.load(["fakepkg.sub.mod"])["fakepkg.sub.mod"]
    assert mod.NAME == "fakepkg.sub.mod" and is_placeholder(mod.USES)
    assert "fakepkg.elsewhere" in tree.stubbed
    assert not any(k == "fakepkg" or k.startswith("fakepkg.") for k in sys.modules)  # taken out again


def test_a_lazy_import_needs_the_tree_importable(tmp_path):
    tree = fake_tree(tmp_path, "def call():\n    from fakepkg.late import value\n    return value\n")
    mod = tree.load(["fakepkg.sub.mod"])["fakepkg.sub.mod"]
    with pytest.raises(ModuleNotFoundError):
        mod.call()
    with tree.importable():
        assert is_placeholder(mod.call())
    assert "fakepkg.late" not in sys.modules


def test_a_tree_that_does_not_import_names_file_and_line(tmp_path):
    tree = fake_tree(tmp_path, "x = 1\ndef broken(:\n")
    with pytest.raises(ConfigError, match=r"Fake source .*fakepkg/sub/mod.py:2: SyntaxError"):
        tree.load(["fakepkg.sub.mod"])
    with pytest.raises(ConfigError, match="--fake-source .*no fakepkg/ package"):
        SourceTree(tmp_path / "fakepkg" / "sub", package="fakepkg", label="Fake", flag="--fake-source")


def test_fetch_takes_vllm_and_sglang_only(monkeypatch, tmp_path):
    monkeypatch.setenv("DCPSIM_CACHE", str(tmp_path))
    assert package_of("sglang==0.5.23") == "sglang" and package_of("vllm") == "vllm"
    assert default_dest("sglang==0.5.23").name == "sglang-0.5.23"
    with pytest.raises(ConfigError, match="expected vllm==VERSION or sglang==VERSION"):
        package_of("torch==2.13.0")


def test_compiled_code_is_kept_by_source_and_names_the_file_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("DCPSIM_CACHE", str(tmp_path / "cache"))
    body = "def f():\n    return 1\nclass C:\n    def g(self):\n        return f.__code__.co_filename\n"
    first = fake_tree(tmp_path / "a", body).load(["fakepkg.sub.mod"])["fakepkg.sub.mod"]
    kept = list((tmp_path / "cache" / "code").rglob("*.code"))
    assert len(kept) == 1  # the package __init__ files are not run, so not compiled
    copy = fake_tree(tmp_path / "b", body).load(["fakepkg.sub.mod"])["fakepkg.sub.mod"]  # same source: the kept code
    assert list((tmp_path / "cache" / "code").rglob("*.code")) == kept
    assert first.C().g() == str(tmp_path / "a" / "fakepkg" / "sub" / "mod.py")
    assert copy.C().g() == str(tmp_path / "b" / "fakepkg" / "sub" / "mod.py")  # nested code names the copy
    changed = fake_tree(tmp_path / "c", body.replace("return 1", "return 2")).load(["fakepkg.sub.mod"])["fakepkg.sub.mod"]
    assert changed.f() == 2 and len(list((tmp_path / "cache" / "code").rglob("*.code"))) == 2


def test_importable_finds_the_package_names_put_in_sys_modules_between_and_inside_its_contexts(tmp_path):
    """``_installed`` reads only what ``sys.modules`` gained since its last context (``tree._Mark``):
    a module of the package that someone else put there between two contexts (a real ``fakepkg``
    installed beside the tree) is hidden inside the next context and comes back after it; one put
    inside a context is taken out with the tree's own; one removed between contexts stays removed."""
    import types

    tree = fake_tree(tmp_path, "def call():\n    import sys\n    return sys.modules.get('fakepkg.other')\n")
    mod = tree.load(["fakepkg.sub.mod"])["fakepkg.sub.mod"]
    with tree.importable():
        pass
    theirs = {n: types.ModuleType(n) for n in ("fakepkg", "fakepkg.other")}
    try:
        sys.modules.update(theirs)  # put after the tree's last context ended
        with tree.importable():
            assert sys.modules["fakepkg.sub.mod"] is mod
            assert mod.call() is None  # the other fakepkg's module is hidden meanwhile
            assert sys.modules.get("fakepkg") is not theirs["fakepkg"]
            sys.modules["fakepkg.inside"] = types.ModuleType("fakepkg.inside")
        assert all(sys.modules.get(n) is m for n, m in theirs.items())  # back afterwards
        assert "fakepkg.inside" not in sys.modules and "fakepkg.sub.mod" not in sys.modules
        del sys.modules["fakepkg.other"]  # removed between contexts: not put back
        with tree.importable():
            assert mod.call() is None and sys.modules.get("fakepkg") is not theirs["fakepkg"]
        assert sys.modules.get("fakepkg") is theirs["fakepkg"] and "fakepkg.other" not in sys.modules
        with tree.importable():
            assert "fakepkg.inside" in sys.modules  # what the tree imported before comes back inside
    finally:
        for n in (*theirs, "fakepkg.inside"):
            sys.modules.pop(n, None)
