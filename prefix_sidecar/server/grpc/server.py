"""The grpc.aio server of one sidecar: its limits against hostile callers, its services
(Router, health, reflection) and its TCP listener with TLS.

The limits are server options, each beside the measurement that chose it (docs/RELIABILITY.md).
The sidecar binds the unix socket itself, under a umask that keeps the file never more open
than `socket_mode` (prefix_sidecar.server.common.unix_socket).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from prefix_sidecar.config import Config
from prefix_sidecar.server.common import connections, tls
from prefix_sidecar.server.grpc.handlers import SERVICE, add_router_servicer
from prefix_sidecar.server.grpc.servicer import RouterServicer


def grpc_server(max_message_bytes: int) -> grpc.aio.Server:
    """A server whose every queue and connection count is bounded."""
    return grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Hostile-caller limits, measured with `prefix-sidecar attack`.
            # HTTP/2 rapid reset: each reset stream is still a call (~30 KB in core's pending
            # queue) and counts here until freed. Not lower: a legitimate 2,500-call burst on
            # one channel must pass (256 and 1,024 refused it with REFUSED_STREAM).
            ("grpc.max_concurrent_streams", 4096),
            # The pending queue bounded at ~150 MB (soft = hard: nothing shed at random
            # below); a call unrequested for 10 s is dropped in C. Not 1 s: a loaded 2-core
            # box takes a legitimate 2,500-call burst in seconds.
            ("grpc.server.max_pending_requests", 5_000),
            ("grpc.server.max_pending_requests_hard_limit", 5_000),
            ("grpc.server_max_unrequested_time_in_server", 10),
            # grpc's metadata defaults, pinned: a CONTINUATION flood is cut at the hard limit.
            ("grpc.max_metadata_size", 8 * 1024),
            ("grpc.absolute_max_metadata_size", 16 * 1024),
            # A connection that never sends its preface holds an fd (120 s by default); a
            # local caller needs milliseconds.
            ("grpc.server_handshake_timeout_ms", 20_000),
            # Each connection holds an fd and ~40 KB: capped below the fd limit, shared with
            # the HTTP front (server.common.connections). Callers need a handful each.
            ("grpc.max_allowed_incoming_connections", connections.front_cap(fronts=2)),
            # Idle 10 minutes: closed (clients reconnect). Ping abuse: grpc's default 2 strikes.
            ("grpc.max_connection_idle_ms", 600_000),
        ]
    )


def add_services(
    server: grpc.aio.Server,
    servicer: RouterServicer,
    health_servicer: health_aio.HealthServicer,
) -> None:
    """The Router, grpc.health.v1 and reflection naming both."""
    add_router_servicer(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )


def add_tcp_port(server: grpc.aio.Server, config: Config) -> int | None:
    """The TCP listener with TLS when `tcp_listen` is set (with a client CA, callers must
    show a certificate it signed); its port, or None."""
    if not config.tcp_listen:
        return None
    key, cert, client_ca = tls.grpc_files(
        config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
    )  # checked: a bad file is named
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
    return server.add_secure_port(config.tcp_listen, credentials)
