"""Pools: several models, each on its own vLLM deployment, behind one sidecar.

A pool is one model's pods: its model names (aliases included), its membership keys (those
of membership.py) and optionally its own start prefixes; the rest comes from the top level,
which then names no pods. Each pool has its own ring, store, health, load signals and prewarm
(server/model_pool.py); keys do not depend on the pool (routing contract section 10), so a
pool routes as a sidecar with it alone would. Without `pools`, the top level is the one pool
and takes any model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from prefix_sidecar import fields
from prefix_sidecar.config.checks import ConfigError, as_list, fail
from prefix_sidecar.config.membership import MembershipSettings
from prefix_sidecar.config.startup import StartupSettings
from prefix_sidecar.fields import setting

POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a metric label: short, plain
MAX_MODEL_NAME_CHARS = 256
MAX_POOLS = 64
DEFAULT_POOL = "default"  # the one pool of a config without `pools`
# What a pool entry may set besides its name and models.
_POOL_FIELDS = {
    **fields.table(MembershipSettings),
    "prefixes": fields.table(StartupSettings)["prefixes"],
}
_SOURCES = ("backends", "backends_file", "backends_dns")


@dataclass(frozen=True)
class PoolSpec:
    """One configured pool: its name, its model names (the first is sent to the pods when a
    request names none) and the keys it sets, as (field, value) pairs already coerced."""

    name: str
    models: tuple[str, ...]
    settings: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> dict[str, Any]:
        """The pool as plain data, for `serve --print-config`."""
        return {"name": self.name, "models": list(self.models), **dict(self.settings)}


def _pools(name: str, value: Any) -> tuple[PoolSpec, ...]:
    if isinstance(value, str):  # an env var or --set holds the YAML text of the list
        try:
            value = yaml.safe_load(value) if value.strip() else []
        except yaml.YAMLError as exc:
            raise fail(name, f"must be a YAML list of pools: {exc}") from None
    items = as_list(name, value)
    if len(items) > MAX_POOLS:
        raise fail(name, f"has {len(items)} pools; at most {MAX_POOLS}")
    return tuple(_pool(index, item) for index, item in enumerate(items))


def _pool(index: int, item: Any) -> PoolSpec:
    where = f"config field 'pools'[{index}]"
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where} must be a mapping with name, models and backends")
    unknown = sorted(str(key) for key in item if key not in ("name", "models", *_POOL_FIELDS))
    if unknown:
        raise ConfigError(
            f"{where} has unknown keys {unknown}; a pool takes name, models and "
            f"{', '.join(_POOL_FIELDS)}"
        )
    name = item.get("name")
    if not isinstance(name, str) or not POOL_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r:.80}"
        )
    where = f"config field 'pools'[{index}] ({name})"
    models = item.get("models")
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, (list, tuple)) or not models:
        raise ConfigError(f"{where}.models must be a non-empty list of model names")
    for model in models:
        if not isinstance(model, str) or not model or len(model) > MAX_MODEL_NAME_CHARS:
            raise ConfigError(
                f"{where}.models must hold names of 1-{MAX_MODEL_NAME_CHARS} characters, "
                f"got {model!r:.80}"
            )
    settings = []
    for key, raw in item.items():
        if key in _POOL_FIELDS:
            try:
                settings.append((key, fields.coerce(_POOL_FIELDS[key], raw)))
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
    return PoolSpec(name, tuple(models), tuple(settings))


@dataclass(frozen=True)
class PoolSettings:
    """Several models behind one sidecar."""

    pools: tuple[PoolSpec, ...] = setting(
        (),
        "one entry per model's pods: {name, models, backends or backends_file or backends_dns, "
        "...}; a request's model picks its pool; empty = the top-level backends are the one "
        "pool, for any model",
        parse=_pools,
    )


def check_pools(config: Any) -> None:
    """The rules across pools; each pool's own values were checked as its entry was read,
    and again as its config (`pool_configs`) is validated."""
    pools: tuple[PoolSpec, ...] = config.pools
    if not pools:
        return
    given = [key for key in _SOURCES if getattr(config, key)]
    if given:
        raise fail(
            given[0], "is set at the top level, but pools is set too: give each pool its backends"
        )
    names = [pool.name for pool in pools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise fail("pools", f"has duplicate pool names {twice}")
    owner: dict[str, str] = {}
    for pool in pools:
        for model in pool.models:
            if model in owner:
                raise fail(
                    "pools", f"names model {model!r} in pools {owner[model]!r} and {pool.name!r}"
                )
            owner[model] = pool.name
        keys = dict(pool.settings)
        if not any(keys.get(key) for key in _SOURCES):
            raise fail(
                "pools", f"pool {pool.name!r} names no pods: give it {' or '.join(_SOURCES)}"
            )


def pool_configs(config: Any) -> list[tuple[PoolSpec, Any]]:
    """Each pool with the config its parts are built from: the top level, with the pool's
    own keys, its first model as `model`, and no `pools`. Without pools, the one pool
    `DEFAULT_POOL` and the config itself (models: `model`, if set)."""
    if not config.pools:
        models = (config.model,) if config.model else ()
        return [(PoolSpec(DEFAULT_POOL, models), config)]
    return [
        (pool, dataclasses.replace(config, pools=(), model=pool.models[0], **dict(pool.settings)))
        for pool in config.pools
    ]
