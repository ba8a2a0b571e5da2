"""The TLS files of both TCP listeners, loaded so that a bad one is named.

OpenSSL says only "[SSL] PEM lib" for a bad certificate, a bad key or a mismatched pair, and
grpc says less: here a bad TLS file raises ValueError naming the file, its config field and
what is wrong (`prefix-sidecar serve` prints it and exits 2).
"""

from __future__ import annotations

import ssl
from pathlib import Path


def _read(field: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{field} {path}: cannot read it: {exc.strerror or exc}") from None


def _reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.args[-1] if exc.args else exc).replace("_", " ").lower()


def _check_certificate(field: str, path: str) -> None:
    try:
        ssl.create_default_context().load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(f"{field} {path}: not a PEM certificate ({_reason(exc)})") from None


def server_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    """A server context for the HTTP front; mTLS when `client_ca_file` is set."""
    for field, path in (("tls_cert_file", cert_file), ("tls_key_file", key_file)):
        _read(field, path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        _check_certificate("tls_cert_file", cert_file)
        raise ValueError(
            f"tls_key_file {key_file}: not the PEM private key of tls_cert_file {cert_file} "
            f"({_reason(exc)})"
        ) from None
    if client_ca_file:
        _read("tls_client_ca_file", client_ca_file)
        _check_certificate("tls_client_ca_file", client_ca_file)
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_files(cert_file: str, key_file: str, client_ca_file: str = "") -> tuple[
    bytes, bytes, bytes | None
]:  # fmt: skip
    """(key, certificate, client CA or None) for grpc.ssl_server_credentials, checked as
    server_context checks them (grpc would only fail later, and vaguely)."""
    server_context(cert_file, key_file, client_ca_file)
    key = _read("tls_key_file", key_file)
    cert = _read("tls_cert_file", cert_file)
    client_ca = _read("tls_client_ca_file", client_ca_file) if client_ca_file else None
    return key, cert, client_ca
