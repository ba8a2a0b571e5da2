"""Backend membership: where the pod list comes from (sources) and who may serve (health)."""

from prefix_sidecar.membership.health import HealthMonitor, MemberStatus
from prefix_sidecar.membership.sources import (
    CombinedSource,
    DnsSource,
    FileSource,
    Member,
    MembershipError,
    MembershipSource,
    StaticSource,
    canonical_backend_url,
    parse_backends_document,
    parse_dns_target,
)

__all__ = [
    "CombinedSource",
    "DnsSource",
    "FileSource",
    "HealthMonitor",
    "Member",
    "MemberStatus",
    "MembershipError",
    "MembershipSource",
    "StaticSource",
    "canonical_backend_url",
    "parse_backends_document",
    "parse_dns_target",
]
