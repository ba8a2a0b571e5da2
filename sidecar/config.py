"""The sidecar's configuration: one YAML file, overridden by PREFIX_SIDECAR_* env vars, then flags.

Every field is validated at start; a bad value fails with the field's name and the reason,
so a broken ConfigMap is caught by the pod's first start, not by the first request.
"""

from __future__ import annotations

import argparse
import dataclasses
import grp
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "PREFIX_SIDECAR_"
DEFAULT_SOCKET = "unix:///tmp/prefix-sidecar.sock"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field."""


@dataclass(frozen=True)
class PrefixSpec:
    """A prefix loaded at start: a name and the file holding its text."""

    name: str
    file: str
    replicas: int = 0


@dataclass(frozen=True)
class Config:
    listen: str = DEFAULT_SOCKET
    socket_mode: int = 0o660
    socket_group: str = ""
    tcp_listen: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""

    backends: tuple[tuple[str, int], ...] = ()  # (url, weight)
    backends_file: str = ""
    backends_dns: str = ""
    dns_nameserver: str = ""
    dns_interval_s: float = 5.0
    file_interval_s: float = 1.0
    # Members at 0.0.0.0/::, link-local (169.254.0.0/16: cloud metadata; fe80::/10), multicast
    # or broadcast addresses are refused with a warning unless this is true.
    allow_special_backend_addresses: bool = False

    health_path: str = "/health"
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    eject_after_failures: int = 3

    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"

    model: str = ""
    route_window_bytes: int = 4096
    replicas: int = 1
    load_factor: float = 1.25
    # The floor under every pod's bounded-load cap (routing contract v1, pick's min_cap). A vLLM
    # pod batches dozens of requests, so below ~8 in flight spilling a prefix to a cold pod
    # costs a full prefill for nothing; at low traffic the proportional cap alone is 1-2
    # streams. 0 gives the pure contract formula.
    load_cap_floor: int = 8
    # The most prefix KV tokens one pod (per unit of weight) is home to (routing contract
    # section 6). Set it to the pods' KV cache size minus what in-flight requests need; 0
    # keeps the ring's plain placement, which can stack several big prefixes on one pod.
    home_kv_budget_tokens: int = 0
    # With the budget on, also keep every pod within this factor of its fair share of all
    # homed prefix tokens (contract section 6; 0 = off). Tokens are a proxy for traffic: it
    # helps when the ring leaves a pod home to almost nothing (bench fleet uses 1.1) and can
    # hurt when many small prefixes end up together (the demo), so it is off by default.
    home_balance_factor: float = 0.0
    # How the budget sizes a prefix without a tokenizer: UTF-8 bytes per token (~4 for
    # English with a BPE tokenizer; measure yours with vLLM's /tokenize).
    bytes_per_token: float = 4.0
    vnodes: int = 0  # 0: the core's DEFAULT_VNODES
    max_attempts: int = 3
    warm_before_serve: bool = True
    prewarm_concurrency: int = 4
    prewarm_attempts: int = 3
    prewarm_backoff_s: float = 0.2
    prewarm_timeout_s: float = 120.0

    max_prefix_bytes: int = 4 * 1024 * 1024
    max_input_bytes: int = 1024 * 1024
    max_prefixes: int = 1024
    max_message_bytes: int = 8 * 1024 * 1024

    upstream_timeout_s: float = 600.0
    first_token_timeout_s: float = 60.0
    connect_timeout_s: float = 2.0
    per_backend_connections: int = 512
    api_key_env: str = "PREFIX_SIDECAR_API_KEY"
    api_key_file: str = ""

    grace_s: float = 10.0
    policy: str = "prefix_affinity"
    log_level: str = "info"

    price_base: float = 2.0
    price_cache: float = 0.2
    price_out: float = 6.0

    prefixes: tuple[PrefixSpec, ...] = field(default_factory=tuple)

    @property
    def socket_path(self) -> str:
        """The unix socket path of `listen` (empty when listening on TCP only)."""
        return self.listen[len("unix://") :] if self.listen.startswith("unix://") else ""

    def api_key(self) -> str:
        """The upstream API key, from the file if set, else from the env var; never logged."""
        if self.api_key_file:
            return Path(self.api_key_file).read_text(encoding="utf-8").strip()
        return os.environ.get(self.api_key_env, "").strip()


FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Turn a YAML/env/flag value into the field's type, or raise ConfigError naming the field."""
    where = f"config field {name!r}"
    if name == "prefixes":
        return tuple(_prefix_spec(i, item) for i, item in enumerate(_as_list(name, value)))
    if name == "backends":
        items = _as_list(name, value)
        backends = []
        for index, entry in enumerate(items):
            item: Any = entry
            weight: Any = 1
            if isinstance(entry, (tuple, list)) and len(entry) == 2:
                item, weight = entry
            elif isinstance(entry, Mapping):
                item, weight = entry.get("url"), entry.get("weight", 1)
            if not isinstance(item, str) or not item:
                raise ConfigError(f"{where}[{index}] must be a URL string, got {item!r}")
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
                raise ConfigError(
                    f"{where}[{index}].weight must be an integer >= 1, got {weight!r}"
                )
            backends.append((item, weight))
        return tuple(backends)
    if name == "socket_mode":
        if isinstance(value, int) and not isinstance(value, bool):
            mode = value
        else:
            try:
                mode = int(str(value).strip().lower().removeprefix("0o"), 8)
            except ValueError:
                raise ConfigError(
                    f'{where} must be an octal mode like "0660", got {value!r}'
                ) from None
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"{where} must be within 0000..0777, got {oct(mode)}")
        return mode
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        try:
            return int(str(value).replace("_", "")) if not isinstance(value, int) else value
        except ValueError:
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
    if isinstance(default, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        return number
    if isinstance(default, str):
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where} has an unsupported value {value!r}")  # pragma: no cover


def _as_list(name: str, value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config field {name!r} must be a list, got {type(value).__name__}")
    return list(value)


def _prefix_spec(index: int, item: Any) -> PrefixSpec:
    where = f"config field 'prefixes'[{index}]"
    if isinstance(item, PrefixSpec):
        return item
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


def parse_prefix_flag(text: str) -> PrefixSpec:
    """`NAME=FILE[:REPLICAS]` from --prefix."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(f"--prefix {text!r} must look like NAME=FILE[:REPLICAS]")
    path, colon, replicas = rest.rpartition(":")
    if colon and replicas.isdigit() and path:
        return PrefixSpec(name=name, file=path, replicas=int(replicas))
    return PrefixSpec(name=name, file=rest)


def _validate(config: Config) -> Config:
    def fail(name: str, reason: str) -> ConfigError:
        return ConfigError(f"config field {name!r} {reason}")

    if not (config.listen.startswith("unix://") and len(config.listen) > len("unix://")):
        raise fail("listen", f"must be unix:///path.sock, got {config.listen!r}")
    if config.tcp_listen:
        _host, sep, port = config.tcp_listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise fail("tcp_listen", f"must be HOST:PORT, got {config.tcp_listen!r}")
        if not (config.tls_cert_file and config.tls_key_file):
            raise fail(
                "tcp_listen",
                "needs tls_cert_file and tls_key_file: the TCP listener only serves TLS",
            )
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(config, name)
            if path and not Path(path).is_file():
                raise fail(name, f"names a file that does not exist: {path}")
        if config.tls_client_ca_file and not config.tls_cert_file:
            raise fail("tls_client_ca_file", "needs tls_cert_file and tls_key_file (mTLS)")
    positive = {
        "dns_interval_s": config.dns_interval_s,
        "file_interval_s": config.file_interval_s,
        "health_interval_s": config.health_interval_s,
        "health_timeout_s": config.health_timeout_s,
        "upstream_timeout_s": config.upstream_timeout_s,
        "first_token_timeout_s": config.first_token_timeout_s,
        "connect_timeout_s": config.connect_timeout_s,
        "prewarm_timeout_s": config.prewarm_timeout_s,
    }
    for name, value in positive.items():
        if value <= 0:
            raise fail(name, f"must be > 0, got {value}")
    at_least_one = {
        "eject_after_failures": config.eject_after_failures,
        "route_window_bytes": config.route_window_bytes,
        "replicas": config.replicas,
        "max_attempts": config.max_attempts,
        "prewarm_concurrency": config.prewarm_concurrency,
        "prewarm_attempts": config.prewarm_attempts,
        "max_prefix_bytes": config.max_prefix_bytes,
        "max_input_bytes": config.max_input_bytes,
        "max_prefixes": config.max_prefixes,
        "max_message_bytes": config.max_message_bytes,
        "per_backend_connections": config.per_backend_connections,
    }
    for name, value in at_least_one.items():
        if value < 1:
            raise fail(name, f"must be >= 1, got {value}")
    if config.vnodes < 0:
        raise fail("vnodes", f"must be >= 1 (or 0 for the default), got {config.vnodes}")
    if config.load_factor < 1.0:
        raise fail("load_factor", f"must be >= 1.0, got {config.load_factor}")
    if config.load_cap_floor < 0:
        raise fail("load_cap_floor", f"must be >= 0 (0 = no floor), got {config.load_cap_floor}")
    if config.home_kv_budget_tokens < 0:
        raise fail(
            "home_kv_budget_tokens",
            f"must be >= 0 (0 = plain ring placement), got {config.home_kv_budget_tokens}",
        )
    if not (config.home_balance_factor == 0 or config.home_balance_factor >= 1.0):
        raise fail(
            "home_balance_factor",
            f"must be 0 (off) or >= 1.0, got {config.home_balance_factor}",
        )
    if config.bytes_per_token <= 0:
        raise fail("bytes_per_token", f"must be > 0, got {config.bytes_per_token}")
    for name in ("grace_s", "prewarm_backoff_s"):
        if getattr(config, name) < 0:
            raise fail(name, f"must be >= 0, got {getattr(config, name)}")
    if not 0 <= config.metrics_port < 65536:
        raise fail("metrics_port", f"must be a port number (0 = off), got {config.metrics_port}")
    from sidecar.routing.policy import POLICIES

    if config.policy not in POLICIES:
        raise fail("policy", f"must be one of {', '.join(POLICIES)}, got {config.policy!r}")
    if not config.health_path.startswith("/"):
        raise fail("health_path", f"must start with '/', got {config.health_path!r}")
    if config.socket_group:
        try:
            grp.getgrnam(config.socket_group)
        except KeyError:
            # Checked here, not at chown time: by then the socket is bound and half started.
            raise fail(
                "socket_group", f"names no group on this host: {config.socket_group!r}"
            ) from None
    if config.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise fail("log_level", f"must be debug, info, warning or error, got {config.log_level!r}")
    for name in ("price_base", "price_cache", "price_out"):
        if getattr(config, name) < 0:
            raise fail(name, "must be >= 0")
    if config.api_key_file and not Path(config.api_key_file).is_file():
        raise fail("api_key_file", f"names a file that does not exist: {config.api_key_file}")
    names = [p.name for p in config.prefixes]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise fail("prefixes", f"has duplicate names {sorted(duplicates)}")
    return config


def build_config(
    file_values: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge file < env < overrides (flags) into a validated Config."""
    values: dict[str, Any] = {}
    for source_name, source in (("config file", file_values or {}), ("flags", overrides or {})):
        if source_name == "flags":
            for key, raw in (env or {}).items():
                if key.startswith(ENV_PREFIX):
                    name = key[len(ENV_PREFIX) :].lower()
                    if name in FIELDS and name != "api_key":
                        values[name] = _coerce(name, raw, FIELDS[name].default)
        for name, raw in source.items():
            if name not in FIELDS:
                raise ConfigError(
                    f"unknown config field {name!r} in the {source_name}; "
                    f"known fields: {', '.join(sorted(FIELDS))}"
                )
            default = FIELDS[name].default
            if default is dataclasses.MISSING:
                default = ()
            values[name] = _coerce(name, raw, default)
    return _validate(Config(**values))


def load_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of fields, got {type(data).__name__}"
        )
    if isinstance(data.get("socket_mode"), int):
        # YAML reads `socket_mode: 440` as decimal 440 (0o670) but `0660` as octal: take the
        # digits as written, so every spelling of a mode means what a chmod user expects.
        data["socket_mode"] = _raw_scalar(text, "socket_mode")
    return data


def _raw_scalar(text: str, key: str) -> str:
    root = yaml.compose(text)
    for key_node, value_node in getattr(root, "value", ()):
        if getattr(key_node, "value", None) == key and isinstance(value_node, yaml.ScalarNode):
            return str(value_node.value)
    raise ConfigError(f"config field {key!r}: cannot read its value")  # pragma: no cover


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for `serve`; every field can also be set in the file or the environment."""
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--listen", help=f"unix:///path.sock (default {DEFAULT_SOCKET})")
    parser.add_argument(
        "--backend",
        dest="backends",
        action="append",
        metavar="URL",
        help="a vLLM pod URL (repeatable)",
    )
    parser.add_argument("--backends-file", help="YAML/JSON list of pods, re-read on change")
    parser.add_argument(
        "--backends-dns",
        metavar="NAME:PORT",
        help="headless Service name re-resolved for A/AAAA records",
    )
    parser.add_argument("--dns-nameserver", metavar="IP[:PORT]")
    parser.add_argument(
        "--allow-special-backend-addresses",
        action="store_const",
        const=True,
        help="accept members at 0.0.0.0, ::, link-local, multicast or broadcast addresses",
    )
    parser.add_argument("--health-path", help="GET path for active health checks")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (0 = off)")
    parser.add_argument(
        "--prefix",
        dest="prefixes",
        action="append",
        metavar="NAME=FILE[:REPLICAS]",
        help="register a prefix at start (repeatable)",
    )
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other config field, e.g. --set load_factor=1.5 (repeatable)",
    )


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    file_values = load_file(args.config) if getattr(args, "config", None) else {}
    overrides: dict[str, Any] = {}
    for name in (
        "listen",
        "backends_file",
        "backends_dns",
        "dns_nameserver",
        "allow_special_backend_addresses",
        "health_path",
        "metrics_port",
    ):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if getattr(args, "backends", None):
        overrides["backends"] = args.backends
    if getattr(args, "prefixes", None):
        overrides["prefixes"] = [parse_prefix_flag(p) for p in args.prefixes]
    for setting in getattr(args, "settings", []) or []:
        name, sep, value = setting.partition("=")
        if not sep:
            raise ConfigError(f"--set {setting!r} must look like FIELD=VALUE")
        name = name.strip()
        if name == "socket_mode":  # octal text, as chmod reads it: YAML would make 660 decimal
            overrides[name] = value
            continue
        overrides[name] = yaml.safe_load(value) if value else ""
    return build_config(file_values, os.environ if env is None else env, overrides)


def describe(config: Config) -> dict[str, Any]:
    """The config as plain data, for logs and `serve --print-config`; no secrets in it."""
    data = dataclasses.asdict(config)
    data["socket_mode"] = oct(config.socket_mode)
    return data


def field_names() -> Sequence[str]:
    return sorted(FIELDS)
