"""Fixtures for the routing unit tests: both routing cores, and a pool, store and router
built in memory (no sockets, no event loop)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import pytest

from sidecar.config import build_config
from sidecar.membership.pool import BackendPool
from sidecar.membership.sources import Member
from sidecar.prefixes import PrefixStore
from sidecar.routing.policy import make_policy
from sidecar.routing.router import Router

NO_EXTENSIONS = bool(os.environ.get("SIDECAR_NO_EXTENSIONS"))


@pytest.fixture(scope="session", params=["c", "py"])
def core(request: pytest.FixtureRequest) -> ModuleType:
    """One routing core, as in tests/core: the extension ("c", imported directly so a failed
    build fails loudly) or the pure-Python twin ("py")."""
    if request.param == "c":
        if NO_EXTENSIONS:
            pytest.skip("SIDECAR_NO_EXTENSIONS is set: the extension is not under test")
        return importlib.import_module("sidecar._core_c")
    return importlib.import_module("sidecar._core_py")


def pods(count: int) -> list[str]:
    return [f"http://10.0.0.{i}:8000" for i in range(1, count + 1)]


def serving_pool(urls: list[str], *, warm_before_serve: bool = False) -> BackendPool:
    """A pool whose pods are all healthy and serving (`warm_before_serve` off: no prewarm)."""
    pool = BackendPool(warm_before_serve=warm_before_serve)
    pool.set_members([Member(url, 1) for url in urls])
    for url in urls:
        pool.set_health(url, True)
    return pool


MakeRouter = Callable[..., Router]


@pytest.fixture
def make_router() -> MakeRouter:
    """Router(pool, store, policy) with the config's settings, any of them overridden."""

    def make(pool: BackendPool, store: PrefixStore, **overrides: object) -> Router:
        config = build_config(overrides)
        return Router(
            pool,
            store,
            make_policy(config.policy, config),
            route_window_bytes=config.route_window_bytes,
            default_replicas=config.replicas,
            max_attempts=config.max_attempts,
            home_kv_budget_tokens=config.home_kv_budget_tokens,
            home_balance_factor=config.home_balance_factor,
            bytes_per_token=config.bytes_per_token,
        )

    return make
