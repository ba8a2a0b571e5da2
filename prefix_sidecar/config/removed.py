"""Fields removed from the config, and where each value lives now.

Each is a tuning constant only a benchmark can tune, now a named constant of the module that
uses it. A file, flag or env var that still sets one fails at start saying where it went.
"""

from __future__ import annotations

_ORGANIC = "a constant of routing/organic.py"
_RULES = "a constant of membership/load_signals/rules.py"
_POLLER = "a constant of membership/load_signals/poller.py"
_PLACEMENT = "a constant of routing/placement.py"
_PREWARM = "a constant of prewarm.py"

REMOVED_FIELDS: dict[str, str] = {
    "organic_home_spread": f"HOME_SPREAD, {_ORGANIC}",
    "organic_session_spread": f"SESSION_SPREAD, {_ORGANIC}",
    "organic_load_cap_floor": f"LOAD_CAP_FLOOR, {_ORGANIC}",
    "organic_balance_starts": f"BALANCE_STARTS, {_ORGANIC}",
    "organic_follow_sessions": f"FOLLOW_SESSIONS, {_ORGANIC}",
    "organic_table_blocks": "MAX_BLOCKS, a constant of routing/anchors.py",
    "load_report_saturation": f"REPORT_SATURATION, {_RULES}",
    "load_fleet_view": f"FLEET_VIEW, {_RULES}",
    "load_signal_max_age_s": f"MAX_AGE_S, {_RULES}",
    "load_kv_threshold": f"KV_THRESHOLD, {_RULES}",
    "load_poll_interval_s": f"POLL_INTERVAL_S, {_POLLER}",
    "load_poll_sample": f"POLL_SAMPLE, {_POLLER}",
    "load_poll_timeout_s": f"POLL_TIMEOUT_S, {_POLLER}",
    "home_kv_fraction": f"HOME_KV_FRACTION, {_PLACEMENT}",
    "home_balance_factor": f"HOME_BALANCE_FACTOR, {_PLACEMENT}",
    "bytes_per_token": f"BYTES_PER_TOKEN, {_PLACEMENT}",
    "vnodes": "the routing contract's DEFAULT_VNODES (1024), which every sidecar must share",
    "route_window_bytes": "ROUTE_WINDOW_BYTES, a constant of routing/router_settings.py",
    "policy": "DEFAULT_POLICY of routing/router.py (the baselines are for benchmarks)",
    "prewarm_concurrency": f"CONCURRENCY, {_PREWARM}",
    "prewarm_attempts": f"ATTEMPTS, {_PREWARM}",
    "prewarm_backoff_s": f"RETRY_BACKOFF_S, {_PREWARM}",
    "prewarm_timeout_s": f"TIMEOUT_S, {_PREWARM}",
    "api_key_env": "the env var is PREFIX_SIDECAR_API_KEY (or set api_key_file)",
    "tokenize_path": "prefixes are counted at the pods' POST /tokenize",
    "load_cap_floor": "REQUEST_CAP_FLOOR (thin requests, in either load_unit), a constant of "
    "routing/cost.py",
    "price_base": "the first of prices: [base, cache, out]",
    "price_cache": "the second of prices: [base, cache, out]",
    "price_out": "the third of prices: [base, cache, out]",
}
