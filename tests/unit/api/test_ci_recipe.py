"""The CI recipe (examples/ci/) stays runnable: the workflow's shards are 1..N of one matrix and
merged once, every ``dcpsim`` command in it and in the engine repository's README parses with
dcpsim's own parser, every ``--dcpsim-*`` flag of a pytest command is one of the plugin's with a
valid value, and the engine repository's test file passes on the reference engine."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from dcpsim import pytest_plugin
from dcpsim.campaigns.shard import parse_shard
from dcpsim.cli import build_parser
from dcpsim.engine.loading import launch_store
from dcpsim.errors import ConfigError

pytest_plugins = ["pytester"]

CI = Path(__file__).resolve().parents[3] / "examples" / "ci"
WORKFLOW = CI / "github-actions.yml"
ENGINE_REPO = CI / "engine-repo"


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))


def shell_lines(text: str, shard: int | None = None) -> list[list[str]]:
    """The commands of a ``run:`` block (or a bash block), ``${{ matrix.shard }}`` as ``shard``."""
    text = text.replace("${{ matrix.shard }}", str(shard)) if shard is not None else text
    return [shlex.split(line) for line in text.replace("\\\n", " ").splitlines() if line.strip() and not line.lstrip().startswith("#")]


def readme_commands() -> list[list[str]]:
    """The commands of the engine repository's README and of docs/api.md."""
    texts = [(ENGINE_REPO / "README.md").read_text(encoding="utf-8"), (CI.parents[1] / "docs" / "api.md").read_text(encoding="utf-8")]
    return [cmd for text in texts for block in re.findall(r"```bash\n(.*?)```", text, re.S) for cmd in shell_lines(block)]


def plugin_flags() -> dict[str, dict]:
    """The plugin's options: flag -> addoption keywords."""
    flags: dict[str, dict] = {}

    class Group:
        def addoption(self, *names, **kwargs):
            flags.update({n: kwargs for n in names})

    class Parser:
        def getgroup(self, *args, **kwargs):
            return Group()

    pytest_plugin.pytest_addoption(Parser())
    return flags


def check_dcpsim(argv: list[str]) -> None:
    """``python -m dcpsim ARGV`` parses (argparse exits on a bad flag)."""
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"dcpsim {shlex.join(argv)}: does not parse (exit {exc.code})")


def check_pytest(argv: list[str]) -> list[str]:
    """Every ``--dcpsim-*`` flag of a pytest command is the plugin's, with a valid value; the
    flags it gives."""
    flags = plugin_flags()
    given = []
    k = 0
    while k < len(argv):
        name, eq, value = argv[k].partition("=")
        k += 1
        if not name.startswith("--dcpsim-"):
            continue
        assert name in flags, f"pytest {shlex.join(argv)}: {name} is not an option of dcpsim's plugin ({', '.join(flags)})"
        takes_value = flags[name].get("action") != "store_true" and flags[name].get("nargs") != "?"
        if takes_value and not eq:
            assert k < len(argv) and not argv[k].startswith("-"), f"{name} needs a value"
            value = argv[k]
            k += 1
        if name == "--dcpsim-shard":
            parse_shard(value, name)
        given.append(name)
    return given


def commands(cmd: list[str]) -> tuple[str, list[str]] | None:
    """("dcpsim" | "pytest", its arguments) for a dcpsim or pytest command, else None."""
    for prefix, kind in (
        (["python", "-m", "dcpsim"], "dcpsim"),
        (["dcpsim"], "dcpsim"),
        (["python", "-m", "pytest"], "pytest"),
        (["pytest"], "pytest"),
    ):
        if cmd[: len(prefix)] == prefix:
            return kind, cmd[len(prefix) :]
    return None


def test_the_shards_are_one_to_n_of_one_matrix_then_merged():
    jobs = workflow()["jobs"]
    shards = jobs["shard"]["strategy"]["matrix"]["shard"]
    assert shards == list(range(1, len(shards) + 1))
    runs = [step["run"] for step in jobs["shard"]["steps"] if "run" in step]
    matrix_runs = [c for text in runs for c in shell_lines(text, shard=2) if "--dcpsim-matrix" in " ".join(c)]
    assert len(matrix_runs) == 1
    (cmd,) = matrix_runs
    assert cmd[cmd.index("--dcpsim-shard") + 1] == f"2/{len(shards)}", "the shard list and N of K/N disagree"
    junit = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
    uploads = [s["with"]["path"] for s in jobs["shard"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert uploads == [junit.replace("2", "${{ matrix.shard }}")]
    merge = jobs["merge"]
    assert merge["needs"] == "shard" and merge["if"] == "always()"
    merges = [c for s in merge["steps"] if "run" in s for c in shell_lines(s["run"]) if commands(c) and commands(c)[1][:1] == ["merge"]]
    assert len(merges) == 1 and merges[0][4] == "dcpsim-shard-*.xml"


def test_each_shard_keeps_the_launch_cache_dcpsim_uses(monkeypatch, tmp_path):
    """The workflow's cache step saves the folder a rank's launch store writes (with no
    ``$DCPSIM_CACHE`` or ``$DCPSIM_LAUNCH_CACHE_DIR``), before the steps that run dcpsim, under a
    key new each run, restoring the shard's own newest entry."""
    steps = workflow()["jobs"]["shard"]["steps"]
    caches = [k for k, s in enumerate(steps) if s.get("uses", "").startswith("actions/cache")]
    assert len(caches) == 1, "one cache step: the launch cache"
    step = steps[caches[0]]
    monkeypatch.delenv("DCPSIM_CACHE", raising=False)
    monkeypatch.delenv(launch_store.FOLDER_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Path(step["with"]["path"].replace("~", str(tmp_path), 1)) == launch_store.LaunchStore()._folder()
    runs_dcpsim = [k for k, s in enumerate(steps) if "run" in s and "dcpsim" in s["run"] and "pip install" not in s["run"]]
    assert runs_dcpsim and caches[0] < min(runs_dcpsim), "the cache is restored before dcpsim runs"
    key, restore = step["with"]["key"], [k.strip() for k in step["with"]["restore-keys"].splitlines() if k.strip()]
    assert "${{ matrix.shard }}" in key and "${{ github.run_id }}" in key
    assert restore == [key.split("${{ github.run_id }}")[0]], "restore the shard's newest entry: the key less its run"


def test_every_command_of_the_recipe_is_real():
    jobs = workflow()["jobs"]
    cmds = [c for job in jobs.values() for s in job["steps"] if "run" in s for c in shell_lines(s["run"], shard=1)]
    cmds += readme_commands()
    seen = {"dcpsim": 0, "pytest": 0}
    flags: set[str] = set()
    for cmd in cmds:
        found = commands(cmd)
        if found is None:
            continue
        kind, argv = found
        seen[kind] += 1
        if kind == "dcpsim":
            check_dcpsim(argv)
        else:
            flags.update(check_pytest(argv))
    assert seen["dcpsim"] >= 3 and seen["pytest"] >= 6
    assert {"--dcpsim-engine", "--dcpsim-vllm-source", "--dcpsim-shard", "--dcpsim-matrix"} <= flags


@pytest.mark.parametrize(
    "argv, error",
    [
        (["python", "-m", "dcpsim", "merge", "a.xml", "--junit-output", "m.xml"], pytest.fail.Exception),
        (["dcpsim", "matrix", "--shard"], pytest.fail.Exception),
        (["python", "-m", "pytest", "--dcpsim-shards", "1/4"], AssertionError),
        (["python", "-m", "pytest", "--dcpsim-shard", "5/4"], ConfigError),
        (["pytest", "--dcpsim-engine"], AssertionError),
    ],
)
def test_the_checks_catch_a_bad_command(argv, error, capsys):
    kind, args = commands(argv)
    with pytest.raises(error):
        check_dcpsim(args) if kind == "dcpsim" else check_pytest(args)


@pytest.mark.slow
def test_the_engine_repository_test_file_passes_on_the_reference_engine(pytester):
    pytester.makepyfile(test_dcpsim=(ENGINE_REPO / "test_dcpsim.py").read_text(encoding="utf-8"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--dcpsim-in-process")
    result.assert_outcomes(passed=4)
