"""The unix socket callers dial: stale files replaced safely, permissions 0660 by default.

A socket nobody answers on (a crashed sidecar's) is replaced; a live one or a non-socket is
an error naming the path, so a typo cannot delete a real file or steal a live socket.

In an overlapping restart the new sidecar binds the path while the old one drains, so on exit
a sidecar removes the path only if it is still the file it bound: same device, inode and
change time (grpc unlinks the old file on stop, and its inode number may be reused).

Directories it creates are 0750 whatever the umask; a directory on the way that anyone may
write without the sticky bit is refused: anyone could swap the socket (or a directory) for
their own and read every prompt.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import socket
import stat
from collections.abc import Iterator

DIRECTORY_MODE = 0o750


class SocketPathError(RuntimeError):
    """The socket path cannot be used; the message names the path and what to do."""


class SocketInUse(SocketPathError):
    pass


class UnsafeSocketDirectory(SocketPathError):
    pass


SocketIdentity = tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns) of the socket file


def make_socket_directory(directory: str) -> None:
    """Create the missing levels of `directory` 0750 each (chmod after mkdir: the umask may
    be 000), then refuse it if it or a directory above it is world-writable, not sticky."""
    missing = []
    level = os.path.abspath(directory)
    while not os.path.lexists(level):
        missing.append(level)
        level = os.path.dirname(level)
    for level in reversed(missing):
        try:
            os.mkdir(level, DIRECTORY_MODE)
        except FileExistsError:
            continue  # made by someone else meanwhile: checked below like any other
        os.chmod(level, DIRECTORY_MODE)
    check_socket_directory(directory)


def check_socket_directory(directory: str) -> None:
    level = os.path.realpath(directory)
    while True:
        mode = os.stat(level).st_mode
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise UnsafeSocketDirectory(
                f"socket directory {level} is world-writable without the sticky bit "
                f"(mode {stat.S_IMODE(mode):04o}): anyone could replace the socket; run "
                f"'chmod o-w {level}' (or 'chmod +t {level}'), or choose a socket path in "
                "another directory"
            )
        parent = os.path.dirname(level)
        if parent == level:
            return
        level = parent


class SocketFile:
    """One listener's socket file from start to exit: the path made safe to bind (`prepare`),
    the file created no more open than `mode` (bind inside `creating`, then `bound`), its
    mode and group set (`secure`), and on exit removed only if it is still ours (`remove`)."""

    def __init__(self, path: str, mode: int, group: str) -> None:
        self.path = path
        self.mode = mode
        self.group = group
        self.identity: SocketIdentity | None = None

    def prepare(self) -> None:
        path = self.path
        make_socket_directory(os.path.dirname(path) or ".")
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise SocketInUse(
                f"{path} exists and is not a socket; remove it or choose another path"
            )
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
    def creating(self) -> Iterator[None]:
        """Create the socket with no more than `mode` from the start (no window at 0777)."""
        previous = os.umask(0o777 & ~self.mode)
        try:
            yield
        finally:
            os.umask(previous)

    def bound(self) -> None:
        """Remember the file just bound, right after bind."""
        self.identity = self._identity()

    def secure(self) -> None:
        if self.group:
            try:
                gid = grp.getgrnam(self.group).gr_gid
            except KeyError:
                raise ValueError(
                    f"config field 'socket_group': no group named {self.group!r}"
                ) from None
            os.chown(self.path, -1, gid)
        os.chmod(self.path, self.mode)
        self.identity = self._identity()  # chmod and chown move the change time

    def remove(self) -> None:
        """Unlink the path only if it is still the socket this process bound."""
        if self.identity is not None:
            with contextlib.suppress(FileNotFoundError):
                if self._identity() == self.identity:
                    os.unlink(self.path)
        self.identity = None

    def _identity(self) -> SocketIdentity:
        st = os.lstat(self.path)
        return st.st_dev, st.st_ino, st.st_ctime_ns
