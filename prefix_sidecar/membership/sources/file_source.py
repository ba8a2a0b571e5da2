"""A YAML/JSON backend file (a ConfigMap volume, typically), re-read every interval.

Read as untrusted bytes: only a regular file, at most MAX_BACKENDS_FILE_BYTES, in its own
daemon thread for at most FILE_READ_TIMEOUT_S, so a FIFO, /dev/zero or a hung mount costs
one logged error and never the event loop or the process's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from prefix_sidecar.config import DEFAULTS
from prefix_sidecar.membership.sources.base import MembershipSource
from prefix_sidecar.membership.sources.members import (
    Member,
    MembershipError,
    admit,
    sorted_members,
)


def parse_backends_document(text: str, source: str) -> list[Member]:
    """Parse a YAML/JSON backend list: ["url", {url, weight}, ...] or {backends: [...]}."""
    try:
        doc: Any = yaml.safe_load(text)  # JSON is YAML, so one parser reads both
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML or JSON: {exc}") from None
    shape = "a list of backend URLs, or a mapping {backends: [...]}"
    if doc is None:
        raise ValueError(f"{source}: the document is empty; expected {shape}")
    if isinstance(doc, dict):
        unknown = sorted(str(k) for k in doc if k != "backends")
        if unknown:
            raise ValueError(f"{source}: unknown top-level key(s) {unknown}; expected {shape}")
        if "backends" not in doc:
            raise ValueError(f"{source}: missing 'backends'; expected {shape}")
        doc = doc["backends"]
    if not isinstance(doc, list):
        raise ValueError(f"{source}: got {type(doc).__name__}; expected {shape}")
    members: list[Member] = []
    first_index: dict[str, int] = {}
    for index, entry in enumerate(doc):
        where = f"{source}: backends[{index}]"
        member = _parse_entry(entry, where)
        if member.url in first_index:
            raise ValueError(
                f"{where}: duplicate backend {member.url} "
                f"(already listed at backends[{first_index[member.url]}])"
            )
        first_index[member.url] = index
        members.append(member)
    return members


def _parse_entry(entry: Any, where: str) -> Member:
    if isinstance(entry, str):
        url, weight = entry, 1
    elif isinstance(entry, dict):
        unknown = sorted(str(k) for k in entry if k not in ("url", "weight"))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: url, weight")
        if "url" not in entry:
            raise ValueError(f"{where}: missing field 'url'")
        url, weight = entry["url"], entry.get("weight", 1)
        if not isinstance(url, str):
            raise ValueError(f"{where}: field 'url' must be a string, got {url!r}")
        if isinstance(weight, bool) or not isinstance(weight, int):
            raise ValueError(f"{where}: field 'weight' must be an integer, got {weight!r}")
    else:
        raise ValueError(
            f"{where}: expected a URL string or a {{url, weight}} mapping, "
            f"got {type(entry).__name__} {entry!r}"
        )
    try:
        return Member(url, weight)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


# A backend list is a few KB; anything near this is a mistake or an attack.
MAX_BACKENDS_FILE_BYTES = 1024 * 1024
FILE_READ_TIMEOUT_S = 5.0


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a special file"


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; anything else raises OSError.

    O_NONBLOCK: opening a FIFO must not wait for a writer. The size is checked before the
    read, and the read is capped in case the file grows meanwhile.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"it is {_file_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, over the {limit}-byte limit")
        with open(fd, "rb", closefd=False) as file:
            data = file.read(limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"it grew over the {limit}-byte limit while read")
        return data
    finally:
        os.close(fd)


def _in_daemon_thread(read: Callable[[], bytes]) -> asyncio.Future[bytes]:
    """Start a blocking read in its own daemon thread; its future holds the outcome.

    Not asyncio.to_thread: a read stuck in the kernel (a hung network mount) would hold a
    default-executor thread, and asyncio.run waits for those at exit, so SIGTERM would no
    longer end the process. A stuck daemon thread is left behind instead.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[bytes] = loop.create_future()
    # Retrieved even when nobody waits any more (a read that outlived its timeout).
    future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def deliver(result: bytes, error: Exception | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = b"", None
        try:
            result = read()
        except Exception as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=run, name="backends-file-read", daemon=True).start()
    return future


class FileSource(MembershipSource):
    """A YAML/JSON backend file, re-read every interval_s within the module's bounds.

    Changes are detected by content, not mtime: a ConfigMap volume swaps a `..data` symlink,
    which the path's own mtime does not show. While a read is stuck, no second one starts.
    """

    def __init__(
        self,
        path: str | Path,
        interval_s: float = DEFAULTS.file_interval_s,
        allow_special: bool = False,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"file source interval_s must be > 0, got {interval_s}")
        self.path = Path(path)
        self.interval_s = interval_s
        self.allow_special = allow_special
        self._warned: set[str] = set()
        self._cached_bytes: bytes | None = None
        self._cached: list[Member] | str = ""  # parsed members, or the parse error text
        self._stuck: asyncio.Future[bytes] | None = None
        self.read_timeout_s = FILE_READ_TIMEOUT_S

    @property
    def description(self) -> str:
        return f"file {self.path}"

    async def _read(self) -> bytes:
        where = f"cannot read backends file {self.path}"
        if self._stuck is not None and not self._stuck.done():
            raise MembershipError(f"{where}: an earlier read is still stuck")
        reading = _in_daemon_thread(lambda: read_regular_file(self.path, MAX_BACKENDS_FILE_BYTES))
        try:
            async with asyncio.timeout(self.read_timeout_s):
                return await asyncio.shield(reading)
        except TimeoutError:
            self._stuck = reading
            raise MembershipError(f"{where}: no answer within {self.read_timeout_s:g} s") from None
        except OSError as exc:
            raise MembershipError(f"{where}: {exc.strerror or exc}") from None

    async def resolve(self) -> list[Member]:
        data = await self._read()
        if data != self._cached_bytes:  # parse only when the content changed
            self._cached_bytes = data
            try:
                parsed = parse_backends_document(data.decode("utf-8"), str(self.path))
                self._cached = admit(
                    ((m, f"backend {m.url}") for m in parsed),
                    self.description,
                    self.allow_special,
                    self._warned,
                )
            except UnicodeDecodeError as exc:
                self._cached = f"backends file {self.path} is not UTF-8 text: {exc}"
            except ValueError as exc:
                self._cached = str(exc)
        if isinstance(self._cached, str):
            raise MembershipError(self._cached)
        return sorted_members(self._cached)
