"""All A and AAAA records of a DNS name (a headless Service), each as one backend."""

from __future__ import annotations

import asyncio
import ipaddress

import dns.asyncresolver
import dns.exception
import dns.name
import dns.resolver

from prefix_sidecar.config import DEFAULTS
from prefix_sidecar.hostport import split_host_port
from prefix_sidecar.membership.sources.base import MembershipSource
from prefix_sidecar.membership.sources.members import (
    DEFAULT_PORTS,
    Member,
    MembershipError,
    admit,
    canonical_backend_url,
    sorted_members,
)


def parse_dns_target(text: str) -> tuple[str, int]:
    """Split "vllm-headless.llm.svc.cluster.local:8000" into (name, port)."""
    example = "'vllm-headless.llm.svc.cluster.local:8000'"
    try:
        name, port = split_host_port(text, example=example)
    except ValueError as exc:
        raise ValueError(f"DNS target: {exc}") from None
    if ":" in name or "/" in name or " " in name:
        raise ValueError(f"DNS target {text!r}: {name!r} is not a DNS name, e.g. {example}")
    return name, port


class DnsSource(MembershipSource):
    """All A and AAAA records of a (headless Service) name, each as one backend.

    A headless Service answers with one record per ready pod, so re-resolving every
    interval_s follows scale-ups, restarts and readiness without a Kubernetes client.
    """

    def __init__(
        self,
        name: str,
        port: int,
        scheme: str = "http",
        interval_s: float = DEFAULTS.dns_interval_s,
        nameserver: str | None = None,
        nameserver_port: int = 53,
        timeout_s: float = 2.0,
        allow_special: bool = False,
    ) -> None:
        self.allow_special = allow_special
        self._warned: set[str] = set()
        if scheme not in DEFAULT_PORTS:
            raise ValueError(f"DNS source scheme {scheme!r}; use http or https")
        if not 1 <= port <= 65535:
            raise ValueError(f"DNS source port {port} must be 1-65535")
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError("DNS source interval_s and timeout_s must be > 0")
        try:
            dns.name.from_text(name)
        except dns.exception.DNSException as exc:
            raise ValueError(f"DNS source name {name!r} is not a valid DNS name: {exc}") from None
        self.name, self.port, self.scheme = name, port, scheme
        self.interval_s = interval_s
        try:
            self._resolver = dns.asyncresolver.Resolver(configure=nameserver is None)
        except dns.exception.DNSException as exc:
            raise MembershipError(
                f"cannot read the system DNS configuration ({exc}); pass an explicit nameserver"
            ) from None
        if nameserver is not None:
            try:
                ipaddress.ip_address(nameserver)
            except ValueError:
                raise ValueError(
                    f"DNS nameserver {nameserver!r} must be an IP address, e.g. '10.96.0.10'"
                ) from None
            self._resolver.nameservers = [nameserver]
            self._resolver.port = nameserver_port
        self._resolver.timeout = timeout_s
        self._resolver.lifetime = timeout_s
        # With the system resolv.conf, short names ("vllm-headless") go through the pod's
        # search domains, as they would for any other program in the pod.
        self._search = nameserver is None
        servers = ", ".join(str(ns) for ns in self._resolver.nameservers)
        self._server_text = f"{servers} port {self._resolver.port}"

    @property
    def description(self) -> str:
        return f"DNS {self.name}:{self.port}"

    async def resolve(self) -> list[Member]:
        v4, v6 = await asyncio.gather(self._addresses("A"), self._addresses("AAAA"))
        records = {
            canonical_backend_url(f"{self.scheme}://{ip}:{self.port}"): f"A record {ip}"
            for ip in v4
        }
        records |= {
            canonical_backend_url(f"{self.scheme}://[{ip}]:{self.port}"): f"AAAA record {ip}"
            for ip in v6
        }
        members = ((Member(url), f"{text} of {self.name}") for url, text in records.items())
        return sorted_members(admit(members, self.description, self.allow_special, self._warned))

    async def _addresses(self, rdtype: str) -> list[str]:
        try:
            answer = await self._resolver.resolve(self.name, rdtype, search=self._search)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []  # normal: e.g. an IPv4-only cluster has no AAAA
        except dns.exception.DNSException as exc:
            raise MembershipError(
                f"DNS {rdtype} lookup of {self.name!r} via {self._server_text} failed: {exc}"
            ) from None
        return [rdata.address for rdata in answer]
