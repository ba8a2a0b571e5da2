"""Which pods there are and whether they are healthy: the static list, the watched file or
DNS name, and the active health checks that take a failing pod out."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefix_sidecar.config.checks import ConfigError, absolute_path, as_list
from prefix_sidecar.fields import above, at_least, setting
from prefix_sidecar.hostport import split_host_port


def _backends(name: str, value: Any) -> tuple[tuple[str, int], ...]:
    where = f"config field {name!r}"
    backends = []
    for index, entry in enumerate(as_list(name, value)):
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


def _nameserver(value: str) -> str | None:
    if not value:
        return None
    try:
        ipaddress.ip_address(split_host_port(value, default_port=53)[0])
    except ValueError:
        return f"must be IP[:PORT], e.g. '10.96.0.10' or '[fd00::a]:53', got {value!r}"
    return None


def _redis_url(value: str) -> str | None:
    if not value:
        return None
    scheme, _, rest = value.partition("://")
    if scheme not in ("redis", "rediss", "unix") or not rest:
        return f"must be redis://HOST:PORT (or rediss://, unix://), got {value[:100]!r}"
    return None


@dataclass(frozen=True)
class MembershipSettings:
    """The pods and their health checks."""

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
    dns_interval_s: float = setting(5.0, "seconds between DNS lookups", check=above(0))
    file_interval_s: float = setting(1.0, "seconds between backends_file reads", check=above(0))
    # Members at 0.0.0.0/::, link-local (169.254.0.0/16: cloud metadata; fe80::/10), multicast
    # or broadcast addresses are refused with a warning unless this is true.
    allow_special_backend_addresses: bool = setting(
        False,
        "accept members at 0.0.0.0, ::, link-local, multicast or broadcast addresses",
        flag="--allow-special-backend-addresses",
    )

    health_path: str = setting(
        "/health", "GET path of active health checks", flag="--health-path", check=absolute_path
    )
    health_interval_s: float = setting(1.0, "seconds between a pod's health checks", check=above(0))
    health_timeout_s: float = setting(1.0, "seconds a health check may take", check=above(0))
    eject_after_failures: int = setting(
        3, "consecutive failures that take a pod out", check=at_least(1)
    )
    kv_events: bool = setting(
        False,
        "follow each pod's KV cache events (vLLM --kv-events-config, found from its "
        "GET /kv_event_sources)",
    )
    kv_index_url: str = setting(
        "",
        "redis://HOST:PORT of the shared block index (prefix-sidecar kv-indexer): precise "
        "routing asks it instead of following every pod",
        check=_redis_url,
    )
    reprewarm_interval_s: float = setting(
        30.0,
        "with kv_events: the least seconds between two prewarms of one registered prefix on "
        "one home pod that lost it; a loss sooner is counted as throttled",
        check=above(0),
    )
