"""The Router's settings: the config's routing fields, and the routing modules' constants.

Every setting of the Router is required, so each has one default: the config's or the
constant's. `settings(config)` reads the constants when called (a test may patch one).
"""

from __future__ import annotations

from typing import TypedDict

from prefix_sidecar.config import Config
from prefix_sidecar.routing import anchors, organic, placement

# Routing contract v1's window W: an unregistered prompt routes on key(its first W bytes)
# with `unregistered_routing: window`, or when shorter than one organic block. Fleet-wide
# like vnodes, so not a setting; 4 KB holds a chat's system prompt and first question.
ROUTE_WINDOW_BYTES = 4096


class RouterSettings(TypedDict):
    """The Router's keyword settings (`settings(config)`)."""

    route_window_bytes: int
    default_replicas: int
    max_attempts: int
    home_kv_budget_tokens: int
    home_balance_factor: float
    bytes_per_token: float
    unregistered_routing: str
    organic_home_spread: float
    organic_session_spread: float
    organic_table_blocks: int
    organic_load_cap_floor: int
    organic_balance_starts: bool
    organic_follow_sessions: bool


def settings(config: Config) -> RouterSettings:
    """The Router's keyword settings for a config: its routing fields, and the constants of
    routing contract v1 (the window), the placement (routing/placement.py) and organic
    routing (routing/organic.py, routing/anchors.py), read when called."""
    return RouterSettings(
        route_window_bytes=ROUTE_WINDOW_BYTES,
        default_replicas=config.replicas,
        max_attempts=config.max_attempts,
        home_kv_budget_tokens=config.home_kv_budget_tokens,
        home_balance_factor=placement.HOME_BALANCE_FACTOR,
        bytes_per_token=placement.BYTES_PER_TOKEN,
        unregistered_routing=config.unregistered_routing,
        organic_home_spread=organic.HOME_SPREAD,
        organic_session_spread=organic.SESSION_SPREAD,
        organic_table_blocks=anchors.MAX_BLOCKS,
        organic_load_cap_floor=organic.LOAD_CAP_FLOOR,
        organic_balance_starts=organic.BALANCE_STARTS,
        organic_follow_sessions=organic.FOLLOW_SESSIONS,
    )
