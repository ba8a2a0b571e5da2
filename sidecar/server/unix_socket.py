"""The unix socket callers dial: stale files replaced safely, permissions 0660 by default.

A socket file left by a crashed sidecar would make bind() fail; deleting whatever is at the
path would let a typo delete a real file or steal a live sidecar's socket. So: a socket
nobody answers on is replaced, a live one or a non-socket is an error naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import socket
import stat
from collections.abc import Iterator


class SocketInUse(RuntimeError):
    pass


def prepare_socket_path(path: str) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUse(f"{path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # stale: its server is gone
            return
        raise SocketInUse(f"cannot check existing socket {path}: {exc}") from None
    finally:
        probe.close()
    raise SocketInUse(f"another process is listening on {path}; stop it or choose another path")


@contextlib.contextmanager
def restrictive_umask(mode: int) -> Iterator[None]:
    """Create the socket with no more than `mode` from the start (no window at 0777)."""
    previous = os.umask(0o777 & ~mode)
    try:
        yield
    finally:
        os.umask(previous)


def apply_socket_permissions(path: str, mode: int, group: str) -> None:
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise ValueError(f"config field 'socket_group': no group named {group!r}") from None
        os.chown(path, -1, gid)
    os.chmod(path, mode)
