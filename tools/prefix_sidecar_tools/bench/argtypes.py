"""argparse types the benches share: a flag's value checked where it is parsed.

argparse puts the flag before a type's message ("argument --pods: must be > 0, got 0"), so
the messages do not name it.
"""

from __future__ import annotations

import argparse
import math
from typing import TypeVar

Number = TypeVar("Number", int, float)


def positive_int(text: str) -> int:
    """A whole number > 0."""
    value = _number(int, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(float, text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0."""
    value = _number(float, text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def whole_numbers(text: str) -> list[int]:
    """Comma-separated integers, e.g. "1,4"."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"wants comma-separated whole numbers, got {text!r}"
        ) from None


def _number(kind: type[Number], text: str) -> Number:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a number, got {text!r}") from None
