"""The ranks' preparation data leaves the caller's ``__main__`` out only where dcpsim starts
them (``starting_ranks``), and what ranks cannot have from ``__main__`` is named."""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass
from multiprocessing import spawn

import pytest

from dcpsim.errors import ConfigError
from dcpsim.harness.caller_main import MAIN_KEYS, check_payload, check_plugins, main_object, starting_ranks


@dataclass
class Holder:
    value: object


class FromMain:
    pass


FromMain.__module__ = "__main__"
FromMain.__qualname__ = "FromMain"


def _main_keys() -> set:
    return set(spawn.get_preparation_data("x")) & set(MAIN_KEYS)


def test_main_left_out_only_while_starting_ranks(monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["__main__"], "__file__", "/somewhere/check.py", raising=False)
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    assert _main_keys() == {"init_main_from_path"}  # multiprocessing would run the script again
    with starting_ranks():
        assert _main_keys() == set()
        seen = []
        other = threading.Thread(target=lambda: seen.append(_main_keys()))
        other.start()
        other.join()
        assert seen == [{"init_main_from_path"}]  # another thread keeps multiprocessing's way
        with starting_ranks():
            pass
        assert _main_keys() == set()  # nested blocks restore what they found
    assert _main_keys() == {"init_main_from_path"}


def test_a_payload_object_from_main_is_named(monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["__main__"], "FromMain", FromMain, raising=False)  # as a script defines it
    payload = ("jobs", [Holder(FromMain())])
    assert main_object(payload, pickle.dumps(payload)) == "__main__.FromMain"
    assert main_object(("jobs", [Holder(FromMain)]), b"...__main__...") == "__main__.FromMain"
    clean = ("jobs", [Holder(3), "__main__"])  # the word alone is no object of __main__
    assert main_object(clean, pickle.dumps(clean)) is None
    with pytest.raises(ConfigError, match=r"cannot have __main__.FromMain: the ranks are fresh processes"):
        check_payload(payload, pickle.dumps(payload))


def test_a_plugin_from_main_is_refused():
    check_plugins(["reference", "pkg.mod:Engine"])
    with pytest.raises(ConfigError, match=r"--engine __main__:Mine: .*in_process=True"):
        check_plugins(["reference", "__main__:Mine"])
