"""Where the backend list comes from: static flags, a YAML/JSON file, or DNS.

Every sidecar in the fleet must hash over the *same* member ids, so all sources emit
`Member` values whose url went through `canonical_backend_url` ("http://10.0.0.5:8000",
never "10.0.0.5:8000/" on one sidecar and "HTTP://10.0.0.5:8000" on another).

All sources share one watch loop (`_poll_sources`): it polls each source on its own
interval, keeps each source's last good answer, and only reports a change. An error, a
garbage file or an empty DNS answer is logged and the last good membership is kept: a
router that drops every backend because a ConfigMap was half-written, or because CoreDNS
hiccupped, turns a small fault into an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import math
import os
import re
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dns.asyncresolver
import dns.exception
import dns.name
import dns.resolver
import yaml

from prefix_sidecar._core_py import MAX_WEIGHT  # the routing contract's bound, in both cores
from prefix_sidecar.config import DEFAULTS
from prefix_sidecar.hostport import split_host_port

logger = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?$")
_EXAMPLE = "e.g. 'http://10.0.0.5:8000'"

UpdateCallback = Callable[[list["Member"]], None]


class MembershipError(Exception):
    """A source could not produce a membership (unreadable file, DNS failure, ...)."""


def canonical_backend_url(raw: str) -> str:
    """Return the one spelling of a backend every sidecar agrees on: scheme://host:port."""
    if not isinstance(raw, str):
        raise ValueError(f"backend {raw!r} is a {type(raw).__name__}; expected a URL, {_EXAMPLE}")
    text = raw.strip()
    if not text:
        raise ValueError(f"backend URL is empty; expected a URL, {_EXAMPLE}")
    if "://" not in text:
        text = "http://" + text  # "10.0.0.5:8000" and "vllm-0:8000" mean plain http
    netloc = text.split("://", 1)[1].split("/", 1)[0]
    if "@" in netloc:
        raise ValueError(f"backend {raw!r} contains credentials (user@); remove them")
    if netloc.count(":") > 1 and "[" not in netloc:
        raise ValueError(
            f"backend {raw!r}: put IPv6 addresses in brackets, e.g. 'http://[fd00::1]:8000'"
        )
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"backend {raw!r} is not a valid URL ({exc}); {_EXAMPLE}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise ValueError(f"backend {raw!r} has scheme {scheme!r}; use http or https")
    if parts.path not in ("", "/"):
        raise ValueError(
            f"backend {raw!r} has a path {parts.path!r}; give only scheme://host:port "
            "(the sidecar adds /v1/... itself)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"backend {raw!r} has a query or fragment; give only scheme://host:port")
    host = _canonical_host(parts.hostname or "", raw)
    if port is None:
        port = DEFAULT_PORTS[scheme]
    if not 1 <= port <= 65535:
        raise ValueError(f"backend {raw!r} has port {port}; use 1-65535")
    return f"{scheme}://{host}:{port}"


def _canonical_host(host: str, raw: str) -> str:
    if not host:
        raise ValueError(f"backend {raw!r} has no host; {_EXAMPLE}")
    if ":" in host:
        if "%" in host:
            raise ValueError(f"backend {raw!r}: IPv6 zone ids (%...) are host-local; drop it")
        try:
            return f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError:
            raise ValueError(f"backend {raw!r} has an invalid IPv6 address {host!r}") from None
    if re.fullmatch(r"[0-9.]+", host):
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise ValueError(f"backend {raw!r} has an invalid IPv4 address {host!r}") from None
    name = host.lower().rstrip(".")  # "pod.svc." and "pod.svc" are the same host
    labels = name.split(".")
    if len(name) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise ValueError(f"backend {raw!r} has an invalid host name {host!r}")
    return name


@dataclass(frozen=True)
class Member:
    """One backend pod: its canonical url (the ring id) and its relative weight."""

    url: str
    weight: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, int):
            raise ValueError(
                f"backend {self.url!r}: weight must be an integer, got {self.weight!r}"
            )
        if not 1 <= self.weight <= MAX_WEIGHT:
            raise ValueError(
                f"backend {self.url!r}: weight must be 1-{MAX_WEIGHT}, got {self.weight}"
            )
        canonical = canonical_backend_url(self.url)
        if canonical != self.url:
            object.__setattr__(self, "url", canonical)


def _sorted_members(members: Iterable[Member]) -> list[Member]:
    return sorted(members, key=lambda m: m.url)


_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
ALLOW_FIELD = "allow_special_backend_addresses"


def special_address(url: str) -> str | None:
    """Why a member's address cannot be a pod, or None. Loopback stays allowed; a host name
    is resolved at connect time and not judged here."""
    try:
        ip = ipaddress.ip_address(urlsplit(url).hostname or "")
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return "an unspecified address (0.0.0.0 or ::), which reaches this host itself"
    if ip.is_link_local:
        return "a link-local address (169.254.169.254 is the cloud metadata service)"
    if ip.is_multicast:
        return "a multicast address"
    if ip == _BROADCAST:
        return "the broadcast address"
    return None


def _admit(
    records: Iterable[tuple[Member, str]], source: str, allow: bool, warned: set[str]
) -> list[Member]:
    """The members whose address may be a pod; each refused record is warned about once
    (`warned` remembers them across polls: a file or DNS name is re-read every few seconds)."""
    kept = []
    refused = set()
    for member, record in records:
        reason = None if allow else special_address(member.url)
        if reason is None:
            kept.append(member)
            continue
        refused.add(record)
        if record not in warned:
            logger.warning(
                "membership source %s: refusing %s: %s; set %s to accept it",
                source,
                record,
                reason,
                ALLOW_FIELD,
            )
    warned.clear()
    warned.update(refused)
    return kept


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


class MembershipSource(ABC):
    """A place backends come from. `interval_s` is how often `watch` re-resolves it."""

    interval_s: float = math.inf

    @property
    @abstractmethod
    def description(self) -> str:
        """Short text naming the source in logs and errors."""

    @abstractmethod
    async def resolve(self) -> list[Member]:
        """Resolve once, sorted by url; raise MembershipError with a clear message on failure."""

    async def watch(self, on_update: UpdateCallback) -> None:
        """Call on_update with each new non-empty membership; run until cancelled."""
        await _poll_sources([self], on_update)


class StaticSource(MembershipSource):
    """Backends given on the command line or in code; never changes."""

    def __init__(self, members: Sequence[Member | str], allow_special: bool = False) -> None:
        parsed = [m if isinstance(m, Member) else Member(m) for m in members]
        if not parsed:
            raise ValueError("static backend list is empty; give at least one backend URL")
        urls = [m.url for m in parsed]
        duplicates = sorted({u for u in urls if urls.count(u) > 1})
        if duplicates:
            raise ValueError(f"static backend list repeats {duplicates}; list each once")
        kept = _admit(
            ((m, f"backend {m.url}") for m in parsed), "static list", allow_special, set()
        )
        if not kept:
            raise ValueError(
                f"every static backend was refused ({', '.join(urls)}): none can be a pod; "
                f"set {ALLOW_FIELD} to accept them"
            )
        self._members = _sorted_members(kept)

    @property
    def description(self) -> str:
        return f"static list ({len(self._members)} backends)"

    async def resolve(self) -> list[Member]:
        return list(self._members)


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
    """The bytes of a regular file of at most `limit` bytes; anything else is refused.

    O_NONBLOCK: opening a FIFO must not wait for a writer. A FIFO, a device (/dev/zero) or
    a socket would never end or never start; the size is checked before reading and the read
    is capped, in case the file grows meanwhile.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"it is {_file_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, over the {limit}-byte limit")
        chunks = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise OSError(errno.EFBIG, f"it grew over the {limit}-byte limit while read")
        return b"".join(chunks)
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
    """A YAML/JSON backend file, re-read every interval_s.

    Changes are detected by content, not mtime: a Kubernetes ConfigMap volume swaps a
    `..data` symlink to a new timestamped directory, so a watch on the mtime of the path
    itself misses the update. Reading a small file once a second costs ~nothing.

    Only a regular file of at most MAX_BACKENDS_FILE_BYTES is read, in a thread, for at most
    FILE_READ_TIMEOUT_S; anything else is an error (logged, the last good set kept). While a
    read is stuck, no second one is started.
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
        self.max_bytes = MAX_BACKENDS_FILE_BYTES
        self.read_timeout_s = FILE_READ_TIMEOUT_S

    @property
    def description(self) -> str:
        return f"file {self.path}"

    async def _read(self) -> bytes:
        where = f"cannot read backends file {self.path}"
        if self._stuck is not None and not self._stuck.done():
            raise MembershipError(f"{where}: an earlier read is still stuck")
        reading = _in_daemon_thread(lambda: read_regular_file(self.path, self.max_bytes))
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
                self._cached = _admit(
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
        return _sorted_members(self._cached)


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
        return _sorted_members(_admit(members, self.description, self.allow_special, self._warned))

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


class CombinedSource(MembershipSource):
    """The union of several sources (e.g. static + file + DNS), de-duplicated by url.

    When two sources list the same url with different weights, the first source wins.
    """

    def __init__(self, sources: Sequence[MembershipSource]) -> None:
        if not sources:
            raise ValueError("combined source needs at least one source")
        self.sources = list(sources)
        self.interval_s = min(s.interval_s for s in self.sources)

    @property
    def description(self) -> str:
        return " + ".join(s.description for s in self.sources)

    async def resolve(self) -> list[Member]:
        results = await asyncio.gather(*(s.resolve() for s in self.sources), return_exceptions=True)
        pairs = list(zip(self.sources, results, strict=True))
        errors = [f"{s.description}: {r}" for s, r in pairs if _failed(r)]
        if errors:
            raise MembershipError("; ".join(errors))
        return _union([r for r in results if isinstance(r, list)])

    async def watch(self, on_update: UpdateCallback) -> None:
        await _poll_sources(self.sources, on_update)


def _failed(result: object) -> bool:
    if isinstance(result, BaseException) and not isinstance(result, Exception):
        raise result  # cancellation, KeyboardInterrupt: not ours to swallow
    return isinstance(result, Exception)


def _union(member_lists: Iterable[list[Member]]) -> list[Member]:
    by_url: dict[str, Member] = {}
    for members in member_lists:
        for member in members:
            by_url.setdefault(member.url, member)
    return _sorted_members(by_url.values())


@dataclass
class _SourceState:
    source: MembershipSource
    next_due: float = 0.0
    last_good: list[Member] = field(default_factory=list)
    error: str | None = None
    error_logged_at: float = -math.inf


ERROR_RELOG_S = 60.0  # a persisting error is repeated this often, not every poll


async def _poll_sources(sources: Sequence[MembershipSource], on_update: UpdateCallback) -> None:
    loop = asyncio.get_running_loop()
    states = [_SourceState(s) for s in sources]
    reported: list[Member] | None = None
    while True:
        started = loop.time()
        due = [st for st in states if st.next_due <= started]
        if due:
            results = await asyncio.gather(
                *(st.source.resolve() for st in due), return_exceptions=True
            )
            for st, result in zip(due, results, strict=True):
                st.next_due = started + st.source.interval_s
                _absorb(st, result, loop.time())
            merged = _union(st.last_good for st in states)
            if merged and merged != reported:
                try:
                    on_update(list(merged))
                    reported = merged
                except Exception:
                    logger.exception("membership update callback failed; will retry")
        next_due = min(st.next_due for st in states)
        if math.isinf(next_due):
            await loop.create_future()  # only static sources: nothing will ever change
        else:
            await asyncio.sleep(max(0.0, next_due - loop.time()))


def _absorb(st: _SourceState, result: list[Member] | BaseException, now: float) -> None:
    """Take one resolve result: keep it if good, else log why and keep the last good."""
    if _failed(result):
        error = str(result) if isinstance(result, MembershipError) else repr(result)
    elif not result:
        error = f"{st.source.description} returned no backends"
    else:
        assert isinstance(result, list)
        if st.error is not None:
            logger.info(
                "membership source %s recovered: %d backends", st.source.description, len(result)
            )
        st.error = None
        st.last_good = _sorted_members(result)
        return
    if error != st.error or now - st.error_logged_at >= ERROR_RELOG_S:
        kept = f"{len(st.last_good)} backends" if st.last_good else "none yet"
        logger.error(
            "membership source %s: %s; keeping the last good membership (%s)",
            st.source.description,
            error,
            kept,
        )
        st.error_logged_at = now
    st.error = error
