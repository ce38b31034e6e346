"""``loading.launch_cache``: an interpreted launch is replayed only when its kernel's code and its
inputs repeat, and a replay leaves the caller's tensors byte for byte as the kernel would.

The launches run in child processes (Triton's interpreter and its patches are process-wide), each
over its own ``$DCPSIM_CACHE``: the first records, a second process replays from the files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

KERNEL = """
import triton
import triton.language as tl

SHIFT = 5


@triton.jit
def _load_ptr(ptr_to_ptr, elem_dtype):  # as vLLM's buffer_utils._load_ptr
    ptr = tl.load(ptr_to_ptr)
    ptr = tl.cast(ptr, tl.pointer_type(elem_dtype))
    return tl.multiple_of(ptr, 16)


@triton.jit
def scale(x_ptr, n, out_ptr, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, x * FACTOR + SHIFT, mask=offs < n)


@triton.jit
def accumulate(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(out_ptr + offs, mask=offs < n) + tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def maybe_accumulate(x_ptr, flag_ptr, n, out_ptr, BLOCK: tl.constexpr):  # loads out only when the flag is set
    offs = tl.arange(0, BLOCK)
    flag = tl.load(flag_ptr)
    old = tl.load(out_ptr + offs, mask=(offs < n) & (flag != 0), other=0)
    tl.store(out_ptr + offs, old + tl.load(x_ptr + offs, mask=offs < n, other=0), mask=offs < n)


@triton.jit
def store_then_maybe_load(x_ptr, flag_ptr, n, out_ptr, BLOCK: tl.constexpr):  # loads out after storing to it
    offs = tl.arange(0, BLOCK)
    flag = tl.load(flag_ptr)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0), mask=offs < n)
    again = tl.load(out_ptr + offs, mask=(offs < n) & (flag != 0), other=0)
    tl.store(out_ptr + offs, again * 2, mask=(offs < n) & (flag != 0))


@triton.jit
def through_table(table_ptrs, n, out_ptr, BLOCK: tl.constexpr):
    src = _load_ptr(table_ptrs, tl.int32)
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(src + offs, mask=offs < n, other=0) + 1, mask=offs < n)
"""

RUN = """
import importlib.util, json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from dcpsim.engine.loading import launch_cache
from dcpsim.engine.loading.interpreter import mend_interpreter_bools, quicken_interpreter
from dcpsim.engine.loading.launch_key import Arguments, kernel_identity, pointers_to

mend_interpreter_bools()
quicken_interpreter()
launch_cache.install()


def load(path):
    spec = importlib.util.spec_from_file_location("kern", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kern, edited = load(sys.argv[1]), load(sys.argv[2])
facts = {}


def launch(name, kernel, *args, fill=-7, **kwargs):
    before = dict(launch_cache.COUNTS)
    out = torch.full((8,), fill, dtype=torch.int32)
    kernel[(1,)](*args, out, **kwargs)
    changed = [k for k, v in launch_cache.COUNTS.items() if v != before[k]]
    facts[name] = {"out": out.tolist(), "bytes": out.numpy().tobytes().hex(), "counted": changed}


x = torch.arange(6, dtype=torch.int32)
launch("first", kern.scale, x, 6, FACTOR=3, BLOCK=8)
launch("again", kern.scale, x.clone(), 6, FACTOR=3, BLOCK=8)
launch("other_output_bytes", kern.scale, x, 6, FACTOR=3, BLOCK=8, fill=99)  # out is only stored to
launch("accumulate", kern.accumulate, x, 6, BLOCK=8)
launch("accumulate_other_output_bytes", kern.accumulate, x, 6, BLOCK=8, fill=99)  # out is loaded from
launch("accumulate_again", kern.accumulate, x, 6, BLOCK=8)
y = x.clone()
y[5] = 100
launch("tensor_byte", kern.scale, y, 6, FACTOR=3, BLOCK=8)
launch("constexpr", kern.scale, x, 6, FACTOR=4, BLOCK=8)
launch("scalar", kern.scale, x, 5, FACTOR=3, BLOCK=8)
launch("source_byte", edited.scale, x, 6, FACTOR=3, BLOCK=8)
kern.SHIFT = 6
launch("global_value", kern.scale, x, 6, FACTOR=3, BLOCK=8)
kern.SHIFT = 5

# out only stored to by the first launch of a structure: a later one digests it at its first load only
off_flag, on_flag = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
launch("flag_off", kern.maybe_accumulate, x, off_flag, 6, BLOCK=8)
launch("flag_on", kern.maybe_accumulate, x, on_flag, 6, BLOCK=8)
launch("flag_on_other_output_bytes", kern.maybe_accumulate, x, on_flag, 6, BLOCK=8, fill=99)
launch("flag_on_again", kern.maybe_accumulate, x, on_flag, 6, BLOCK=8)
launch("late_load_off", kern.store_then_maybe_load, x, off_flag, 6, BLOCK=8)
launch("late_load_on", kern.store_then_maybe_load, x, on_flag, 6, BLOCK=8)

table_source = torch.arange(10, 18, dtype=torch.int32)
launch("table_first", kern.through_table, pointers_to(table_source), 6, BLOCK=8)
launch("table_again", kern.through_table, pointers_to(table_source.clone()), 6, BLOCK=8)
table_source[0] = 50
launch("table_target_byte", kern.through_table, pointers_to(table_source), 6, BLOCK=8)
raw = torch.tensor([table_source.data_ptr()], dtype=torch.int64)
launch("table_unmarked", kern.through_table, raw, 6, BLOCK=8)
launch("table_unmarked_again", kern.through_table, raw, 6, BLOCK=8)

if len(sys.argv) > 3:  # the key alone: a view with other strides over the same bytes
    base = torch.arange(16, dtype=torch.int32)
    views = [base[:8], torch.arange(16, dtype=torch.int32)[:8], base[::2]]
    facts["stride_keys"] = [Arguments((view, 8), {}, (1,)).key("kernel", frozenset()) for view in views]
    facts["identity"] = [kernel_identity(kern.scale.fn), kernel_identity(edited.scale.fn)]
    around, helper = load(sys.argv[4]), load(sys.argv[5])  # another kernel edited, lines moved; a helper edited
    facts["identities"] = [
        [name, [kernel_identity(getattr(m, name).fn) for m in (kern, around, helper)]]
        for name in ("scale", "accumulate", "through_table")
    ]
print(json.dumps(facts))
"""


def _write(tmp_path):
    (tmp_path / "kern.py").write_text(textwrap.dedent(KERNEL))
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "kern.py").write_text(textwrap.dedent(KERNEL).replace("x * FACTOR + SHIFT", "x * FACTOR + SHIFT + 1"))
    (tmp_path / "run.py").write_text(textwrap.dedent(RUN))
    kernel = textwrap.dedent(KERNEL)
    accumulate, helper = "tl.load(out_ptr + offs, mask=offs < n) +", "return tl.multiple_of(ptr, 16)"
    for folder, text in (
        ("around", "# a comment that moves every line\n" + kernel.replace(accumulate, accumulate.replace(") +", ") * 2 +"))),
        ("helper", kernel.replace(helper, helper + " + 1")),
    ):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "kern.py").write_text(text)


def _run(tmp_path, cache, *extra, enabled=True) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(DCPSIM_CACHE=str(cache), DCPSIM_LAUNCH_CACHE="1" if enabled else "0")
    args = [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "kern.py"), str(tmp_path / "edited" / "kern.py"), *extra]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The launches: without the cache, with an empty one (recording), again in a new process
    (replaying), and again after every file of the cache was cut short."""
    tmp_path = tmp_path_factory.mktemp("launches")
    _write(tmp_path)
    cache = tmp_path / "cache"
    off = _run(tmp_path, cache, enabled=False)
    cold = _run(tmp_path, cache, "keys", str(tmp_path / "around" / "kern.py"), str(tmp_path / "helper" / "kern.py"))
    warm = _run(tmp_path, cache)
    files = sorted((cache / "launches").glob("*/*.launch"))
    for n, file in enumerate(files):  # corrupt: half cut, or a byte flipped
        blob = file.read_bytes()
        file.write_bytes(blob[: len(blob) // 2] if n % 2 else blob[:-1] + bytes([blob[-1] ^ 1]))
    corrupt = _run(tmp_path, cache)
    return {"off": off, "cold": cold, "warm": warm, "corrupt": corrupt, "files": len(files)}


@pytest.mark.slow  # four processes importing torch and Triton
def test_an_identical_launch_hits_and_restores_the_exact_bytes(runs):
    off, cold, warm = runs["off"], runs["cold"], runs["warm"]
    assert off["first"]["out"] == [3 * i + 5 for i in range(6)] + [-7, -7]
    assert off["first"]["counted"] == [] and off["again"]["counted"] == []  # DCPSIM_LAUNCH_CACHE=0: never asked
    assert cold["first"]["counted"] == ["miss"] and cold["again"]["counted"] == ["hit"]  # in the process
    assert all(warm[name]["counted"] == ["hit"] for name in ("first", "again", "tensor_byte", "source_byte", "table_first", "flag_on"))
    for run in (cold, warm, runs["corrupt"]):
        for name, launch in run.items():
            if isinstance(launch, dict):
                assert launch["bytes"] == off[name]["bytes"], name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tensor_byte", "constexpr", "scalar", "source_byte", "global_value"])
def test_a_changed_input_or_code_misses(runs, name):
    assert runs["cold"][name]["counted"] == ["miss"]
    assert runs["off"][name]["bytes"] != runs["off"]["first"]["bytes"]  # and the kernel's result differs


@pytest.mark.slow
def test_the_bytes_of_a_storage_only_stored_to_are_not_keyed(runs):
    off, cold = runs["off"], runs["cold"]
    assert cold["other_output_bytes"]["counted"] == ["hit"]
    assert off["other_output_bytes"]["out"] == [3 * i + 5 for i in range(6)] + [99, 99]  # the bytes not stored: the caller's
    assert cold["accumulate"]["counted"] == ["miss"] and cold["accumulate_again"]["counted"] == ["hit"]
    assert cold["accumulate_other_output_bytes"]["counted"] == ["miss"]  # loaded from: keyed
    assert off["accumulate_other_output_bytes"]["bytes"] != off["accumulate"]["bytes"]


@pytest.mark.slow
def test_a_changed_stride_or_source_changes_the_key(runs):
    same, other_copy, strided = runs["cold"]["stride_keys"]  # base[:8], a copy's [:8], base[::2]
    assert same == other_copy and strided != same
    clean, edited = runs["cold"]["identity"]
    assert clean and edited and clean != edited


@pytest.mark.slow
def test_a_kernel_is_keyed_by_its_own_code_and_its_helpers_not_by_the_rest_of_its_file(runs):
    """Files ``around`` (another kernel edited, every line moved down) and ``helper`` (the
    ``_load_ptr`` helper edited): a kernel's identity changes with its own code and its helpers'
    only, so the releases of an engine that changed a kernel's file elsewhere share its launches."""
    ids = dict(runs["cold"]["identities"])  # name -> [clean, around, helper]
    assert all(all(i) for i in ids.values())
    assert ids["scale"][0] == ids["scale"][1] == ids["scale"][2]
    assert ids["accumulate"][1] != ids["accumulate"][0] == ids["accumulate"][2]
    assert ids["through_table"][2] != ids["through_table"][0] == ids["through_table"][1]


@pytest.mark.slow
def test_a_storage_digested_at_its_first_load_is_keyed_by_its_bytes_before_the_launch(runs):
    off, cold = runs["off"], runs["cold"]
    assert cold["flag_off"]["counted"] == ["miss"] and cold["flag_on"]["counted"] == ["miss"]
    assert cold["flag_on_other_output_bytes"]["counted"] == ["miss"]  # out is loaded from: its bytes are keyed
    assert off["flag_on_other_output_bytes"]["out"] == [99 + i for i in range(6)] + [99, 99]
    assert cold["flag_on_again"]["counted"] == ["hit"]  # the bytes before the launch, not after it
    assert off["flag_on_again"]["out"] == [i - 7 for i in range(6)] + [-7, -7]
    # out stored to before its first load: its bytes before the launch are gone, so it is not kept
    assert cold["late_load_off"]["counted"] == ["miss"] and cold["late_load_on"]["counted"] == ["miss", "unreplayable"]
    assert off["late_load_on"]["out"] == [2 * i for i in range(6)] + [-7, -7]


@pytest.mark.slow
def test_a_pointer_table_is_keyed_by_what_it_points_to(runs):
    cold = runs["cold"]
    assert cold["table_first"]["counted"] == ["miss"]
    assert cold["table_again"]["counted"] == ["hit"]  # another address, the same bytes
    assert cold["table_target_byte"]["counted"] == ["miss"]
    assert cold["table_target_byte"]["out"][0] == 51
    # a table not made by pointers_to: its loads leave the keyed storages, so it is never kept
    assert cold["table_unmarked"]["counted"] == ["miss", "unreplayable"]
    assert cold["table_unmarked_again"]["counted"] == ["miss", "unreplayable"]


@pytest.mark.slow
def test_a_corrupt_or_cut_file_is_a_miss(runs):
    assert runs["files"] >= 6
    corrupt = runs["corrupt"]
    assert corrupt["first"]["counted"] == ["miss"] and corrupt["again"]["counted"] == ["hit"]
    assert corrupt["table_first"]["counted"] == ["miss"]


def test_a_folder_is_pruned_once_in_prune_every_seconds(tmp_path, monkeypatch):
    """The first store of each process prunes the folder only when no process did in the last
    ``PRUNE_EVERY`` seconds (its stamp's mtime)."""
    from dcpsim.engine.loading import launch_store

    monkeypatch.setenv(launch_store.LIMIT_ENV, str(2000 / (1 << 20)))  # 2,000 bytes

    def fill(process: int, n: int) -> None:  # a new process's store, keeping n effects of 500 bytes
        store = launch_store.LaunchStore(tmp_path)
        for i in range(n):
            assert store.put(f"{process}{i:04d}".ljust(40, "0"), ((0, b"", b"", bytes(500)),))

    fill(1, 8)  # the first store pruned the folder (then one file), and stamped it
    fill(2, 8)
    assert len(list(tmp_path.glob("*/*.launch"))) == 16  # the stamp is fresh: not pruned
    old = time.time() - launch_store.PRUNE_EVERY - 1
    os.utime(tmp_path / launch_store.PRUNED, (old, old))
    fill(3, 1)
    assert len(list(tmp_path.glob("*/*.launch"))) <= 3  # under the 2,000 bytes
    assert time.time() - (tmp_path / launch_store.PRUNED).stat().st_mtime < 60


def test_pruning_keeps_the_launches_read_since_over_those_only_written(tmp_path, monkeypatch):
    """A folder kept across CI runs: the entries a later process reads (replays) get a new
    mtime, so a pruning removes the entries no one read since they were written, not the oldest
    written ones that are still replayed."""
    from dcpsim.engine.loading import launch_store

    monkeypatch.setenv(launch_store.LIMIT_ENV, str(2500 / (1 << 20)))  # room for 4 of the 500-byte effects (and their headers)
    keys = [f"{i:02d}".ljust(40, "0") for i in range(8)]
    effect = ((0, b"", b"", bytes(500)),)
    first = launch_store.LaunchStore(tmp_path)
    for i, key in enumerate(keys):
        assert first.put(key, effect)
        written = time.time() - 1000 + i  # written in this order, 1 s apart, long ago
        os.utime(first.path(key), (written, written))
    assert launch_store.LaunchStore(tmp_path).get(keys[0]) == effect  # a later run replays the oldest two
    assert launch_store.LaunchStore(tmp_path).get(keys[1]) == effect
    launch_store.prune(tmp_path, 2500)
    kept = {p.stem for p in tmp_path.glob("*/*.launch")}
    assert {keys[0], keys[1]} <= kept, "the launches replayed since are kept"
    assert keys[2] not in kept and len(kept) <= 4


def test_a_store_saves_again_once_its_folder_was_emptied(tmp_path):
    """A process makes each folder once: when a user empties the cache under a running
    process (a benchmark's cold runs), its next saves make the folder again, leave no
    temporary file, and read back."""
    import shutil

    from dcpsim.engine.loading import launch_store

    effect = ((0, b"", b"", bytes(100)),)
    store = launch_store.LaunchStore(tmp_path / "cache")
    assert store.put("ab".ljust(40, "0"), effect)
    shutil.rmtree(tmp_path / "cache")
    assert store.put("ab".ljust(40, "1"), effect) and store.put("cd".ljust(40, "0"), effect)
    again = launch_store.LaunchStore(tmp_path / "cache")  # another process: nothing in memory
    assert again.get("ab".ljust(40, "1")) == effect and again.get("cd".ljust(40, "0")) == effect
    assert again.get("ab".ljust(40, "0")) is None  # emptied with the folder
    assert not list((tmp_path / "cache").glob("*/*.tmp"))
