"""The sidecar's configuration: one YAML file, overridden by PREFIX_SIDECAR_* env vars, then flags.

`Config` is the one table of fields (prefix_sidecar/fields.py): each field's default, help, flag and
check are declared once, and the file, env vars, flags, `--print-config`, the docs table and
the components' own defaults all read it. Every field is validated at start; a bad value
fails with the field's name and the reason, so a broken ConfigMap is caught by the pod's
first start, not by the first request.
"""

from __future__ import annotations

import argparse
import dataclasses
import grp
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prefix_sidecar import fields
from prefix_sidecar._core_py import HASH_TABLES
from prefix_sidecar.fields import FieldError, above, at_least, one_of, setting
from prefix_sidecar.hostport import is_loopback_host, split_host_port
from prefix_sidecar.routing.policy_names import POLICIES

ENV_PREFIX = "PREFIX_SIDECAR_"
DEFAULT_SOCKET = "unix:///tmp/prefix-sidecar.sock"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
UNREGISTERED_ROUTING = ("organic", "window")

ConfigError = FieldError  # the name callers catch: a value that cannot be used, field named


@dataclass(frozen=True)
class PrefixSpec:
    """A prefix loaded at start: a name and the file holding its text."""

    name: str
    file: str
    replicas: int = 0


# --- parsers and checks of single fields ----------------------------------------------------


def _as_list(name: str, value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config field {name!r} must be a list, got {type(value).__name__}")
    return list(value)


def _backends(name: str, value: Any) -> tuple[tuple[str, int], ...]:
    where = f"config field {name!r}"
    backends = []
    for index, entry in enumerate(_as_list(name, value)):
        item: Any = entry
        weight: Any = 1
        if isinstance(entry, (tuple, list)) and len(entry) == 2:
            item, weight = entry
        elif isinstance(entry, Mapping):
            item, weight = entry.get("url"), entry.get("weight", 1)
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{where}[{index}] must be a URL string, got {item!r}")
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise ConfigError(f"{where}[{index}].weight must be an integer >= 1, got {weight!r}")
        backends.append((item, weight))
    return tuple(backends)


def _prefixes(name: str, value: Any) -> tuple[PrefixSpec, ...]:
    return tuple(_prefix_spec(i, item) for i, item in enumerate(_as_list(name, value)))


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


def _octal_mode(name: str, value: Any) -> int:
    where = f"config field {name!r}"
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        try:
            mode = int(str(value).strip().lower().removeprefix("0o"), 8)
        except ValueError:
            raise ConfigError(f'{where} must be an octal mode like "0660", got {value!r}') from None
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"{where} must be within 0000..0777, got {oct(mode)}")
    return mode


def _unix_url(value: str) -> str | None:
    if value.startswith("unix://") and len(value) > len("unix://"):
        return None
    return f"must be unix:///path.sock, got {value!r}"


def _host_and_port(value: str) -> str | None:
    if not value:
        return None
    try:
        split_host_port(value)
    except ValueError as exc:
        return f"must be HOST:PORT: {exc}"
    return None


def _openai_listen(value: str) -> str | None:
    if not value or _unix_url(value) is None:
        return None
    reason = _host_and_port(value)
    return f"{reason} or unix:///path.sock" if reason else None


def _nameserver(value: str) -> str | None:
    if not value:
        return None
    try:
        ipaddress.ip_address(split_host_port(value, default_port=53)[0])
    except ValueError:
        return f"must be IP[:PORT], e.g. '10.96.0.10' or '[fd00::a]:53', got {value!r}"
    return None


def _existing_file(path: str) -> str | None:
    return None if not path or Path(path).is_file() else f"names a file that does not exist: {path}"


def _group(name: str) -> str | None:
    if not name:
        return None
    try:
        grp.getgrnam(name)
    except KeyError:
        # Checked here, not at chown time: by then the socket is bound and half started.
        return f"names no group on this host: {name!r}"
    return None


def _policy(name: str) -> str | None:

    return None if name in POLICIES else f"must be one of {', '.join(POLICIES)}, got {name!r}"


def _path(value: str) -> str | None:
    return None if value.startswith("/") else f"must start with '/', got {value!r}"


def _balance(value: float) -> str | None:
    return None if value == 0 or value >= 1.0 else f"must be 0 (off) or >= 1.0, got {value}"


def _log_level(value: str) -> str | None:
    if value.lower() in LOG_LEVELS:
        return None
    return f"must be debug, info, warning or error, got {value!r}"


def _vnodes(value: int) -> str | None:
    return None if value >= 0 else f"must be >= 1 (or 0 for the default), got {value}"


def _port(value: int) -> str | None:
    return None if 0 <= value < 65536 else f"must be a port number (0 = off), got {value}"


def _path_or_empty(value: str) -> str | None:
    return (
        None
        if not value or value.startswith("/")
        else f"must start with / (or be empty), got {value!r}"
    )


def _fraction(value: float) -> str | None:
    return None if 0.0 <= value <= 1.0 else f"must be within 0 and 1, got {value}"


POSITIVE = above(0)
AT_LEAST_ONE = at_least(1)
NOT_NEGATIVE = at_least(0)


@dataclass(frozen=True)
class Config:
    """Every setting of a sidecar; see docs/api.md's configuration table (made from this)."""

    listen: str = setting(
        DEFAULT_SOCKET, "the gRPC unix socket, unix:///path.sock", flag="--listen", check=_unix_url
    )
    socket_mode: int = setting(
        0o660, "the socket file's mode, octal", parse=_octal_mode, verbatim=True
    )
    socket_group: str = setting("", "the socket file's group (must exist)", check=_group)
    tcp_listen: str = setting(
        "", "HOST:PORT of an extra TLS-only gRPC listener; empty = none", check=_host_and_port
    )
    openai_listen: str = setting(
        "",
        "HOST:PORT or unix:///path of the OpenAI HTTP front; empty = none; not loopback: TLS",
        flag="--openai-listen",
        metavar="HOST:PORT",
        check=_openai_listen,
    )
    tls_cert_file: str = setting("", "the TCP listener's certificate (PEM)")
    tls_key_file: str = setting("", "the TCP listener's private key (PEM)")
    tls_client_ca_file: str = setting("", "CA that client certificates must chain to (mTLS)")

    backends: tuple[tuple[str, int], ...] = setting(
        (),
        "vLLM pod URLs, each a string or {url, weight}",
        flag="--backend",
        metavar="URL",
        repeat=True,
        parse=_backends,
    )
    backends_file: str = setting(
        "", "YAML/JSON list of pods, re-read on change", flag="--backends-file"
    )
    backends_dns: str = setting(
        "",
        "headless Service NAME:PORT re-resolved for A/AAAA records",
        flag="--backends-dns",
        metavar="NAME:PORT",
    )
    dns_nameserver: str = setting(
        "",
        "IP[:PORT] of the DNS server for backends_dns; empty = the system's",
        flag="--dns-nameserver",
        metavar="IP[:PORT]",
        check=_nameserver,
    )
    dns_interval_s: float = setting(5.0, "seconds between DNS lookups", check=POSITIVE)
    file_interval_s: float = setting(1.0, "seconds between backends_file reads", check=POSITIVE)
    # Members at 0.0.0.0/::, link-local (169.254.0.0/16: cloud metadata; fe80::/10), multicast
    # or broadcast addresses are refused with a warning unless this is true.
    allow_special_backend_addresses: bool = setting(
        False,
        "accept members at 0.0.0.0, ::, link-local, multicast or broadcast addresses",
        flag="--allow-special-backend-addresses",
    )

    health_path: str = setting(
        "/health", "GET path of active health checks", flag="--health-path", check=_path
    )
    health_interval_s: float = setting(1.0, "seconds between a pod's health checks", check=POSITIVE)
    health_timeout_s: float = setting(1.0, "seconds a health check may take", check=POSITIVE)
    eject_after_failures: int = setting(
        3, "consecutive failures that take a pod out", check=AT_LEAST_ONE
    )

    metrics_port: int = setting(
        0, "Prometheus /metrics port; 0 = off", flag="--metrics-port", check=_port
    )
    metrics_host: str = setting("127.0.0.1", "the address the metrics port binds")

    model: str = setting("", "model sent to the pods when a request names none")
    # How an unregistered prompt or chat routes (docs/organic-routing.md, routing contract 9):
    # organic keys a chat by its system and first user message and a raw prompt by learnt
    # anchors, spreading a tenant's sessions over a home set sized by its share; window is
    # the original key of the first route_window_bytes bytes (a chat's first message).
    unregistered_routing: str = setting(
        "organic",
        "organic (learnt anchors, chat structure) or window (key of the first bytes); the "
        "key-less baseline policies (round_robin, random, least_loaded) compute no organic keys",
        check=one_of(UNREGISTERED_ROUTING),
    )
    route_window_bytes: int = setting(
        4096,
        "bytes of an unregistered prompt that make its route key (window routing, and the "
        "organic fallback for a prompt shorter than one block)",
        check=AT_LEAST_ONE,
    )
    organic_home_spread: float = setting(
        4.0,
        "organic routing: a family's home set is ceil(spread x its share x pods) pods",
        check=above(0.0),
    )
    # A family's sessions live on the first ceil(session_spread x share x pods) pods of its
    # home set (contract 9f): every sidecar must use the same value, as for the spread.
    organic_session_spread: float = setting(
        1.5,
        "organic routing: a family's sessions live on ceil(spread x its share x pods) pods of "
        "its home set",
        check=above(0.0),
    )
    # Organic requests are small next to a registered fat prefix: a spill costs a session's
    # history at most, while a hot pod's queue costs every request behind it, so their
    # floor is lower than load_cap_floor (which stays for registered prefixes).
    organic_load_cap_floor: int = setting(
        8,
        "organic routing: the floor under every pod's cap (min_cap) for unregistered requests",
        check=at_least(0, " (0 = no floor)"),
    )
    # A request that starts a flow goes to the least-loaded pod of its family's home set
    # (docs/organic-routing.md, contract 9f); off: to its session's pod, as later turns.
    organic_balance_starts: bool = setting(
        True, "organic routing: send flow starts to the least-loaded pod of the home set"
    )
    # A conversation's next request goes where this sidecar sent its previous one when no
    # other sidecar sent one in between (docs/organic-routing.md, contract 9h); off: to its
    # session's pod, as every sidecar computes it.
    organic_follow_sessions: bool = setting(
        True,
        "organic routing: send a conversation's next request (a chat, or a raw prompt in a "
        "known chat template: contract 9h) where its previous one went",
    )
    organic_table_blocks: int = setting(
        32768,
        "organic routing: block keys remembered per generation (two generations; ~8 MB at the "
        "default)",
        check=at_least(16),
    )
    replicas: int = setting(1, "pods per prefix (R of the routing contract)", check=AT_LEAST_ONE)
    load_factor: float = setting(
        1.25, "bounded-load factor c: a pod's cap is c x its fair share", check=at_least(1.0)
    )
    # The floor under every pod's bounded-load cap (routing contract v1, pick's min_cap). A vLLM
    # pod batches dozens of requests, so below ~8 in flight spilling a prefix to a cold pod
    # costs a full prefill for nothing; at low traffic the proportional cap alone is 1-2
    # streams. 0 gives the pure contract formula.
    load_cap_floor: int = setting(
        8,
        "the floor under every pod's cap (min_cap); 0 = none",
        check=at_least(0, " (0 = no floor)"),
    )
    # The most prefix KV tokens one pod (per unit of weight) is home to (routing contract
    # section 6). Set it to the pods' KV cache size minus what in-flight requests need; 0
    # keeps the ring's plain placement, which can stack several big prefixes on one pod.
    home_kv_budget_tokens: int = setting(
        0,
        "most prefix KV tokens a pod is home to, per unit of weight; 0 = plain ring",
        check=at_least(0, " (0 = plain ring placement)"),
    )
    # With the budget on, also keep every pod within this factor of its fair share of all
    # homed prefix tokens (contract section 6; 0 = off). Tokens are a proxy for traffic: it
    # helps when the ring leaves a pod home to almost nothing (bench fleet uses 1.1) and can
    # hurt when many small prefixes end up together (the demo), so it is off by default.
    home_balance_factor: float = setting(
        0.0, "keep each pod within f x its share of homed tokens; 0 = off", check=_balance
    )
    # How the budget sizes a prefix without a tokenizer: UTF-8 bytes per token (~4 for
    # English with a BPE tokenizer; measure yours with vLLM's /tokenize).
    bytes_per_token: float = setting(
        4.0, "UTF-8 bytes per token, to size prefixes for the budget", check=POSITIVE
    )
    # The pods' own load and KV (docs/load-signals.md): every request asks for vLLM's ORCA
    # load header, a few pods per interval are asked for /metrics, and a pod that queues or
    # whose KV is full counts as over its bounded-load cap while the reading is fresh.
    load_signals: bool = setting(True, "read the pods' load and KV (ORCA header, /metrics polls)")
    # Measured harmful at 2x rate with 4 sidecars (docs/benchmarks.md "Pod load signals"):
    # off by default; the readings, the KV budget and the token counts stay on.
    load_report_saturation: bool = setting(
        False, "count a pod that reports queueing or full KV as over its cap"
    )
    # Rule 3 (docs/load-signals.md): every pod's load in fleet-wide units - its reported
    # running + waiting plus our requests since the reading, or own in-flight x the
    # K-estimate while unread - so K sidecars' bounded-load caps are one central router's.
    # Needs load_signals; load_report_saturation, when on, replaces it.
    load_fleet_view: bool = setting(
        True, "pick on the pods' reported running + waiting (all sidecars' requests)"
    )
    load_signal_max_age_s: float = setting(
        2.0, "seconds a pod's load reading counts; older = own in-flight only", check=POSITIVE
    )
    load_poll_interval_s: float = setting(
        0.5, "mean seconds between /metrics polls (jittered +-50 %)", check=POSITIVE
    )
    load_poll_sample: int = setting(
        2, "pods asked per poll, among those not heard from lately", check=NOT_NEGATIVE
    )
    load_poll_timeout_s: float = setting(0.5, "seconds one /metrics poll may take", check=POSITIVE)
    load_kv_threshold: float = setting(
        0.95, "KV usage (0-1) at which a pod counts as saturated", check=_fraction
    )
    # With home_kv_budget_tokens 0, the budget follows from the pods' vllm:cache_config_info
    # (the smallest reported KV size x this fraction; the rest is for in-flight requests).
    home_kv_fraction: float = setting(
        0.5,
        "share of the pods' smallest reported KV a pod is home to, when no budget is set; 0 = off",
        check=_fraction,
    )
    # Prefix sizes in tokens from a pod's own tokenizer at registration (vLLM's and
    # llama.cpp's shapes); empty = sized from bytes (bytes_per_token).
    tokenize_path: str = setting(
        "/tokenize", "POST path that counts a prefix's tokens; empty = bytes", check=_path_or_empty
    )
    vnodes: int = setting(
        0, "ring points per unit of weight; 0 = the core's default", check=_vnodes
    )
    # Routing contract section 8: the Maglev table moves a few more keys when a pod leaves
    # but its lookup is one modulo and its balance is near exact. Every sidecar of a fleet
    # must use the same table.
    hash_table: str = setting(
        "ring",
        "the routing table: ring (contract 3) or maglev (contract 8)",
        check=one_of(HASH_TABLES),
    )
    max_attempts: int = setting(
        3, "pods a request may try before its first token", check=AT_LEAST_ONE
    )
    warm_before_serve: bool = setting(True, "warm a joining pod's prefixes before it takes traffic")
    prewarm_concurrency: int = setting(4, "prewarm requests in flight at once", check=AT_LEAST_ONE)
    prewarm_attempts: int = setting(3, "tries of one prewarm", check=AT_LEAST_ONE)
    prewarm_backoff_s: float = setting(0.2, "seconds before a prewarm's retry", check=NOT_NEGATIVE)
    prewarm_timeout_s: float = setting(120.0, "seconds one prewarm may take", check=POSITIVE)

    max_prefix_bytes: int = setting(
        4 * 1024 * 1024, "largest prefix text a caller may register", check=AT_LEAST_ONE
    )
    max_input_bytes: int = setting(
        1024 * 1024, "largest thin query or prompt of a request", check=AT_LEAST_ONE
    )
    max_prefixes: int = setting(1024, "most prefixes registered at once", check=AT_LEAST_ONE)
    max_message_bytes: int = setting(
        8 * 1024 * 1024, "largest gRPC message in either direction", check=AT_LEAST_ONE
    )

    upstream_timeout_s: float = setting(
        600.0, "seconds a whole completion may take", check=POSITIVE
    )
    first_token_timeout_s: float = setting(
        60.0, "seconds until a pod's first token, else the next pod", check=POSITIVE
    )
    connect_timeout_s: float = setting(2.0, "seconds to connect to a pod", check=POSITIVE)
    per_backend_connections: int = setting(
        512, "HTTP connections to one pod at most", check=AT_LEAST_ONE
    )
    api_key_env: str = setting(
        "PREFIX_SIDECAR_API_KEY", "env var holding the pods' API key (sent as a bearer token)"
    )
    api_key_file: str = setting(
        "", "file holding the pods' API key; wins over api_key_env", check=_existing_file
    )

    grace_s: float = setting(10.0, "seconds to drain streams after SIGTERM", check=NOT_NEGATIVE)
    policy: str = setting(
        "prefix_affinity", "the pick; the others are baselines for benchmarks", check=_policy
    )
    log_level: str = setting("info", "debug, info, warning or error", check=_log_level)
    log_format: str = setting(
        "text", "text, or json: one JSON object per line", check=one_of(LOG_FORMATS)
    )

    price_base: float = setting(2.0, "yuan per million uncached prompt tokens", check=NOT_NEGATIVE)
    price_cache: float = setting(0.2, "yuan per million cached prompt tokens", check=NOT_NEGATIVE)
    price_out: float = setting(6.0, "yuan per million output tokens", check=NOT_NEGATIVE)

    prefixes: tuple[PrefixSpec, ...] = setting(
        (),
        "prefixes registered (and warmed) at start: NAME=FILE[:REPLICAS] or {name, file, replicas}",
        flag="--prefix",
        metavar="NAME=FILE[:REPLICAS]",
        repeat=True,
        parse=_prefixes,
    )

    @property
    def socket_path(self) -> str:
        """The unix socket path of `listen` (empty when listening on TCP only)."""
        return self.listen[len("unix://") :] if self.listen.startswith("unix://") else ""

    def api_key(self) -> str:
        """The upstream API key, from the file if set, else from the env var; never logged."""
        if self.api_key_file:
            return Path(self.api_key_file).read_text(encoding="utf-8").strip()
        return os.environ.get(self.api_key_env, "").strip()


DEFAULTS = Config()  # the defaults components take when built without a Config
FIELDS = fields.table(Config)


def _fail(name: str, reason: str) -> ConfigError:
    return ConfigError(f"config field {name!r} {reason}")


def _validate(config: Config) -> Config:
    fields.validate(config, lambda name, reason: f"config field {name!r} {reason}")
    if _openai_needs_tls(config.openai_listen) and not (
        config.tls_cert_file and config.tls_key_file
    ):
        raise _fail(
            "openai_listen",
            "is not a loopback address: it needs tls_cert_file and tls_key_file",
        )
    if config.tcp_listen or _openai_needs_tls(config.openai_listen):
        # The TLS files matter only with a TCP listener off loopback.
        if not (config.tls_cert_file and config.tls_key_file):
            raise _fail(
                "tcp_listen",
                "needs tls_cert_file and tls_key_file: the TCP listener only serves TLS",
            )
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            reason = _existing_file(getattr(config, name))
            if reason is not None:
                raise _fail(name, reason)
        if config.tls_client_ca_file and not config.tls_cert_file:
            raise _fail("tls_client_ca_file", "needs tls_cert_file and tls_key_file (mTLS)")
    names = [p.name for p in config.prefixes]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise _fail("prefixes", f"has duplicate names {sorted(duplicates)}")
    return config


def _openai_needs_tls(listen: str) -> bool:
    if not listen or listen.startswith("unix://"):
        return False
    return not is_loopback_host(split_host_port(listen)[0])


def build_config(
    file_values: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge file < env < overrides (flags) into a validated Config."""
    values: dict[str, Any] = {}
    _merge(values, file_values or {}, "config file")
    for key, raw in (env or {}).items():
        name = key[len(ENV_PREFIX) :].lower() if key.startswith(ENV_PREFIX) else ""
        if name in FIELDS:  # other PREFIX_SIDECAR_* vars (the API key) are not fields
            values[name] = fields.coerce(FIELDS[name], raw)
    _merge(values, overrides or {}, "flags")
    return _validate(Config(**values))


def _merge(values: dict[str, Any], source: Mapping[str, Any], source_name: str) -> None:
    for name, raw in source.items():
        if name not in FIELDS:
            raise ConfigError(
                f"unknown config field {name!r} in the {source_name}; "
                f"known fields: {', '.join(sorted(FIELDS))}"
            )
        values[name] = fields.coerce(FIELDS[name], raw)


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
    for name, entry in FIELDS.items():
        if entry.spec.verbatim and isinstance(data.get(name), int):
            # YAML reads `socket_mode: 440` as decimal 440 (0o670) but `0660` as octal: take
            # the digits as written, so every spelling of a mode means what a chmod user expects.
            data[name] = _raw_scalar(text, name)
    return data


def _raw_scalar(text: str, key: str) -> str:
    root = yaml.compose(text)
    for key_node, value_node in getattr(root, "value", ()):
        if getattr(key_node, "value", None) == key and isinstance(value_node, yaml.ScalarNode):
            return str(value_node.value)
    raise ConfigError(f"config field {key!r}: cannot read its value")  # pragma: no cover


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for `serve`, from the table; every field can also be set in the file or the env."""
    parser.add_argument("--config", help="YAML config file")
    fields.add_flags(parser, Config, typed=False)
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
    overrides = fields.given(args, Config)
    for setting_text in getattr(args, "settings", []) or []:
        name, sep, value = setting_text.partition("=")
        if not sep:
            raise ConfigError(f"--set {setting_text!r} must look like FIELD=VALUE")
        name = name.strip()
        entry = FIELDS.get(name)
        if entry is not None and entry.spec.verbatim:  # octal text, as chmod reads it
            overrides[name] = value
        else:
            overrides[name] = yaml.safe_load(value) if value else ""
    return build_config(file_values, os.environ if env is None else env, overrides)


def describe(config: Config) -> dict[str, Any]:
    """The config as plain data, for logs and `serve --print-config`; no secrets in it."""
    data = dataclasses.asdict(config)
    data["socket_mode"] = oct(config.socket_mode)
    return data


def field_names() -> Sequence[str]:
    return sorted(FIELDS)
