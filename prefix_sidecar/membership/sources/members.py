"""What every source emits: a `Member` with a canonical url, and the check that refuses
addresses that cannot be pods.

Every sidecar must hash over the *same* member ids, so every url goes through
`canonical_backend_url` ("http://10.0.0.5:8000", never "10.0.0.5:8000/" or "HTTP://...").
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from prefix_sidecar._core_py import MAX_WEIGHT  # the routing contract's bound, in both cores

logger = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?$")
_EXAMPLE = "e.g. 'http://10.0.0.5:8000'"


class MembershipError(Exception):
    """A source could not produce a membership (unreadable file, DNS failure, ...)."""


def canonical_backend_url(raw: str) -> str:
    """Return the one spelling of a backend every sidecar agrees on: scheme://host:port."""
    if not isinstance(raw, str):
        raise ValueError(f"backend {raw!r} is a {type(raw).__name__}; expected a URL, {_EXAMPLE}")
    text = raw.strip()
    if not text:
        raise ValueError(f"backend URL is empty; expected a URL, {_EXAMPLE}")
    if "://" not in text:
        text = "http://" + text  # "10.0.0.5:8000" and "vllm-0:8000" mean plain http
    netloc = text.split("://", 1)[1].split("/", 1)[0]
    if "@" in netloc:
        raise ValueError(f"backend {raw!r} contains credentials (user@); remove them")
    if netloc.count(":") > 1 and "[" not in netloc:
        raise ValueError(
            f"backend {raw!r}: put IPv6 addresses in brackets, e.g. 'http://[fd00::1]:8000'"
        )
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"backend {raw!r} is not a valid URL ({exc}); {_EXAMPLE}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise ValueError(f"backend {raw!r} has scheme {scheme!r}; use http or https")
    if parts.path not in ("", "/"):
        raise ValueError(
            f"backend {raw!r} has a path {parts.path!r}; give only scheme://host:port "
            "(the sidecar adds /v1/... itself)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"backend {raw!r} has a query or fragment; give only scheme://host:port")
    host = _canonical_host(parts.hostname or "", raw)
    if port is None:
        port = DEFAULT_PORTS[scheme]
    if not 1 <= port <= 65535:
        raise ValueError(f"backend {raw!r} has port {port}; use 1-65535")
    return f"{scheme}://{host}:{port}"


def _canonical_host(host: str, raw: str) -> str:
    if not host:
        raise ValueError(f"backend {raw!r} has no host; {_EXAMPLE}")
    if ":" in host:
        if "%" in host:
            raise ValueError(f"backend {raw!r}: IPv6 zone ids (%...) are host-local; drop it")
        try:
            return f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError:
            raise ValueError(f"backend {raw!r} has an invalid IPv6 address {host!r}") from None
    if re.fullmatch(r"[0-9.]+", host):
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise ValueError(f"backend {raw!r} has an invalid IPv4 address {host!r}") from None
    name = host.lower().rstrip(".")  # "pod.svc." and "pod.svc" are the same host
    labels = name.split(".")
    if len(name) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise ValueError(f"backend {raw!r} has an invalid host name {host!r}")
    return name


@dataclass(frozen=True)
class Member:
    """One backend pod: its canonical url (the ring id) and its relative weight."""

    url: str
    weight: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, int):
            raise ValueError(
                f"backend {self.url!r}: weight must be an integer, got {self.weight!r}"
            )
        if not 1 <= self.weight <= MAX_WEIGHT:
            raise ValueError(
                f"backend {self.url!r}: weight must be 1-{MAX_WEIGHT}, got {self.weight}"
            )
        canonical = canonical_backend_url(self.url)
        if canonical != self.url:
            object.__setattr__(self, "url", canonical)


def sorted_members(members: Iterable[Member]) -> list[Member]:
    return sorted(members, key=lambda m: m.url)


_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
ALLOW_FIELD = "allow_special_backend_addresses"


def special_address(url: str) -> str | None:
    """Why a member's address cannot be a pod, or None. Loopback stays allowed; a host name
    is resolved at connect time and not judged here."""
    try:
        ip = ipaddress.ip_address(urlsplit(url).hostname or "")
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return "an unspecified address (0.0.0.0 or ::), which reaches this host itself"
    if ip.is_link_local:
        return "a link-local address (169.254.169.254 is the cloud metadata service)"
    if ip.is_multicast:
        return "a multicast address"
    if ip == _BROADCAST:
        return "the broadcast address"
    return None


def admit(
    records: Iterable[tuple[Member, str]], source: str, allow: bool, warned: set[str]
) -> list[Member]:
    """The members whose address may be a pod; each refused record is warned about once
    (`warned` remembers them across polls: a file or DNS name is re-read every few seconds)."""
    kept = []
    refused = set()
    for member, record in records:
        reason = None if allow else special_address(member.url)
        if reason is None:
            kept.append(member)
            continue
        refused.add(record)
        if record not in warned:
            logger.warning(
                "membership source %s: refusing %s: %s; set %s to accept it",
                source,
                record,
                reason,
                ALLOW_FIELD,
            )
    warned.clear()
    warned.update(refused)
    return kept
