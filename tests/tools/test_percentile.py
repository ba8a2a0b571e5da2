"""The one percentile: nearest rank on the 0-100 scale, every answer a measured value."""

from __future__ import annotations

import math
import random

import pytest

from prefix_sidecar_tools.percentile import percentile


def test_nearest_rank_on_the_0_100_scale() -> None:
    values = [15.0, 20.0, 35.0, 40.0, 50.0]  # the textbook example
    assert percentile(values, 5) == 15.0
    assert percentile(values, 30) == 20.0
    assert percentile(values, 40) == 20.0
    assert percentile(values, 50) == 35.0
    assert percentile(values, 100) == 50.0


def test_every_answer_is_a_measured_value_and_order_does_not_matter() -> None:
    rng = random.Random(7)
    values = [rng.uniform(0, 1000) for _ in range(101)]
    shuffled = random.Random(8).sample(values, len(values))
    for q in (1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) in values
        assert percentile(values, q) == percentile(shuffled, q)
    assert percentile(values, 50) == sorted(values)[50]  # the median of 101
    assert percentile(values, 100) == max(values)


def test_small_samples() -> None:
    assert percentile([3.0], 1) == 3.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.0  # no blend of the two
    assert percentile([1.0, 2.0], 99) == 2.0
    assert percentile(iter([2.0, 1.0]), 99) == 2.0  # any iterable


def test_no_values_is_nan() -> None:
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("q", [0, -1, 100.5])
def test_q_outside_0_100_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="0-100"):
        percentile([1.0], q)
