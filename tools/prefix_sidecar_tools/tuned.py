"""`serve` with some of the runtime's tuning constants set: how a bench runs a sidecar with a
value that is no config field.

A constant that only a bench can tune (organic routing's spreads, the pod-signal rules, the
placement's balance ...) is a named constant of the runtime module that uses it, not a
setting. A bench that compares it against another value (bench organic's `hashed`, `wide`
and `unfollowed`, bench fleet's saturation report) names it here by its former field name;
`serve_settings` sends config fields as `--set` and the rest to this launcher, which sets
each constant in the child before `serve` builds anything:

    python -m prefix_sidecar_tools.tuned --tune organic_balance_starts=false serve ...
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence

import yaml

from prefix_sidecar.config import FIELDS

# Each tunable's module and constant, by module; each read when the sidecar is built.
_CONSTANTS: dict[str, dict[str, str]] = {
    "prefix_sidecar.routing.router": {"policy": "DEFAULT_POLICY"},
    "prefix_sidecar.routing.router_settings": {"route_window_bytes": "ROUTE_WINDOW_BYTES"},
    "prefix_sidecar.routing.organic": {
        "organic_home_spread": "HOME_SPREAD",
        "organic_session_spread": "SESSION_SPREAD",
        "organic_load_cap_floor": "LOAD_CAP_FLOOR",
        "organic_balance_starts": "BALANCE_STARTS",
        "organic_follow_sessions": "FOLLOW_SESSIONS",
    },
    "prefix_sidecar.routing.anchors": {"organic_table_blocks": "MAX_BLOCKS"},
    "prefix_sidecar.membership.load_signals.rules": {
        "load_report_saturation": "REPORT_SATURATION",
        "load_fleet_view": "FLEET_VIEW",
        "load_signal_max_age_s": "MAX_AGE_S",
        "load_kv_threshold": "KV_THRESHOLD",
    },
    "prefix_sidecar.membership.load_signals.poller": {
        "load_poll_interval_s": "POLL_INTERVAL_S",
        "load_poll_sample": "POLL_SAMPLE",
        "load_poll_timeout_s": "POLL_TIMEOUT_S",
    },
    "prefix_sidecar.routing.placement": {
        "home_balance_factor": "HOME_BALANCE_FACTOR",
        "home_kv_fraction": "HOME_KV_FRACTION",
        "bytes_per_token": "BYTES_PER_TOKEN",
    },
}
# name -> (module, constant)
TUNABLES: dict[str, tuple[str, str]] = {
    name: (module, constant)
    for module, constants in _CONSTANTS.items()
    for name, constant in constants.items()
}
LAUNCHER = ("-m", "prefix_sidecar_tools.tuned")


def serve_settings(
    settings: Mapping[str, object], launcher: Sequence[str] = ("-m", "prefix_sidecar.cli")
) -> tuple[list[str], list[str]]:
    """(serve's `--set` args for the config fields, the launcher that sets the rest)."""
    args: list[str] = []
    tunes: list[str] = []
    for name, value in settings.items():
        if name in FIELDS:
            args += ["--set", f"{name}={value}"]
        elif name in TUNABLES:
            tunes += ["--tune", f"{name}={value}"]
        else:
            known = ", ".join(sorted([*FIELDS, *TUNABLES]))
            raise ValueError(f"{name!r} is neither a config field nor a tunable; known: {known}")
    return args, ([*LAUNCHER, *tunes] if tunes else list(launcher))


def apply(tunes: Sequence[str]) -> None:
    """Set each `NAME=VALUE` constant, in the type of its current value."""
    for tune in tunes:
        name, sep, text = tune.partition("=")
        if not sep or name not in TUNABLES:
            raise SystemExit(f"--tune {tune!r}: want NAME=VALUE, NAME one of {sorted(TUNABLES)}")
        module_name, constant = TUNABLES[name]
        module = importlib.import_module(module_name)
        current = getattr(module, constant)
        value = yaml.safe_load(text)
        if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(current):
            raise SystemExit(f"--tune {tune!r}: {name} is a {type(current).__name__}")
        setattr(module, constant, value)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    tunes = []
    while len(args) >= 2 and args[0] == "--tune":
        tunes.append(args[1])
        del args[:2]
    apply(tunes)
    from prefix_sidecar.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
