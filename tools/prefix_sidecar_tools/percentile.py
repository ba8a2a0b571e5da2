"""The one percentile every bench, the demo and the tests report.

Nearest rank, q on the 0-100 scale: the smallest measured value with at least q % of the
values at or below it. No interpolation, so every reported figure is a value that was
measured (a p99 of two timings is the slower one, not a blend of both).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 < q <= 100) of `values` by nearest rank; nan for no values."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile q is on the 0-100 scale, got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
