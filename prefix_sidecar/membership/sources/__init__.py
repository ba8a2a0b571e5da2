"""Where the backend list comes from: static flags, a YAML/JSON file, or DNS.

One module per source (static_source, file_source, dns_source); what they share is the
`Member` they emit (members) and the watch loop that keeps each source's last good answer
(base). Every name callers use is importable from here.
"""

from prefix_sidecar._core_py import MAX_WEIGHT
from prefix_sidecar.membership.sources.base import CombinedSource, MembershipSource
from prefix_sidecar.membership.sources.dns_source import DnsSource, parse_dns_target
from prefix_sidecar.membership.sources.file_source import FileSource, parse_backends_document
from prefix_sidecar.membership.sources.members import (
    Member,
    MembershipError,
    canonical_backend_url,
    special_address,
)
from prefix_sidecar.membership.sources.static_source import StaticSource

__all__ = [
    "MAX_WEIGHT",
    "CombinedSource",
    "DnsSource",
    "FileSource",
    "Member",
    "MembershipError",
    "MembershipSource",
    "StaticSource",
    "canonical_backend_url",
    "parse_backends_document",
    "parse_dns_target",
    "special_address",
]
