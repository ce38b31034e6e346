"""A fuzz of the CLI and the loader with the values a new user may type (Hypothesis):
whatever the input, the CLI ends with an exit code in {0, 1, 2, 3}, no Python traceback
on stderr (a rank's failure report may quote the rank's traceback, indented), one JSON
document on stdout under ``--json``, within a memory limit and a time limit. The loader
and the estimate, in this process, raise nothing but ``ConfigError``."""

from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcpsim.errors import ConfigError
from dcpsim.harness.budget import check_budget
from dcpsim.harness.dry_run import dry_run
from dcpsim.scenarios.load import scenario_from_dict
from support.helpers import EXTREME_INTS, TINY_SCENARIO, run_cli, scenario_toml

FIELDS = (
    ((), "seed"),
    ((), "kv_cache_tokens"),
    ((), "num_gpu_blocks"),
    ((), "max_steps"),
    ((), "verify_every"),
    (("config",), "max_model_len"),
    (("config",), "max_num_batched_tokens"),
    (("config",), "decode_context_parallel_size"),
    (("config",), "cp_kv_cache_interleave_size"),
    (("config",), "num_speculative_tokens"),
    (("config",), "max_num_seqs"),
    (("config",), "max_cudagraph_capture_size"),
    (("config",), "long_prefill_token_threshold"),
    (("layers", 0), "block_size"),
    (("layers", 0), "num_kv_heads"),
    (("layers", 0), "head_size"),
    (("requests", 0), "count"),
    (("requests", 0), "prompt_len"),
    (("requests", 0), "output_len"),
    (("requests", 0), "arrival_step"),
    (("requests", 0), "shared_prefix_len"),
    (("requests", 0), "preempt_at_steps"),
    (("requests", 0), "acceptance"),
)
VALUES = st.one_of(st.sampled_from(EXTREME_INTS), st.integers(-2, 4))


@st.composite
def scenarios(draw) -> dict:
    """``TINY_SCENARIO`` with one to three fields set to edge values."""
    data = copy.deepcopy(TINY_SCENARIO)
    for where, key in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        table = data
        for part in where:
            table = table[part]
        value = draw(VALUES)
        table[key] = [value] if key in ("preempt_at_steps", "acceptance") else value
    return data


FLAGS = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(
                ["--dcp", "--interleave", "--block-size", "--kernel-block-size", "--seed", "--verify-every", "--max-cudagraph-capture-size"]
            ),
            st.sampled_from(EXTREME_INTS).map(str),
        ),
        st.tuples(st.sampled_from(["--timeout", "--deadline"]), st.sampled_from(["0", "-5", "nan", "inf", "1e300"])),
        st.tuples(
            st.just("--simulate-rank-failure"), st.sampled_from(["", "raise:0:99999", "raise:9:0", "exit:0:-1", "hang", "raise:0:0:0"])
        ),
        st.tuples(st.sampled_from(["--paranoid", "--attention", "--force"])),
    ),
    max_size=3,
)


def no_traceback(err: str) -> bool:
    return re.search(r"^Traceback", err, re.M) is None


@pytest.mark.slow
@settings(
    max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=scenarios(), flags=FLAGS, as_json=st.booleans())
def test_the_cli_ends_cleanly_whatever_the_input(tmp_path, data, flags, as_json):
    path = tmp_path / "fuzz.toml"
    path.write_text(scenario_toml(data), encoding="utf-8")
    argv = ["run", str(path), "--in-process", *(x for flag in flags for x in flag)] + (["--json"] if as_json else [])
    result = run_cli(argv, timeout=180)
    assert result.returncode in (0, 1, 2, 3), (argv, result.returncode, result.stderr[-3000:])
    assert no_traceback(result.stderr), (argv, result.stderr[-3000:])
    if as_json:
        json.loads(result.stdout)  # exactly one document


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=scenarios())
def test_the_loader_and_the_estimate_raise_only_config_errors(data):
    try:
        scenario = scenario_from_dict(data, source="fuzz.toml")
        check_budget(scenario, available=8 * 2**30)
    except ConfigError:
        return


@pytest.mark.parametrize(
    "where, key, value",
    [
        (("config",), "max_model_len", 99999999999999999999),
        ((), "kv_cache_tokens", 9_000_000_000_000_000_000),
        (("requests", 0), "prompt_len", 1_000_000_000),
        (("config",), "max_cudagraph_capture_size", 10**12),
        (("requests", 0), "count", 100_000),
    ],
)
def test_the_issues_values_are_estimated_or_refused_at_once(where, key, value):
    """Each is refused by the loader or the estimate (``ConfigError``), or estimated, and
    dry-run here when it is small."""
    data = copy.deepcopy(TINY_SCENARIO)
    table = data
    for part in where:
        table = table[part]
    table[key] = value
    if key == "prompt_len":
        data["config"]["max_model_len"] = 2 * value
    try:
        scenario = scenario_from_dict(data, source="fuzz.toml")
        budget = check_budget(scenario, available=8 * 2**30)
    except ConfigError as exc:
        assert "fuzz.toml" in str(exc) or "needs" in str(exc)
        return
    if budget.min_steps < 1000:  # small enough to run here: the bound holds
        assert dry_run(scenario).steps >= budget.min_steps
    else:  # 100,000 requests of 110 tokens at 128 a step: long, but it fits
        assert budget.min_steps == -(-budget.workload_tokens // 128) and budget.workload_tokens == 11_000_000
