"""What a sidecar reads from its config before it serves: the membership source its
backend fields name.

It fails as ValueError with the field in the message, so a bad config stops the start with a
line an operator can act on, before any socket or session is opened.
"""

from __future__ import annotations

from prefix_sidecar.config import Config
from prefix_sidecar.hostport import split_host_port
from prefix_sidecar.membership.sources.base import CombinedSource, MembershipSource
from prefix_sidecar.membership.sources.dns_source import DnsSource, parse_dns_target
from prefix_sidecar.membership.sources.file_source import FileSource
from prefix_sidecar.membership.sources.members import Member
from prefix_sidecar.membership.sources.static_source import StaticSource


def membership_source(config: Config) -> MembershipSource:
    """The static backends, the backends file and the DNS name, combined when several."""
    sources: list[MembershipSource] = []
    allow_special = config.allow_special_backend_addresses
    if config.backends:
        members = [Member(url, weight) for url, weight in config.backends]
        sources.append(StaticSource(members, allow_special=allow_special))
    if config.backends_file:
        sources.append(FileSource(config.backends_file, config.file_interval_s, allow_special))
    if config.backends_dns:
        name, port = parse_dns_target(config.backends_dns)
        nameserver, nameserver_port = None, 53
        if config.dns_nameserver:
            nameserver, nameserver_port = split_host_port(config.dns_nameserver, default_port=53)
        sources.append(
            DnsSource(
                name,
                port,
                interval_s=config.dns_interval_s,
                nameserver=nameserver,
                nameserver_port=nameserver_port,
                allow_special=allow_special,
            )
        )
    if not sources:
        raise ValueError(
            "no backends configured: give --backend URL, --backends-file or --backends-dns"
        )
    return sources[0] if len(sources) == 1 else CombinedSource(sources)
