"""`python -m dcpsim layout`: the numbers, the human view, and the usage errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dcpsim.cli import main

DOC = ["layout", "--dcp", "2", "--interleave", "4", "--block-size", "16", "--positions", "0:40", "--block-table", "5,6"]
P4 = [-1] * 4


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)  # the whole of stdout is one JSON document


def ref_slot(p, r, bt, B, W, I, Bk):
    """Semantics doc section 2, one position at a time (independent of dcpsim.model.layout)."""
    vb, off = divmod(p, B * W)
    if (off // I) % W != r:
        return -1
    loc = (off // (W * I)) * I + off % I
    k = B // Bk
    kernel_ids = [b * k + j for b in bt for j in range(k)]
    return kernel_ids[vb * k + loc // Bk] * Bk + loc % Bk


def test_doc_example_json(capsys):
    d = run_json(capsys, DOC)
    assert d["config"] == {
        "decode_context_parallel_size": 2,
        "cp_kv_cache_interleave_size": 4,
        "block_size": 16,
        "kernel_block_size": 16,
        "tokens_per_state": 1,
        "replicated": False,
        "block_table": [5, 6],
    }
    assert d["positions"] == list(range(40)) and d["around"] is None and d["index_kind"] == "position"
    r0 = [*range(80, 84), *P4, *range(84, 88), *P4, *range(88, 92), *P4, *range(92, 96), *P4, *range(96, 100), *P4]
    r1 = [*P4, *range(80, 84), *P4, *range(84, 88), *P4, *range(88, 92), *P4, *range(92, 96), *P4, *range(96, 100)]
    assert d["slots"] == {"0": r0, "1": r1}
    assert d["owner"] == ([0] * 4 + [1] * 4) * 5
    assert d["local_seq_lens"] == [20, 20]
    assert d["local_index"][8] == 4 and d["local_index"][39] == 19


def test_vllm_flag_names_equal_aliases(capsys):
    long = [
        "layout",
        "--decode-context-parallel-size",
        "2",
        "--cp-kv-cache-interleave-size",
        "4",
        "--block-size",
        "16",
        "--positions",
        "0:40",
        "--block-table",
        "5,6",
    ]
    assert run_json(capsys, long) == run_json(capsys, DOC)


def test_doc_example_human(capsys):
    assert main(DOC) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0].startswith("DCP layout: W=2 I=4 B=16 Bk=16 replicated=no block_table=[5, 6]")
    assert "rank 0  " + "####...." * 5 in lines
    assert "rank 1  " + "....####" * 5 in lines
    assert "        0       8       16      24      32" in lines  # ruler
    assert "local_seq_lens (L=40): rank 0: 20, rank 1: 20" in lines
    head = [ln.split() for ln in lines].index(["position", "owner", "local", "rank", "0", "rank", "1"])
    table = [ln.split() for ln in lines[head + 1 :]]
    assert ["0", "0", "0", "80", "-"] in table
    assert ["4", "1", "0", "-", "80"] in table
    assert ["39", "1", "19", "-", "99"] in table
    assert len(table) == 40 and all(len(t) == 5 for t in table)


def test_grid_wraps_at_64_and_fits_terminal(capsys):
    assert main(["layout", "--dcp", "8", "--interleave", "1", "--block-size", "16", "--positions", "0:200"]) == 0
    out = capsys.readouterr().out
    grid = [ln for ln in out.splitlines() if ln.startswith("rank 3  ")]
    assert [len(g) - len("rank 3  ") for g in grid] == [64, 64, 64, 8]
    assert grid[0].endswith("...#...." * 8)
    assert max(len(ln) for ln in out.splitlines()) <= 120


def test_matches_doc_formula_with_kernel_blocks(capsys):
    B, W, I, Bk, bt = 8, 4, 2, 4, [3, 9, 4]
    d = run_json(
        capsys,
        [
            "layout",
            "--dcp",
            str(W),
            "--interleave",
            str(I),
            "--block-size",
            str(B),
            "--kernel-block-size",
            str(Bk),
            "--block-table",
            "3,9,4",
        ],
    )
    assert d["positions"] == list(range(len(bt) * B * W))  # default: what the table covers
    for r in range(W):
        assert d["slots"][str(r)] == [ref_slot(p, r, bt, B, W, I, Bk) for p in d["positions"]]
    assert d["config"]["kernel_block_size"] == 4


def test_default_block_table_and_positions(capsys):
    d = run_json(capsys, ["layout", "--dcp", "2", "--interleave", "4", "--block-size", "16"])
    assert d["positions"] == list(range(64))  # 2 virtual blocks of B*W
    assert d["config"]["block_table"] == [1, 2]
    d = run_json(capsys, ["layout", "--dcp", "2", "--block-size", "16", "--positions", "70"])
    assert d["config"]["block_table"] == [1, 2, 3]
    assert d["slots"]["0"] == [3 * 16 + 3]  # vb 2, off 6 -> rank 0, loc 3


def test_mixed_positions(capsys):
    argv = ["layout", "--dcp", "2", "--interleave", "4", "--block-size", "16", "--positions", "40:48,0:8,5", "--block-table", "5,6"]
    d = run_json(capsys, argv)
    assert d["positions"] == [*range(8), *range(40, 48)]
    assert d["slots"]["0"][8:] == [*range(84 + 16, 88 + 16), *P4]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "owned among the 16 given positions: rank 0: 8, rank 1: 8" in out
    assert "rank 0  ####.... ####...." in out  # a blank column marks the jump 7 -> 40


def test_replicated(capsys):
    argv = [
        "layout",
        "--dcp",
        "2",
        "--interleave",
        "4",
        "--block-size",
        "16",
        "--positions",
        "0:20",
        "--block-table",
        "5,6",
        "--dcp-replicated",
    ]
    d = run_json(capsys, argv)
    plain = [*range(80, 96), *range(96, 100)]
    assert d["slots"] == {"0": plain, "1": plain}
    assert d["owner"] == "all"
    assert d["local_seq_lens"] == [20, 20]
    assert d["config"]["replicated"] is True
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "every rank stores every position" in out
    assert "rank 1  " + "#" * 20 in out
    assert ["19", "all", "19", "99", "99"] in [ln.split() for ln in out.splitlines()]


def test_records_doc_example(capsys):
    # semantics section 4: 16-token pages of R = 2 (8 records), W = 2, I = 4; here B counts
    # states (records) per page, as run --block-size does: B = 8
    d = run_json(
        capsys,
        [
            "layout",
            "--dcp",
            "2",
            "--interleave",
            "4",
            "--block-size",
            "8",
            "--tokens-per-state",
            "2",
            "--positions",
            "0:40",
            "--block-table",
            "5,6",
        ],
    )
    assert d["index_kind"] == "record" and d["config"]["tokens_per_state"] == 2
    assert d["records"] == list(range(20))
    assert d["record_emit_positions"] == [2 * c + 1 for c in range(20)]
    rec = dict(zip(d["record_emit_positions"], zip(d["records"], d["owner"], d["local_index"])))
    assert rec[7] == (3, 0, 3) and rec[9] == (4, 1, 0) and rec[39] == (19, 0, 11)
    assert d["slots"]["0"][19] == 6 * 8 + 3 and d["slots"]["1"][19] == -1  # page 1 (block 6), in-page 3
    assert d["slots"]["1"][4:8] == [40, 41, 42, 43]
    assert d["local_seq_lens"] == [12, 8]  # 20 records emitted below L = 40


def test_records_text_and_window(capsys):
    argv = ["layout", "--dcp", "2", "--interleave", "2", "--block-size", "8", "--tokens-per-state", "4", "--positions", "5:20"]
    d = run_json(capsys, argv)
    assert d["records"] == [1, 2, 3, 4] and d["record_emit_positions"] == [7, 11, 15, 19]
    assert d["owner"] == [0, 1, 1, 0]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "R=4" in out.splitlines()[0]
    assert "record c folds positions c*4..c*4+3 and is emitted at position (c+1)*4-1" in out
    table = [ln.split() for ln in out.splitlines()]
    assert ["record", "emitted", "owner", "local", "rank", "0", "rank", "1"] in table
    assert ["3", "15", "1", "1", "-", "9"] in table  # record 3: rank 1's second record


def test_around_centres_a_window(capsys):
    argv = ["layout", "--dcp", "4", "--block-size", "16", "--around", "100", "--window", "24"]
    d = run_json(capsys, argv)
    assert d["positions"] == list(range(88, 112)) and d["around"] == 100
    assert d["config"]["block_table"] == [1, 2]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "window of 24 positions 88..111 around position 100" in lines
    grid = lines.index("rank 3  " + "...#" * 6)
    assert lines[grid + 1] == " " * (8 + 12) + "^ position 100"  # column of 100 = 100 - 88


@pytest.mark.parametrize(
    "argv, positions",
    [
        (["--dcp", "4", "--block-size", "16", "--around", "3"], range(0, 32)),  # default: 32, not below 0
        (
            ["--dcp", "2", "--interleave", "4", "--block-size", "16", "--around", "60", "--block-table", "5,6"],
            range(32, 64),
        ),  # 4 rounds of W*I = 32, moved left to stay inside the table
        (["--dcp", "8", "--interleave", "64", "--block-size", "64", "--around", "5000"], range(4872, 5128)),  # 256 at most
        (
            ["--dcp", "2", "--interleave", "2", "--block-size", "8", "--tokens-per-state", "4", "--around", "100"],
            range(68, 132),
        ),  # 4 rounds of W*I*R = 16 positions
    ],
)
def test_around_default_windows(capsys, argv, positions):
    assert run_json(capsys, ["layout", *argv])["positions"] == list(positions)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--interleave", "32", "--block-size", "16"], "cp_kv_cache_interleave_size (32)"),
        (["--interleave", "3", "--block-size", "16"], "cp_kv_cache_interleave_size (3)"),
        (["--block-size", "16", "--kernel-block-size", "5"], "kernel_block_size (5)"),
        (["--block-size", "0"], "block_size must be an integer >= 1, got 0"),
        (["--block-size", "16", "--block-table", "4,0"], "block 0 is the reserved null block"),
        (["--block-size", "16", "--block-table", "4,4"], "block 4 is listed twice"),
        (["--block-size", "16", "--block-table", "4,x"], "'x'"),
        (
            ["--block-size", "16", "--block-table", "5,6", "--positions", "0:65"],
            "position 64 needs block-table entry 2, but --block-table has 2 entries",
        ),
        (["--block-size", "16", "--positions", "0-5"], "cannot parse '0-5'"),
        (["--block-size", "16", "--positions", "-3"], "cannot parse '-3'"),
        (["--block-size", "16", "--positions", "8:4"], "range '8:4' is empty"),
        (["--block-size", "16", "--positions", "100:"], "an open range ends at 64"),
        (["--block-size", "16", "--positions", "0:99999999"], "more than"),
        (
            ["--block-size", "16", "--block-table", "5,6", "--around", "64"],
            "--around 64: position 64 needs block-table entry 2, but --block-table has 2 entries",
        ),
        (["--block-size", "16", "--around", "8", "--positions", "0:8"], "give one of them"),
        (["--block-size", "16", "--window", "8"], "give --around P too"),
        (["--block-size", "16", "--around", "-1"], "--around must be an integer >= 0, got -1"),
        (["--block-size", "16", "--around", "8", "--window", "0"], "--window must be an integer >= 1, got 0"),
        (["--block-size", "16", "--tokens-per-state", "0"], "--tokens-per-state must be an integer >= 1"),
        (["--block-size", "8", "--tokens-per-state", "4", "--positions", "0:3"], "no record is emitted at the positions shown (0..2)"),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, extra, needle):
    assert main(["layout", "--dcp", "2", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("dcpsim: error: ") and err.count("\n") == 1
    assert needle in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["layout", "--dcp", "two", "--block-size", "16"])
    assert exc.value.code == 2
    assert "--decode-context-parallel-size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--dcp", "2"], "--block-size B"),
        (["--block-size", "16"], "--decode-context-parallel-size/--dcp W"),
    ],
)
def test_missing_layout_flags_exit_2(capsys, argv, flag):
    assert main(["layout", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"dcpsim: error: {flag} is required (or --from-report REPORT.json)\n"


@pytest.mark.slow
def test_module_entry_point():
    """``python -m dcpsim layout`` in a process of its own. Its usage error (block 0 in
    ``--block-table``): ``test_usage_errors_exit_2_with_one_line`` in this process; the entry
    point's exit 2 without a traceback in a subprocess: ``test_bad_inputs.py``'s runaway inputs."""
    proc = subprocess.run(
        [sys.executable, "-m", "dcpsim", "layout", *DOC[1:], "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["slots"]["1"][4:8] == [80, 81, 82, 83]
