"""What a sidecar holds before it serves: the prefixes registered at start, and whether a
joining pod is warmed with its prefixes before it takes traffic."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefix_sidecar.config.checks import ConfigError, as_list, fail
from prefix_sidecar.fields import setting


@dataclass(frozen=True)
class PrefixSpec:
    """A prefix loaded at start: a name and the file holding its text."""

    name: str
    file: str
    replicas: int = 0


def parse_prefix_flag(text: str) -> PrefixSpec:
    """`NAME=FILE[:REPLICAS]` from --prefix."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(f"--prefix {text!r} must look like NAME=FILE[:REPLICAS]")
    path, colon, replicas = rest.rpartition(":")
    if colon and replicas.isdigit() and path:
        return PrefixSpec(name=name, file=path, replicas=int(replicas))
    return PrefixSpec(name=name, file=rest)


def _prefixes(name: str, value: Any) -> tuple[PrefixSpec, ...]:
    return tuple(_prefix_spec(i, item) for i, item in enumerate(as_list(name, value)))


def _prefix_spec(index: int, item: Any) -> PrefixSpec:
    where = f"config field 'prefixes'[{index}]"
    if isinstance(item, str):
        return parse_prefix_flag(item)
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where} must be a mapping with name and file, got {item!r}")
    unknown = set(item) - {"name", "file", "replicas"}
    if unknown:
        raise ConfigError(f"{where} has unknown keys {sorted(unknown)}; use name, file, replicas")
    name, path, replicas = item.get("name"), item.get("file"), item.get("replicas", 0)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name must be a non-empty string")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}.file must be a path to the prefix text")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ConfigError(f"{where}.replicas must be an integer >= 0, got {replicas!r}")
    return PrefixSpec(name=name, file=path, replicas=replicas)


@dataclass(frozen=True)
class StartupSettings:
    """The prefixes of the start and the warming of joiners."""

    warm_before_serve: bool = setting(True, "warm a joining pod's prefixes before it takes traffic")
    prefixes: tuple[PrefixSpec, ...] = setting(
        (),
        "prefixes registered (and warmed) at start: NAME=FILE[:REPLICAS] or {name, file, replicas}",
        flag="--prefix",
        metavar="NAME=FILE[:REPLICAS]",
        repeat=True,
        parse=_prefixes,
    )


def check_prefixes(config: StartupSettings) -> None:
    names = [p.name for p in config.prefixes]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise fail("prefixes", f"has duplicate names {sorted(duplicates)}")
