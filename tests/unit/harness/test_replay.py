"""A --json report carries everything needed to rerun the same configuration and schedule."""

from __future__ import annotations

import json

from dcpsim.cli import main


def run_json(capsys, *argv):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_replay_reruns_the_failing_configuration_exactly(capsys, tmp_path):
    code, first = run_json(
        capsys,
        "run",
        "llama-gqa",
        "--dcp",
        "3",
        "--interleave",
        "4",
        "--seed",
        "9",
        "--block-size",
        "32",
        "--inject",
        "interleave-off-by-one",
        "--in-process",
    )
    assert code == 1
    path = tmp_path / "report.json"
    path.write_text(json.dumps(first))
    code, again = run_json(capsys, "replay", str(path), "--in-process")
    assert code == 1
    assert again["failure"] == first["failure"]
    assert (again["dcp_size"], again["interleave_size"]) == (3, 4)
    assert again["replay"] == first["replay"]
    assert first["replay"]["options"]["inject"] == "interleave-off-by-one"
    assert first["replay"]["scenario"]["seed"] == 9


def test_replay_of_a_passing_run_passes(capsys, tmp_path):
    code, first = run_json(capsys, "run", "dsv41-hybrid", "--dcp", "2", "--in-process")
    assert code == 0
    path = tmp_path / "report.json"
    path.write_text(json.dumps(first))
    code, again = run_json(capsys, "replay", str(path), "--in-process")
    assert code == 0
    assert (again["steps"], again["verified_indices"]) == (first["steps"], first["verified_indices"])


def test_bad_replay_files_exit_2_naming_the_file(capsys, tmp_path):
    missing = tmp_path / "missing.json"
    assert main(["replay", str(missing)]) == 2
    assert f"{missing}: no such report file" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert main(["replay", str(garbage)]) == 2
    assert f"{garbage}: not a JSON report" in capsys.readouterr().err
    code, report = run_json(capsys, "run", "dsv3", "--dcp", "2", "--in-process")
    report["replay"]["options"]["lse_base"] = "10"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(report))
    assert main(["replay", str(edited)]) == 2
    assert "replay.options: lse_base must be 'e' or '2'" in capsys.readouterr().err


def test_replay_a_matrix_cell(capsys, tmp_path):
    assert main(["matrix", "dsv3", "--dcp", "2", "--interleave", "1,4", "--in-process", "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(cells))
    assert main(["replay", str(path)]) == 2
    assert "no failing cell in this matrix report" in capsys.readouterr().err
    code, again = run_json(capsys, "replay", str(path), "--cell", "dsv3-dcp2-il4-bs64", "--in-process")
    assert code == 0 and (again["dcp_size"], again["interleave_size"]) == (2, 4)
