"""The one config table (prefix_sidecar/fields.py): Config and the emulator's pod model are declared
with it, and the flags, env vars, checks, component defaults and docs all follow it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from prefix_sidecar import _core_py, fields, prewarm
from prefix_sidecar.config import (
    API_KEY_ENV,
    DEFAULTS,
    FIELDS,
    REMOVED_FIELDS,
    Config,
    ConfigError,
    PrefixSpec,
    add_arguments,
    build_config,
    from_args,
)
from prefix_sidecar.membership.health import HealthMonitor
from prefix_sidecar.membership.load_signals import poller, rules
from prefix_sidecar.membership.pool import BackendPool
from prefix_sidecar.membership.sources import MAX_WEIGHT, DnsSource, FileSource, Member
from prefix_sidecar.metrics import Metrics
from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.prewarm import Prewarmer
from prefix_sidecar.routing import anchors, cost, organic, placement, router, router_settings
from prefix_sidecar.upstream.tokenize import count_tokens
from prefix_sidecar_tools.emulator.config import (
    EmulatorConfig,
    Faults,
    add_config_arguments,
    config_from_args,
    config_to_argv,
    to_argv,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_config_field_is_in_the_table_with_help() -> None:
    assert list(FIELDS) == [f.name for f in dataclasses.fields(Config)]
    assert all(entry.spec.help for entry in FIELDS.values())


def test_the_defaults_pass_their_own_checks() -> None:
    assert build_config() == Config() == DEFAULTS


def test_dedicated_flags_come_from_the_table() -> None:
    args = serve_args(
        "--listen", "unix:///tmp/x.sock",
        "--backend", "http://10.0.0.1:8000", "--backend", "http://10.0.0.2:8000",
        "--metrics-port", "9090",
        "--allow-special-backend-addresses",
        "--dns-nameserver", "[fd00::a]:5353",
        "--prefix", "rules=/r.txt:2",
    )  # fmt: skip
    config = from_args(args, env={})
    assert config.listen == "unix:///tmp/x.sock"
    assert config.backends == (("http://10.0.0.1:8000", 1), ("http://10.0.0.2:8000", 1))
    assert config.metrics_port == 9090
    assert config.allow_special_backend_addresses is True
    assert config.dns_nameserver == "[fd00::a]:5353"
    assert config.prefixes == (PrefixSpec("rules", "/r.txt", 2),)
    flagged = {e.spec.flag for e in FIELDS.values() if e.spec.flag}
    assert flagged == {
        "--listen", "--backend", "--backends-file", "--backends-dns", "--dns-nameserver",
        "--allow-special-backend-addresses", "--health-path", "--metrics-port", "--prefix",
        "--openai-listen",
    }  # fmt: skip


def test_a_flag_value_is_checked_by_the_table_and_names_the_field() -> None:
    with pytest.raises(ConfigError, match="'metrics_port' must be an integer"):
        from_args(serve_args("--metrics-port", "http"), env={})


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("warm_before_serve", "off", False),
        ("socket_mode", "0640", 0o640),
        ("load_factor", "1.5", 1.5),
        ("max_prefixes", "2_048", 2048),
        ("log_format", "json", "json"),
        ("backends", "http://a:1,http://b:2", (("http://a:1", 1), ("http://b:2", 1))),
    ],
)
def test_env_text_is_coerced_by_the_fields_kind(name: str, text: str, value: Any) -> None:
    config = build_config(env={f"PREFIX_SIDECAR_{name.upper()}": text})
    assert getattr(config, name) == value


def test_env_vars_that_are_not_fields_are_ignored() -> None:
    assert build_config(env={"PREFIX_SIDECAR_API_KEY": "sk-x", "PREFIX_SIDECAR_NOPE": "1"})


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("log_format", "yaml", "must be one of text, json"),
        ("dns_nameserver", "dns.local", "must be IP[:PORT]"),
        ("dns_nameserver", "10.0.0.1:99999", "must be IP[:PORT]"),
        ("tcp_listen", "[::1]", "has no port"),
        ("tcp_listen", "::1:8443", "[address]:port"),
        ("load_factor", 0.5, "must be >= 1.0"),
        ("home_kv_budget_tokens", -1, "(0 = plain ring placement)"),
    ],
)
def test_checks_name_the_field_and_the_reason(name: str, value: Any, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(overrides={name: value})
    assert f"config field {name!r}" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("nameserver", ["10.96.0.10", "10.96.0.10:5353", "fd00::a", "[fd00::a]:53"])
def test_good_nameservers(nameserver: str) -> None:
    assert build_config(overrides={"dns_nameserver": nameserver}).dns_nameserver == nameserver


def test_components_take_their_defaults_from_the_config() -> None:
    health = inspect.signature(HealthMonitor).parameters
    assert health["interval_s"].default == DEFAULTS.health_interval_s
    assert health["timeout_s"].default == DEFAULTS.health_timeout_s
    assert health["failure_threshold"].default == DEFAULTS.eject_after_failures
    assert health["path"].default == DEFAULTS.health_path
    store = inspect.signature(PrefixStore).parameters
    assert store["max_prefixes"].default == DEFAULTS.max_prefixes
    assert store["max_bytes"].default == DEFAULTS.max_prefix_bytes
    assert inspect.signature(Metrics).parameters["prices"].default == DEFAULTS.prices
    pool = inspect.signature(BackendPool).parameters
    assert pool["hash_table"].default == DEFAULTS.hash_table
    assert pool["warm_before_serve"].default == DEFAULTS.warm_before_serve
    assert inspect.signature(FileSource).parameters["interval_s"].default == (
        DEFAULTS.file_interval_s
    )
    assert inspect.signature(DnsSource).parameters["interval_s"].default == DEFAULTS.dns_interval_s


# Each tuning constant that was a config field until the knobs were cut (issue 26), with the
# field's default then: moving a knob into its module changed no behaviour.
FORMER_FIELDS = [
    ("organic_home_spread", organic.HOME_SPREAD, 4.0),
    ("organic_session_spread", organic.SESSION_SPREAD, 1.5),
    ("organic_load_cap_floor", organic.LOAD_CAP_FLOOR, 8),
    ("organic_balance_starts", organic.BALANCE_STARTS, True),
    ("organic_follow_sessions", organic.FOLLOW_SESSIONS, True),
    ("organic_table_blocks", anchors.MAX_BLOCKS, 32768),
    ("load_report_saturation", rules.REPORT_SATURATION, False),
    ("load_fleet_view", rules.FLEET_VIEW, True),
    ("load_signal_max_age_s", rules.MAX_AGE_S, 2.0),
    ("load_kv_threshold", rules.KV_THRESHOLD, 0.95),
    ("load_poll_interval_s", poller.POLL_INTERVAL_S, 0.5),
    ("load_poll_sample", poller.POLL_SAMPLE, 2),
    ("load_poll_timeout_s", poller.POLL_TIMEOUT_S, 0.5),
    ("home_kv_fraction", placement.HOME_KV_FRACTION, 0.5),
    ("home_balance_factor", placement.HOME_BALANCE_FACTOR, 0.0),
    ("bytes_per_token", placement.BYTES_PER_TOKEN, 4.0),
    ("vnodes", _core_py.DEFAULT_VNODES, 1024),  # 0 meant the core's default
    ("route_window_bytes", router_settings.ROUTE_WINDOW_BYTES, 4096),
    ("prewarm_concurrency", prewarm.CONCURRENCY, 4),
    ("prewarm_attempts", prewarm.ATTEMPTS, 3),
    ("prewarm_backoff_s", prewarm.RETRY_BACKOFF_S, 0.2),
    ("prewarm_timeout_s", prewarm.TIMEOUT_S, 120.0),
    ("api_key_env", API_KEY_ENV, "PREFIX_SIDECAR_API_KEY"),
    ("tokenize_path", inspect.signature(count_tokens).parameters["path"].default, "/tokenize"),
    ("policy", router.DEFAULT_POLICY, "prefix_affinity"),
    ("load_cap_floor", cost.REQUEST_CAP_FLOOR, 8),  # in thin requests, either load_unit
    # One price sheet now: the three prices' defaults, in order.
    ("price_base", DEFAULTS.prices[0], 2.0),
    ("price_cache", DEFAULTS.prices[1], 0.2),
    ("price_out", DEFAULTS.prices[2], 6.0),
]


@pytest.mark.parametrize(("name", "constant", "before"), FORMER_FIELDS)
def test_a_former_field_is_a_constant_with_its_old_default(
    name: str, constant: object, before: object
) -> None:
    assert name not in FIELDS
    assert constant == before and type(constant) is type(before)


def test_a_former_field_fails_at_start_saying_where_it_went() -> None:
    assert sorted(REMOVED_FIELDS) == sorted(name for name, _, _ in FORMER_FIELDS)
    moved = "was removed from the config: it is now HOME_SPREAD, a constant of routing/organic.py"
    with pytest.raises(
        ConfigError, match=f"'organic_home_spread' \\(in the config file\\) {moved}"
    ):
        build_config({"organic_home_spread": 3.0})
    with pytest.raises(ConfigError, match="'load_poll_sample' \\(in env var PREFIX_SIDECAR_LOAD_P"):
        build_config(env={"PREFIX_SIDECAR_LOAD_POLL_SAMPLE": "0"})  # not silently ignored
    with pytest.raises(ConfigError, match="'policy' \\(in the flags\\) was removed"):
        from_args(serve_args("--set", "policy=round_robin"), env={})
    assert len(FIELDS) <= 50, "issue 26: at most 50 fields; a tuning constant is its module's"


def test_components_read_the_constants_when_built() -> None:
    """The runtime reads a tuning constant when it builds the component, so a bench (or a
    test) can run it with another value: the components and the router take them as given."""
    assert inspect.signature(Prewarmer).parameters["backoff_s"].default == prewarm.RETRY_BACKOFF_S
    assert inspect.signature(Prewarmer).parameters["timeout_s"].default == prewarm.TIMEOUT_S
    assert router_settings.settings(DEFAULTS)["organic_balance_starts"] is organic.BALANCE_STARTS


def test_membership_weights_are_the_cores_bound() -> None:
    assert MAX_WEIGHT == _core_py.MAX_WEIGHT == 65536
    assert Member("http://10.0.0.1:8000", MAX_WEIGHT).weight == MAX_WEIGHT
    with pytest.raises(ValueError, match="1-65536"):
        Member("http://10.0.0.1:8000", MAX_WEIGHT + 1)


def _docs_default(name: str, value: Any) -> str:
    if name == "socket_mode":
        return f"`{value:04o}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == ():
        return "`[]`"
    if isinstance(value, tuple) and not isinstance(value[0], tuple):
        return f"`{list(value)}`"
    return "empty" if value == "" else f"`{value}`"


def test_the_docs_table_is_the_config_table() -> None:
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Configuration") : text.index("## Metrics")]
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| (.*?) \|$", section, flags=re.MULTILINE)
    expected = [
        (name, _docs_default(name, entry.default), entry.spec.help)
        for name, entry in FIELDS.items()
    ]
    assert rows == expected


# --- the emulator declares its pod model with the same table ---------------------------------


def emulator_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return parser.parse_args(list(argv))


def test_emulator_flags_round_trip_through_argv() -> None:
    config = EmulatorConfig(time_scale=50.0, kv_tokens=200_000)
    config.faults.drop_after_chunks = 3
    config.faults.unhealthy = True
    assert config_from_args(emulator_args(*config_to_argv(config))) == config
    assert config_from_args(emulator_args()) == EmulatorConfig()


def test_emulator_flags_and_checks_follow_its_table() -> None:
    flagged = {e.name for e in fields.table(EmulatorConfig).values() if e.spec.flag}
    assert flagged == {f.name for f in dataclasses.fields(EmulatorConfig)} - {"faults"}
    assert all(e.spec.flag for e in fields.table(Faults).values())
    with pytest.raises(ValueError, match="decode_tps must be > 0"):
        config_from_args(emulator_args("--decode-tps", "0"))
    with pytest.raises(ValueError, match="kv_tokens must hold at least one block"):
        config_from_args(emulator_args("--kv-tokens", "8"))
    with pytest.raises(ValueError, match="fail_status must be one of"):
        config_from_args(emulator_args("--fail-status", "404"))


# --- the machinery itself ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Small:
    count: int = fields.setting(2, "how many", flag="--count", check=fields.at_least(1))
    names: tuple[str, ...] = fields.setting(
        (), "names", flag="--name", repeat=True, parse=lambda _n, v: tuple(v)
    )
    loud: bool = fields.setting(False, "shout", flag="--loud")
    note: str = fields.setting("", "no flag")


def test_setting_refuses_a_mutable_default() -> None:
    with pytest.raises(TypeError, match="immutable"):
        fields.setting([], "a list")


def test_add_flags_given_and_to_argv_are_inverse() -> None:
    parser = argparse.ArgumentParser()
    fields.add_flags(parser, _Small, typed=True)
    args = parser.parse_args(["--count", "5", "--name", "a", "--name", "b", "--loud"])
    values = fields.given(args, _Small)
    assert values == {"count": 5, "names": ["a", "b"], "loud": True}
    small = _Small(count=5, names=("a", "b"), loud=True)
    assert to_argv(small) == ["--count", "5", "--name", "a", "--name", "b", "--loud"]
    assert fields.given(parser.parse_args([]), _Small) == {}


def test_validate_reports_the_first_bad_field() -> None:
    with pytest.raises(fields.FieldError, match=r"^count must be >= 1, got 0$"):
        fields.validate(_Small(count=0), lambda name, reason: f"{name} {reason}")
    fields.validate(_Small(), lambda name, reason: f"{name} {reason}")


@pytest.mark.parametrize(
    ("kind", "raw", "value"),
    [(bool, "yes", True), (int, "1_000", 1000), (float, 2, 2.0), (str, None, ""), (str, 7, "7")],
)
def test_coerce_scalar(kind: type, raw: Any, value: Any) -> None:
    assert fields.coerce_scalar("f", raw, kind) == value


@pytest.mark.parametrize(
    ("kind", "raw", "words"),
    [
        (bool, "maybe", "true or false"),
        (int, True, "an integer"),
        (int, "1.5", "an integer"),
        (float, "nan", "finite"),
        (float, "x", "a number"),
        (str, [1], "a string"),
    ],
)
def test_coerce_scalar_refuses(kind: type, raw: Any, words: str) -> None:
    with pytest.raises(fields.FieldError, match=f"config field 'f' must be .*{words}"):
        fields.coerce_scalar("f", raw, kind)
