"""Where the sidecar listens: the gRPC unix socket, an optional TLS TCP listener and the
OpenAI HTTP front, with the files their TLS needs.

The cross-field rules (a listener off loopback needs a certificate and its key, and the files
must exist) are checked here at start, so a broken ConfigMap fails on the pod's first start.
"""

from __future__ import annotations

import grp
from dataclasses import dataclass
from typing import Any

from prefix_sidecar.config.checks import ConfigError, existing_file, fail, host_and_port
from prefix_sidecar.fields import setting
from prefix_sidecar.hostport import is_loopback_host, split_host_port

DEFAULT_SOCKET = "unix:///tmp/prefix-sidecar.sock"


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


def _openai_listen(value: str) -> str | None:
    if not value or _unix_url(value) is None:
        return None
    reason = host_and_port(value)
    return f"{reason} or unix:///path.sock" if reason else None


def _group(name: str) -> str | None:
    if not name:
        return None
    try:
        grp.getgrnam(name)
    except KeyError:
        # Checked here, not at chown time: by then the socket is bound and half started.
        return f"names no group on this host: {name!r}"
    return None


@dataclass(frozen=True)
class ListenSettings:
    """The listeners and their TLS."""

    listen: str = setting(
        DEFAULT_SOCKET, "the gRPC unix socket, unix:///path.sock", flag="--listen", check=_unix_url
    )
    socket_mode: int = setting(0o660, "the socket file's mode, octal", parse=_octal_mode)
    socket_group: str = setting("", "the socket file's group (must exist)", check=_group)
    tcp_listen: str = setting(
        "", "HOST:PORT of an extra TLS-only gRPC listener; empty = none", check=host_and_port
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

    @property
    def socket_path(self) -> str:
        """The unix socket path of `listen`."""
        return self.listen.removeprefix("unix://")


def check_listeners(config: ListenSettings) -> None:
    """A TCP listener, or the HTTP front off loopback, serves TLS only: both PEM files must
    be given and exist (and the client CA, for mTLS)."""
    openai_tls = _openai_needs_tls(config.openai_listen)
    has_pair = bool(config.tls_cert_file and config.tls_key_file)
    if openai_tls and not has_pair:
        raise fail(
            "openai_listen",
            "is not a loopback address: it needs tls_cert_file and tls_key_file",
        )
    if not (config.tcp_listen or openai_tls):
        return  # the TLS files matter only with a TCP listener off loopback
    if not has_pair:
        raise fail(
            "tcp_listen", "needs tls_cert_file and tls_key_file: the TCP listener only serves TLS"
        )
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        reason = existing_file(getattr(config, name))
        if reason is not None:
            raise fail(name, reason)


def _openai_needs_tls(listen: str) -> bool:
    if not listen or listen.startswith("unix://"):
        return False
    return not is_loopback_host(split_host_port(listen)[0])
