"""Fixtures for the routing unit tests: both routing cores, and a pool, store and router
built in memory (no sockets, no event loop)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from prefix_sidecar.config import FIELDS, build_config
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import Member
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.routing.policy import make_policy
from prefix_sidecar.routing.prefix_affinity import PrefixAffinity
from prefix_sidecar.routing.router import DEFAULT_POLICY, Router
from prefix_sidecar.routing.router_settings import RouterSettings, settings

# The Router's own settings that are no config field (the routing modules' constants).
SETTINGS = set(RouterSettings.__annotations__) - set(FIELDS)

NO_EXTENSIONS = bool(os.environ.get("SIDECAR_NO_EXTENSIONS"))


@pytest.fixture(scope="session", params=["c", "py"])
def core(request: pytest.FixtureRequest) -> ModuleType:
    """One routing core, as in tests/core: the extension ("c", imported directly so a failed
    build fails loudly) or the pure-Python twin ("py")."""
    if request.param == "c":
        if NO_EXTENSIONS:
            pytest.skip("SIDECAR_NO_EXTENSIONS is set: the extension is not under test")
        return importlib.import_module("prefix_sidecar._core_c")
    return importlib.import_module("prefix_sidecar._core_py")


def pods(count: int) -> list[str]:
    return [f"http://10.0.0.{i}:8000" for i in range(1, count + 1)]


def serving_pool(
    urls: list[str],
    *,
    warm_before_serve: bool = False,
    hash_table: str = "ring",
    load_unit: str = "requests",
) -> BackendPool:
    """A pool whose pods are all healthy and serving (`warm_before_serve` off: no prewarm).
    Its loads count requests, as the routing contract's picks these tests compare with."""
    pool = BackendPool(
        warm_before_serve=warm_before_serve, hash_table=hash_table, load_unit=load_unit
    )
    pool.set_members([Member(url, 1) for url in urls])
    for url in urls:
        pool.set_health(url, True)
    return pool


MakeRouter = Callable[..., Router]


@pytest.fixture
def make_router() -> MakeRouter:
    """The sidecar's router for this pool and store: the config's settings and the routing
    constants, any overridden: a config field by its name, one of the Router's own settings
    (`organic_home_spread`, `route_window_bytes`, ...) by its keyword, `policy` by name,
    `cap_floor` (the cap's floor in thin requests, REQUEST_CAP_FLOOR)."""

    def make(pool: BackendPool, store: PrefixStore, **overrides: Any) -> Router:
        policy = overrides.pop("policy", DEFAULT_POLICY)
        floor = overrides.pop("cap_floor", None)  # the cap's floor in thin requests
        overrides.setdefault("load_unit", pool.load_unit)
        own = {name: overrides.pop(name) for name in list(overrides) if name in SETTINGS}
        config = build_config(overrides)
        picker = make_policy(policy, config)
        if floor is not None:
            picker = PrefixAffinity(config.load_factor, config.load_unit, floor)
        return Router(pool, store, picker, **{**settings(config), **own})

    return make
