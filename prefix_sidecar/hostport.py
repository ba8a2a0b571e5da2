"""The one parser of `host:port` text: listeners, DNS targets and DNS nameservers.

An IPv6 host is written in brackets when a port follows ("[fd00::1]:53"); without brackets,
text with more than one colon is a bare IPv6 address and has no port, so "fd00::1" is never
misread as host "fd00:" port 1.
"""

from __future__ import annotations

import ipaddress

MAX_PORT = 65535


def split_host_port(
    text: str, *, default_port: int | None = None, example: str = "'10.0.0.5:8000'"
) -> tuple[str, int]:
    """(host, port) from "host:port", "[v6]:port" or, when default_port is given, a bare host.

    The host comes back without brackets. Raises ValueError saying what is wrong, with
    `example` as the shape to follow.
    """
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not text; expected host:port, e.g. {example}")
    stripped = text.strip()
    if "://" in stripped:
        raise ValueError(f"{text!r} must be host:port without a scheme, e.g. {example}")
    host, port_text = _split(stripped)
    if not host:
        raise ValueError(f"{text!r} has no host; expected host:port, e.g. {example}")
    if port_text is None:
        if default_port is None:
            hint = "; write an IPv6 host as [address]:port" if ":" in host else ""
            raise ValueError(f"{text!r} has no port{hint}; expected host:port, e.g. {example}")
        return host, default_port
    if not port_text.isdigit() or not 1 <= int(port_text) <= MAX_PORT:
        raise ValueError(f"{text!r}: port {port_text!r} must be 1-{MAX_PORT}, e.g. {example}")
    return host, int(port_text)


def _split(text: str) -> tuple[str, str | None]:
    """Host and port text (None when there is no port); brackets are removed."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: an IPv6 host needs its closing ']' before ':port'")
        return host, rest[1:] if rest else None
    if text.count(":") > 1:
        return text, None  # a bare IPv6 address; with a port it must be bracketed
    host, colon, port = text.rpartition(":")
    return (host, port) if colon else (text, None)


def is_loopback_host(host: str) -> bool:
    """localhost or a loopback address (127.0.0.0/8, ::1); a name that resolves is not
    trusted to stay loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
