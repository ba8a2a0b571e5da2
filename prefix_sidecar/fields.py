"""One table per config: each dataclass field declares its default, help, flag and check.

`setting()` stores that declaration in the field's metadata, so the dataclass is the table:
defaults, YAML/env/flag coercion, validation, argparse flags, the docs table and the tooling's
child-process argv (prefix_sidecar_tools/emulator/config.py) all read it and cannot drift.
Used by the sidecar's Config (prefix_sidecar/config/) and the emulator's pod model.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

_KEY = "prefix_sidecar.fields"

Check = Callable[[Any], "str | None"]
"""Why a parsed value is bad ("must be >= 1, got 0"), or None when it is fine."""
Parse = Callable[[str, Any], Any]
"""(field name, raw value) -> the field's value; raises FieldError naming the field."""


class FieldError(ValueError):
    """A value that cannot be used for a field; the message names the field."""


@dataclass(frozen=True)
class Spec:
    """What the table knows about one field besides its name and default."""

    help: str
    flag: str | None = None  # its own command-line flag; None: file, env or --set only
    metavar: str | None = None
    repeat: bool = False  # a list field whose flag may be given several times
    kind: type | None = None  # the scalar type, when the default (None) does not tell
    parse: Parse | None = None  # for values that are not a plain bool/int/float/str
    check: Check | None = None


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    repeat: bool = False,
    kind: type | None = None,
    parse: Parse | None = None,
    check: Check | None = None,
) -> Any:
    """A dataclass field with its table entry; the default must be immutable."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("a setting's default must be immutable (use a tuple)")
    spec = Spec(help, flag, metavar, repeat, kind, parse, check)
    return dataclasses.field(default=default, metadata={_KEY: spec})


@dataclass(frozen=True)
class Entry:
    """One row of a table: the field's name, default and spec."""

    name: str
    default: Any
    spec: Spec

    @property
    def kind(self) -> type:
        return self.spec.kind or type(self.default)


def table(cls: type) -> dict[str, Entry]:
    """The table of a dataclass declared with `setting()`, in declaration order."""
    entries = {}
    for item in dataclasses.fields(cls):
        spec = item.metadata.get(_KEY)
        if spec is not None:
            entries[item.name] = Entry(item.name, item.default, spec)
    return entries


# --- values -----------------------------------------------------------------------------


def coerce(entry: Entry, value: Any) -> Any:
    """Turn a YAML/env/flag value into the field's type, or raise FieldError naming it."""
    if entry.spec.parse is not None:
        return entry.spec.parse(entry.name, value)
    return coerce_scalar(entry.name, value, entry.kind)


def coerce_scalar(name: str, value: Any, kind: type) -> Any:
    where = f"config field {name!r}"
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise FieldError(f"{where} must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise FieldError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise FieldError(f"{where} must be an integer, got {value!r}") from None
    if kind is float:
        if isinstance(value, bool):
            raise FieldError(f"{where} must be a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise FieldError(f"{where} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise FieldError(f"{where} must be a finite number, got {value!r}")
        return number
    if kind is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise FieldError(f"{where} must be a string, got {value!r}")
        return str(value)
    raise FieldError(f"{where} has an unsupported type {kind.__name__}")  # pragma: no cover


def validate(config: Any, describe: Callable[[str, str], str]) -> None:
    """Run every field's check; the first failure raises FieldError(describe(name, reason))."""
    for entry in table(type(config)).values():
        if entry.spec.check is not None:
            reason = entry.spec.check(getattr(config, entry.name))
            if reason is not None:
                raise FieldError(describe(entry.name, reason))


# --- checks (each returns why a value is bad, or None) ------------------------------------


def at_least(low: float, note: str = "") -> Check:
    """`value >= low`; `note` explains a special value, e.g. " (0 = off)"."""
    return lambda value: None if value >= low else f"must be >= {low}{note}, got {value}"


def above(low: float) -> Check:
    return lambda value: None if value > low else f"must be > {low}, got {value}"


def one_of(choices: Iterable[str]) -> Check:
    allowed = tuple(choices)
    return lambda value: (
        None if value in allowed else f"must be one of {', '.join(allowed)}, got {value!r}"
    )


# --- command line -----------------------------------------------------------------------


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *, typed: bool
) -> None:
    """Add a flag for every field that has one.

    typed=True lets argparse convert values (its error names the flag); typed=False passes
    the text on, for `coerce` and the checks to judge and name the field.
    """
    for entry in table(cls).values():
        spec = entry.spec
        if spec.flag is None:
            continue
        shown = "" if entry.default in ("", None, (), False) else f" ({entry.default})"
        options: dict[str, Any] = {"dest": entry.name, "default": None, "help": spec.help + shown}
        if spec.repeat:
            options.update(action="append", help=options["help"] + " (repeatable)")
        elif entry.kind is bool:
            options.update(action="store_const", const=True)
        elif typed:
            options["type"] = entry.kind
        if spec.metavar and options.get("action") != "store_const":
            options["metavar"] = spec.metavar
        parser.add_argument(spec.flag, **options)


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields whose flags were given on the command line."""
    values = {}
    for name in table(cls):
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    return values
