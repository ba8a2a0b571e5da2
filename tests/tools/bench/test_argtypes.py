"""The benches' argparse types: a bad value is refused where it is parsed, under its flag."""

from __future__ import annotations

import argparse

import pytest

from prefix_sidecar_tools.bench.argtypes import (
    non_negative,
    positive_float,
    positive_int,
    whole_numbers,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench", exit_on_error=False)
    parser.add_argument("--pods", type=positive_int)
    parser.add_argument("--rate", type=positive_float)
    parser.add_argument("--warmup", type=non_negative)
    parser.add_argument("--seeds", type=whole_numbers)
    return parser


def test_good_values_parse() -> None:
    args = _parser().parse_args(["--pods", "3", "--rate", "0.5", "--warmup", "0", "--seeds", "1,4"])
    assert (args.pods, args.rate, args.warmup, args.seeds) == (3, 0.5, 0.0, [1, 4])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pods", "0"], "argument --pods: must be > 0, got 0"),
        (["--pods", "1.5"], "argument --pods: wants a number, got '1.5'"),
        (["--rate", "-1"], "argument --rate: must be > 0, got -1"),
        (["--rate", "inf"], "argument --rate: must be > 0, got inf"),
        (["--rate", "nan"], "argument --rate: must be > 0, got nan"),
        (["--warmup", "-0.1"], "argument --warmup: must be >= 0, got -0.1"),
        (["--warmup", "x"], "argument --warmup: wants a number, got 'x'"),
        (["--seeds", "1,,2"], "argument --seeds: wants comma-separated whole numbers, got '1,,2'"),
    ],
)
def test_bad_values_are_refused_under_their_flag(argv: list[str], message: str) -> None:
    with pytest.raises(argparse.ArgumentError) as info:
        _parser().parse_args(argv)
    assert str(info.value) == message
