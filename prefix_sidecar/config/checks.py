"""The checks and parsers that several groups of config fields share.

A check returns why a value is bad ("must be HOST:PORT: ...") or None; a parser turns a YAML,
env or flag value into the field's type or raises ConfigError naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefix_sidecar.fields import FieldError
from prefix_sidecar.hostport import split_host_port

ConfigError = FieldError  # the name callers catch: a value that cannot be used, field named


def fail(name: str, reason: str) -> ConfigError:
    """The error of a field whose value cannot be used, naming it."""
    return ConfigError(f"config field {name!r} {reason}")


def as_list(name: str, value: Any) -> list[Any]:
    """A list field's value: a list, or comma-separated text (an env var); None is empty."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config field {name!r} must be a list, got {type(value).__name__}")
    return list(value)


def host_and_port(value: str) -> str | None:
    if not value:
        return None
    try:
        split_host_port(value)
    except ValueError as exc:
        return f"must be HOST:PORT: {exc}"
    return None


def existing_file(path: str) -> str | None:
    return None if not path or Path(path).is_file() else f"names a file that does not exist: {path}"


def absolute_path(value: str) -> str | None:
    return None if value.startswith("/") else f"must start with '/', got {value!r}"
