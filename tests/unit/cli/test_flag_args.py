"""``flag_args`` renders an option tree's value as the flags that rebuild it: parsed back
by the flags ``add_flags`` generates, it is the same value (fuzz's rerun line uses it)."""

from __future__ import annotations

import argparse

from dcpsim.cli.flags import add_flags, flag_args, options_from
from dcpsim.model.attention_config import AttentionConfig
from dcpsim.verify.options import CheckOptions


def _round_trip(tree, value):
    parser = argparse.ArgumentParser()
    add_flags(parser, tree)
    return options_from(tree, parser.parse_args(flag_args(value)))


def test_defaults_render_as_no_flags_and_values_round_trip():
    assert flag_args(AttentionConfig()) == []
    value = AttentionConfig(enabled=True, lse_base="2", merge="alltoall", heads=4)
    assert flag_args(value) == ["--attention", "--lse-base", "2", "--attention-merge", "alltoall", "--attention-heads", "4"]
    assert _round_trip(AttentionConfig, value) == value
    check = CheckOptions(mode="full", paranoid=True)
    assert _round_trip(CheckOptions, check) == check
