"""The scenario loader: built-ins, error reporting (all at once, ``file: path.field: message``,
did-you-mean), ``{i}`` stamping, ``with_overrides(block_size=...)``, and a fuzz test that
``scenario_from_dict`` only ever raises ``ScenarioError`` / ``ConfigError``.

Crashes the fuzz once found are kept below as regression examples.
"""

from __future__ import annotations

import datetime
import re
import signal
import textwrap
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dcpsim.errors import ConfigError, ScenarioError
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.model.specs import CircularBufferSpec, MLAAttentionSpec, SlidingWindowMLASpec
from dcpsim.scenarios.load import load_scenario, resolve, scenario_from_dict
from dcpsim.scenarios.registry import SPEC_KINDS, builtin_scenario_names
from support.helpers import geometries

SRC = "f.toml"
LINE = re.compile(r"^f\.toml: (?P<path>[A-Za-z_][\w]*(?:\[\d+\])?(?:\.[A-Za-z_]\w*)*): (?P<msg>.+)$")


def minimal(**top):
    data = {
        "layers": [{"name": "l", "kind": "mla", "block_size": 16, "head_size": 64}],
        "requests": [{"prompt_len": 10, "output_len": 5}],
    }
    data.update(top)
    return data


def problems(data) -> list[tuple[str, str]]:
    """(path, message) of every reported problem; each line must have the documented shape."""
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(data, source=SRC)
    out = []
    for line in str(exc.value).splitlines():
        m = LINE.match(line)
        assert m, f"not 'file: path.field: message': {line!r}"
        out.append((m["path"], m["msg"]))
    return out


def write(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(p)


# ----------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("name", builtin_scenario_names())
def test_every_builtin_loads_and_validates(name):
    sc = load_scenario(name)
    assert sc.name == name and sc.source == f"{name}.toml"
    assert sc.layers and sc.requests
    geometries(sc)  # groups and geometry are valid under the scenario's own config


def test_dsv3_contents():
    sc = load_scenario("dsv3")
    # "0-60" stamps 61 layers; 2 + 1 + 1 + 3 + 2 requests
    assert len(sc.layers) == 61
    assert list(sc.layers)[0] == "model.layers.0.self_attn.mla_attn"
    assert list(sc.layers)[-1] == "model.layers.60.self_attn.mla_attn"
    assert all(isinstance(s, MLAAttentionSpec) and s.block_size == 64 for s in sc.layers.values())
    ids = [r.request_id for r in sc.requests]
    assert ids == ["chat-0", "chat-1", "short", "long-doc", "late-0", "late-1", "late-2", "tail-0", "tail-1"]
    assert sc.requests[0].acceptance == (3, 1, 0, 2) and sc.requests[3].preempt_at_steps == (12,)
    assert sc.config.decode_context_parallel_size == 2 and sc.config.num_speculative_tokens == 3
    assert sc.kv_cache_tokens == 3072


def test_dsv41_hybrid_contents():
    sc = load_scenario("dsv41-hybrid")
    swa = [n for n, s in sc.layers.items() if isinstance(s, SlidingWindowMLASpec)]
    rings = [n for n, s in sc.layers.items() if isinstance(s, CircularBufferSpec)]
    assert len(swa) == 40 and len(rings) == 3
    assert sc.layers["model.layers.8.attn.main_cache"].tokens_per_state == 2
    assert sc.layers["model.layers.20.attn.main_cache"].tokens_per_state == 1
    assert all(sc.layers[n].dcp_replicated for n in swa + rings)
    assert sc.config.enable_prefix_caching is False


def test_builtin_by_path_and_misspelled_name(tmp_path):
    path = str(resolve("dsv3"))
    assert load_scenario(path).name == "dsv3"
    with pytest.raises(ScenarioError, match=r"did you mean 'dsv3'\?"):
        load_scenario("dsv3x")
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenario(str(tmp_path / "missing.toml"))


# ----------------------------------------------------------------------------- errors


def test_invalid_toml(tmp_path):
    path = write(
        tmp_path,
        """
        name = "x"
        [config
        max_model_len = 4
    """,
    )
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert str(exc.value).startswith(f"{path}: not valid TOML")


def test_all_problems_reported_at_once_with_paths(tmp_path):
    path = write(
        tmp_path,
        """
        name = "many-problems"
        verfy_every = 2
        seed = "zero"

        [config]
        max_model_lenn = 4096
        decode_context_parallel_size = 0

        [[layers]]
        name = "a"
        kind = "mla"
        blok_size = 16
        head_size = 64

        [[layers]]
        name = "b"
        kind = "slidng_window"

        [[requests]]
        promt_len = 10
        output_len = 5

        [[requests]]
        id = "r-{i}"
        count = 2
        prompt_len = "ten"
        output_len = 5
    """,
    )
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    lines = str(exc.value).splitlines()
    assert all(line.startswith(f"{path}: ") for line in lines)
    got = {line[len(path) + 2 :].split(": ", 1)[0]: line for line in lines}
    expect = {
        "verfy_every": "did you mean 'verify_every'?",
        "seed": "must be an integer",
        "config.max_model_lenn": "did you mean 'max_model_len'?",
        "config.decode_context_parallel_size": ">= 1",
        "layers[0].blok_size": "did you mean 'block_size'?",
        "layers[0].block_size": "required",
        "layers[1].kind": "did you mean 'sliding_window'?",
        "requests[0].promt_len": "did you mean 'prompt_len'?",
        "requests[0].prompt_len": "required",
        "requests[1].prompt_len": "must be an integer",
    }
    for key, text in expect.items():
        assert key in got, f"{key} not reported; got {sorted(got)}"
        assert text in got[key], got[key]


@pytest.mark.parametrize(
    "section,data,path,hint",
    [
        ("top", minimal(verify_evry=1), "verify_evry", "verify_every"),
        ("top", minimal(request=[]), "request", "requests"),
        ("config", minimal(config={"num_speculative_token": 1}), "config.num_speculative_token", "num_speculative_tokens"),
        ("config", minimal(config={"enable_prefix_cache": True}), "config.enable_prefix_cache", "enable_prefix_caching"),
        (
            "layers",
            minimal(layers=[{"name": "l", "kind": "mla", "block_size": 16, "head_size": 64, "dcp_replicatd": True}]),
            "layers[0].dcp_replicatd",
            "dcp_replicated",
        ),
        (
            "layers",
            minimal(
                layers=[{"name": "l", "kind": "sliding_window", "block_size": 16, "head_size": 8, "num_kv_heads": 1, "sliding_windw": 8}]
            ),
            "layers[0].sliding_windw",
            "sliding_window",
        ),
        ("requests", minimal(requests=[{"prompt_len": 1, "output_len": 1, "arival_step": 2}]), "requests[0].arival_step", "arrival_step"),
        ("requests", minimal(requests=[{"prompt_len": 1, "output_len": 1, "acceptence": [1]}]), "requests[0].acceptence", "acceptance"),
    ],
)
def test_did_you_mean(section, data, path, hint):
    found = dict(problems(data))
    assert path in found, found
    assert f"did you mean {hint!r}?" in found[path]


@pytest.mark.parametrize(
    "kind,hint", [("ml", "mla"), ("sliding_windows", "sliding_window"), ("rng", "ring"), ("full_atention", "full_attention")]
)
def test_unknown_kind_suggests(kind, hint):
    data = minimal(layers=[{"name": "l", "kind": kind, "block_size": 16, "head_size": 64}])
    ((path, msg),) = problems(data)
    assert path == "layers[0].kind"
    assert f"did you mean {hint!r}?" in msg and "one of" in msg


def test_unknown_kind_without_close_match_lists_kinds():
    ((path, msg),) = problems(minimal(layers=[{"name": "l", "kind": "zzzz", "block_size": 1}]))
    assert path == "layers[0].kind" and "did you mean" not in msg
    assert all(k in msg for k in SPEC_KINDS)


@pytest.mark.parametrize(
    "data,path,text",
    [
        ({"requests": [{"prompt_len": 1, "output_len": 1}]}, "layers", "at least one"),
        ({"layers": [{"name": "l", "kind": "mla", "block_size": 16, "head_size": 8}]}, "requests", "at least one"),
        (minimal(requests=[{"output_len": 1}]), "requests[0].prompt_len", "required"),
        (minimal(requests=[{"prompt_len": 1}]), "requests[0].output_len", "required"),
        (minimal(layers=[{"kind": "mla", "block_size": 16, "head_size": 64}]), "layers[0].name", "name"),
        (minimal(layers=[{"name": "l", "kind": "mla", "head_size": 64}]), "layers[0].block_size", "required"),
        (minimal(layers=[{"name": "l", "kind": "mla", "block_size": 16}]), "layers[0].head_size", "required"),
        (
            minimal(layers=[{"name": "l", "kind": "sliding_window", "block_size": 16, "head_size": 8, "num_kv_heads": 1}]),
            "layers[0].sliding_window",
            "required",
        ),
        (
            minimal(layers=[{"name": "l", "kind": "chunked_local", "block_size": 16, "head_size": 8, "num_kv_heads": 1}]),
            "layers[0].attention_chunk_size",
            "required",
        ),
        (minimal(layers=[{"name": "l", "block_size": 16, "head_size": 8}]), "layers[0].kind", "unknown kind"),
    ],
)
def test_missing_required_fields(data, path, text):
    found = dict(problems(data))
    assert path in found and text in found[path], found


@pytest.mark.parametrize(
    "data,path,text",
    [
        (minimal(seed="0"), "seed", "must be an integer"),
        (minimal(num_gpu_blocks=1.5), "num_gpu_blocks", "must be an integer"),
        (minimal(verify_every=True), "verify_every", "must be an integer"),
        (minimal(config=[1]), "config", "must be a table"),
        (minimal(config={"max_model_len": "big"}), "config.max_model_len", "integer"),
        (minimal(config={"kernel_block_size": 1.5}), "config.kernel_block_size", "integer"),
        (minimal(config={"long_prefill_token_threshold": -1}), "config.long_prefill_token_threshold", ">= 0"),
        (minimal(layers="mla"), "layers", "at least one"),
        (minimal(layers=[3]), "layers[0]", "must be a table"),
        (minimal(layers=[{"name": "l", "kind": "mla", "block_size": "16", "head_size": 64}]), "layers[0].block_size", "integer"),
        (minimal(layers=[{"name": "l", "kind": "mla", "block_size": 16, "head_size": 64, "dtype": "fp7"}]), "layers[0].dtype", "not known"),
        (
            minimal(layers=[{"name": "l", "kind": "mla", "block_size": 16, "head_size": 64, "dcp_replicated": "yes"}]),
            "layers[0].dcp_replicated",
            "true or false",
        ),
        (
            minimal(layers=[{"name": "l", "kind": "mla", "block_size": 16, "head_size": 64, "tokens_per_state": "x/2"}]),
            "layers[0].tokens_per_state",
            "fraction",
        ),
        (
            minimal(layers=[{"name": "l", "kind": "mla", "block_size": 16, "head_size": 64, "tokens_per_state": "1/0"}]),
            "layers[0].tokens_per_state",
            "fraction",
        ),
        (minimal(layers=[{"name": 5, "kind": "mla", "block_size": 16, "head_size": 64}]), "layers[0].name", "name"),
        (minimal(requests=[{"prompt_len": 1.0, "output_len": 1}]), "requests[0].prompt_len", "integer"),
        (minimal(requests=[{"prompt_len": True, "output_len": 1}]), "requests[0].prompt_len", "integer"),
        (minimal(requests=[{"prompt_len": 1, "output_len": 1, "acceptance": 3}]), "requests[0].acceptance", "list"),
        (
            minimal(requests=[{"prompt_len": 1, "output_len": 1, "preempt_at_steps": [True]}]),
            "requests[0].preempt_at_steps",
            "list of integers",
        ),
        (minimal(requests=[{"prompt_len": 1, "output_len": 1, "count": 0}]), "requests[0].count", "from 1 to"),
        (minimal(requests=[{"prompt_len": 1, "output_len": 1, "count": "2"}]), "requests[0].count", "from 1 to"),
        (minimal(requests=["r"]), "requests[0]", "must be a table"),
        (minimal(requests=[{"prompt_len": 0, "output_len": 1}]), "requests[0]", "prompt_len must be >= 1"),
    ],
)
def test_bad_types_and_values(data, path, text):
    found = dict(problems(data))
    assert path in found and text in found[path], found


def test_scenario_level_errors_name_the_file():
    # errors found once the pieces are assembled (Scenario.__post_init__) still name the file
    for data, text in [
        (minimal(num_gpu_blocks=0), "num_gpu_blocks: must be >= 1"),
        (minimal(requests=[{"id": "a", "prompt_len": 1, "output_len": 1}] * 2), "used twice"),
        (minimal(requests=[{"prompt_len": 9000, "output_len": 1}]), "exceeds max_model_len"),
        (minimal(requests=[{"prompt_len": 5, "output_len": 1, "acceptance": [1]}]), "num_speculative_tokens"),
        (minimal(num_gpu_blocks=4, kv_cache_tokens=64), "not both"),
    ]:
        with pytest.raises(ScenarioError) as exc:
            scenario_from_dict(data, source=SRC)
        assert str(exc.value).startswith(f"{SRC}: ") and text in str(exc.value), str(exc.value)


def test_scenario_level_errors_reported_with_the_others():
    data = minimal(num_gpu_blocks=0)
    data["requests"].append({"prompt_len": "x", "output_len": 1})
    paths = dict(problems(data))
    assert "num_gpu_blocks" in paths and "requests[1].prompt_len" in paths


def test_config_bool_must_be_a_bool():
    found = dict(problems(minimal(config={"enable_prefix_caching": "no"})))
    assert "config.enable_prefix_caching" in found


def test_request_count_rejects_bool():
    found = dict(problems(minimal(requests=[{"prompt_len": 1, "output_len": 1, "count": True}])))
    assert "requests[0].count" in found


# ----------------------------------------------------------------------------- {i} stamping


def test_layer_stamping_range_and_list():
    data = minimal(
        layers=[
            {"name": "m.{i}.attn", "layers": "0-3", "kind": "mla", "block_size": 16, "head_size": 64},
            {
                "name": "m.{i}.swa",
                "layers": [2, 7],
                "kind": "sliding_window",
                "block_size": 16,
                "num_kv_heads": 1,
                "head_size": 8,
                "sliding_window": 8,
                "dcp_replicated": True,
            },
            {"name": "solo", "kind": "ring", "block_size": 8, "num_kv_heads": 1, "head_size": 8, "dcp_replicated": True},
        ]
    )
    sc = scenario_from_dict(data, source=SRC)
    assert list(sc.layers) == ["m.0.attn", "m.1.attn", "m.2.attn", "m.3.attn", "m.2.swa", "m.7.swa", "solo"]
    assert sc.layers["m.0.attn"] is sc.layers["m.3.attn"]


@pytest.mark.parametrize(
    "layers,path,text",
    [
        ("3-1", "layers[0].layers", "range"),
        ("a-b", "layers[0].layers", "range"),
        ("7", "layers[0].layers", "range"),
        ([1, "2"], "layers[0].layers", "list of layer numbers"),
    ],
)
def test_layer_stamping_errors(layers, path, text):
    data = minimal(layers=[{"name": "x.{i}", "layers": layers, "kind": "mla", "block_size": 16, "head_size": 64}])
    found = dict(problems(data))
    assert path in found and text in found[path], found


def test_layer_stamping_needs_placeholder_and_unique_names():
    found = dict(problems(minimal(layers=[{"name": "x", "layers": "0-1", "kind": "mla", "block_size": 16, "head_size": 64}])))
    assert "{i}" in found["layers[0].name"]
    spec = {"kind": "mla", "block_size": 16, "head_size": 64}
    found = dict(problems(minimal(layers=[{"name": "x.{i}", "layers": "0-2", **spec}, {"name": "x.1", **spec}])))
    assert "defined twice" in found["layers[1].name"] and "'x.1'" in found["layers[1].name"]


def test_request_stamping():
    data = minimal(
        requests=[
            {"id": "chat-{i}", "count": 3, "prompt_len": 10, "output_len": 2, "arrival_step": 4},
            {"count": 2, "prompt_len": 5, "output_len": 1},
            {"prompt_len": 5, "output_len": 1},
        ]
    )
    sc = scenario_from_dict(data, source=SRC)
    assert [r.request_id for r in sc.requests] == ["chat-0", "chat-1", "chat-2", "req1-0", "req1-1", "req2"]
    assert all(r.arrival_step == 4 for r in sc.requests[:3])
    found = dict(problems(minimal(requests=[{"id": "same", "count": 2, "prompt_len": 1, "output_len": 1}])))
    assert "{i}" in found["requests[0].id"]


# ----------------------------------------------------------------------------- overrides


@pytest.mark.parametrize("B", [16, 32, 128])
def test_with_overrides_block_size(B):
    sc = load_scenario("dsv41-hybrid")
    o = sc.with_overrides(ScenarioOverrides(block_size=B))
    for name, spec in o.layers.items():
        old = sc.layers[name]
        if isinstance(old, CircularBufferSpec):
            assert spec == old and spec.block_size == 8  # ring capacity is the model's
        elif old.tokens_per_state == 2:  # main/index caches of layers 2, 8, 14: B * R tokens
            assert spec.block_size == 2 * B
        else:
            assert spec.block_size == B
        assert type(spec) is type(old)
        assert dataclasses_equal_except_block_size(spec, old)
    assert sc.layers["model.layers.2.attn.main_cache"].block_size == 128  # the original is untouched
    geometries(o.with_overrides(ScenarioOverrides(decode_context_parallel_size=2, cp_kv_cache_interleave_size=min(B, 16))))


def dataclasses_equal_except_block_size(a, b):
    import dataclasses

    return dataclasses.replace(a, block_size=b.block_size) == b


def test_with_overrides_config_fields():
    sc = load_scenario("dsv3")
    o = sc.with_overrides(
        ScenarioOverrides(decode_context_parallel_size=4, cp_kv_cache_interleave_size=8, kernel_block_size=16, seed=5, verify_every=3)
    )
    assert (
        o.config.decode_context_parallel_size,
        o.config.cp_kv_cache_interleave_size,
        o.config.kernel_block_size,
        o.seed,
        o.verify_every,
    ) == (4, 8, 16, 5, 3)
    assert o.config.max_model_len == sc.config.max_model_len and o.requests == sc.requests
    assert sc.config.decode_context_parallel_size == 2  # frozen: the original is unchanged
    with pytest.raises(ConfigError):
        sc.with_overrides(ScenarioOverrides(decode_context_parallel_size=0))
    with pytest.raises(ConfigError):
        sc.with_overrides(ScenarioOverrides(verify_every=0))


# ----------------------------------------------------------------------------- known crashes

LAYER = {"name": "l", "kind": "mla", "block_size": 16, "head_size": 64}

CRASHES = [
    pytest.param(minimal(layers=[{**LAYER, "kind": ["mla"]}]), id="kind-is-a-list: TypeError unhashable in `kind not in SPEC_KINDS`"),
    pytest.param(minimal(layers=[{**LAYER, "kind": {"a": 1}}]), id="kind-is-a-table: TypeError unhashable in `kind not in SPEC_KINDS`"),
    pytest.param(
        minimal(layers=[{**LAYER, "dtype": ["fp8"]}]),
        id="dtype-is-a-list: TypeError unhashable in AttentionSpec `dtype not in DTYPE_BYTES`",
    ),
    pytest.param(
        minimal(layers=[{**LAYER, "name": "l{i}", "layers": "\u00b2-3"}]),
        id="superscript-digit-range: str.isdigit accepts it, int() raises ValueError",
    ),
    pytest.param(
        minimal(layers=[{**LAYER, "name": "l{i}", "layers": "1" * 4301 + "-" + "2" * 4301}]),
        id="range-over-4300-digits: int() raises ValueError (int_max_str_digits)",
    ),
]


@pytest.mark.parametrize("data", CRASHES)
def test_known_crash_inputs(data):
    with pytest.raises(ConfigError) as exc:
        scenario_from_dict(data, source=SRC)
    assert str(exc.value).startswith(f"{SRC}: layers[0]")


def test_huge_count_is_rejected_promptly():
    """A count of 10**12 is refused without expanding it: bounded by the CPU time of the call
    (not wall time, which a loaded machine stretches), with an alarm in case it never returns."""
    data = {
        "layers": [{"name": "l", "kind": "mla", "block_size": 16, "head_size": 64}],
        "requests": [{"prompt_len": 1, "output_len": 1, "count": 10**12}],
    }

    def hung(signum, frame):
        raise TimeoutError("scenario_from_dict still running after 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        cpu = time.process_time()
        with pytest.raises(ConfigError):
            scenario_from_dict(data, source="f.toml")
        cpu = time.process_time() - cpu
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert cpu < 0.5, f"scenario_from_dict took {cpu:.2f} s of CPU to refuse a count of 10**12"


# ----------------------------------------------------------------------------- fuzz


small_ints = st.one_of(st.integers(-3, 70), st.sampled_from([0, 1, 2**31, -(2**63), 2**64]))
toml_scalars = st.one_of(
    st.booleans(),
    small_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["mla", "ring", "fp8", "1/2", "3/2", "0-3", "2-1", "{i}", "x.{i}", "16", "", "-"]),
    st.dates(min_value=datetime.date(1970, 1, 1), max_value=datetime.date(2100, 1, 1)),
)
toml_values = st.recursive(
    toml_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6,
)
_COUNT_VALUES = st.one_of(st.integers(-2, 4), st.booleans(), st.floats(), st.text(max_size=3), st.lists(small_ints, max_size=2))
_LAYERS_VALUES = st.one_of(st.text(alphabet="0123456789- x", max_size=5), st.lists(small_ints, max_size=4), toml_values)


def _field_values(key):
    if key == "count":  # an unbounded count hangs the loader (pinned above), keep it small
        return _COUNT_VALUES
    if key == "layers":
        return _LAYERS_VALUES
    return toml_values


LAYER_KEYS = sorted(
    {
        "name",
        "kind",
        "layers",
        "names",
        "block_size",
        "head_size",
        "num_kv_heads",
        "dtype",
        "head_size_v",
        "page_size_padded",
        "num_head_slots",
        "state_content_bytes",
        "tokens_per_state",
        "dcp_replicated",
        "sliding_window",
        "extra_retained_tokens",
        "attention_chunk_size",
        "cache_dtype_str",
        "blok_size",
    }
)
REQ_KEYS = [
    "id",
    "count",
    "prompt_len",
    "output_len",
    "arrival_step",
    "prefix",
    "shared_prefix_len",
    "acceptance",
    "preempt_at_steps",
    "promt_len",
]
CFG_KEYS = [
    "max_model_len",
    "max_num_batched_tokens",
    "decode_context_parallel_size",
    "cp_kv_cache_interleave_size",
    "num_speculative_tokens",
    "kernel_block_size",
    "max_num_seqs",
    "enable_prefix_caching",
    "max_model_lenn",
]
TOP = ["name", "description", "seed", "verify_every", "num_gpu_blocks", "kv_cache_tokens", "max_steps", "aliases", "verfy_every"]


def _table(keys, base):
    """A table that starts from a valid one, with some keys replaced by random values or dropped."""

    @st.composite
    def build(draw):
        out = dict(base)
        for key in draw(st.lists(st.sampled_from(keys), max_size=4, unique=True)):
            if draw(st.integers(0, 4)) == 0:
                out.pop(key, None)
            else:
                out[key] = draw(_field_values(key))
        return out

    return build()


layer_tables = st.one_of(
    _table(LAYER_KEYS, {"name": "m.{i}", "layers": "0-2", "kind": "mla", "block_size": 16, "head_size": 64}),
    _table(
        LAYER_KEYS,
        {
            "name": "s",
            "kind": "sliding_window",
            "block_size": 16,
            "head_size": 8,
            "num_kv_heads": 1,
            "sliding_window": 8,
            "dcp_replicated": True,
        },
    ),
    _table(LAYER_KEYS, {"name": "r", "kind": "ring", "block_size": 8, "num_kv_heads": 1, "head_size": 8, "tokens_per_state": "1/2"}),
    toml_values,
)
request_tables = st.one_of(
    _table(
        REQ_KEYS,
        {"id": "r-{i}", "count": 2, "prompt_len": 10, "output_len": 3, "prefix": "p", "shared_prefix_len": 4, "acceptance": [0, 1]},
    ),
    toml_values,
)


@st.composite
def scenario_dicts(draw):
    data = {}
    if draw(st.booleans()):
        data["config"] = draw(st.one_of(_table(CFG_KEYS, {"num_speculative_tokens": 1}), toml_values))
    data["layers"] = draw(st.one_of(st.lists(layer_tables, max_size=3), toml_values))
    data["requests"] = draw(st.one_of(st.lists(request_tables, max_size=3), toml_values))
    for key in draw(st.lists(st.sampled_from(TOP), max_size=3, unique=True)):
        data[key] = draw(toml_values)
    if draw(st.integers(0, 5)) == 0:  # a fully random top-level table now and then
        data = draw(
            st.dictionaries(
                st.one_of(st.sampled_from(TOP + ["layers", "requests", "config"]), st.text(max_size=6)), toml_values, max_size=5
            )
        )
    return data


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario_dicts())
def test_fuzz_only_scenario_or_config_errors(data):
    try:
        sc = scenario_from_dict(data, source=SRC)
    except (ScenarioError, ConfigError) as exc:
        event("rejected")
        # (not line by line: a quoted TOML key may itself contain a line break)
        assert str(exc).startswith(f"{SRC}: "), str(exc)
        return
    event("loaded")
    assert sc.layers is not None and sc.requests


# ----------------------------------------------------------------------------- upstream's dcp_sharded


def _one_layer(**flags):
    return minimal(layers=[{"name": "l", "kind": "full_attention", "block_size": 16, "num_kv_heads": 1, "head_size": 64, **flags}])


@pytest.mark.parametrize(
    "flags, replicated",
    [
        ({}, False),
        ({"dcp_sharded": True}, False),
        ({"dcp_sharded": False}, True),
        ({"dcp_replicated": True}, True),
        ({"dcp_sharded": False, "dcp_replicated": True}, True),  # both given, and they agree
        ({"dcp_sharded": True, "dcp_replicated": False}, False),
    ],
)
def test_upstream_dcp_sharded_is_the_inverse_of_dcp_replicated(flags, replicated):
    s = scenario_from_dict(_one_layer(**flags), source=SRC)
    assert s.layers["l"].dcp_replicated is replicated


@pytest.mark.parametrize("flags", [{"dcp_sharded": True, "dcp_replicated": True}, {"dcp_sharded": False, "dcp_replicated": False}])
def test_contradictory_dcp_flags_name_the_layer(flags):
    [(path, msg)] = problems(_one_layer(**flags))
    assert path == "layers[0].dcp_sharded"
    assert "contradicts dcp_replicated" in msg


def test_dcp_sharded_must_be_a_bool():
    [(path, msg)] = problems(_one_layer(dcp_sharded="yes"))
    assert (path, msg) == ("layers[0].dcp_sharded", "must be true or false, got 'yes'")


def test_alignment_and_page_size_padded_together_are_refused():
    data = minimal(layers=[{"name": "l", "kind": "mla", "block_size": 16, "head_size": 64, "alignment": 576, "page_size_padded": 1 << 20}])
    [(path, msg)] = problems(data)
    assert path == "layers[0].page_size_padded" and "give one of the two" in msg
