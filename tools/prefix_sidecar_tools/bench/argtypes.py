"""argparse types the benches share: a flag's value checked where it is parsed, its error
naming the flag."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


def positive(kind: type, name: str) -> Callable[[str], Any]:
    """`kind(text)`, finite and > 0."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} wants a number, got {text!r}") from None
        if value <= 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value

    return parse


def non_negative(name: str) -> Callable[[str], float]:
    """A finite float >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} wants a number, got {text!r}") from None
        if not 0 <= value < math.inf:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {text}")
        return value

    return parse


def whole_numbers(name: str) -> Callable[[str], list[int]]:
    """Comma-separated integers, e.g. "1,4"."""

    def parse(text: str) -> list[int]:
        try:
            return [int(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} wants comma-separated whole numbers, got {text!r}"
            ) from None

    return parse
