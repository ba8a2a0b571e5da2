"""The prefix store: callers register a fat prefix once, then send its id (or name) per request.

The id is SHA-256 of the UTF-8 text, so registration is idempotent and every sidecar derives
the same id and route key alone; a scoped prefix (LoRA adapter or cache salt, routing/scope.py)
is its own entry with its scope's id and key (routing contract 10).

A name points at its newest version; older ones stay resolvable by id until unregistered, so
requests in flight survive an update. Several names may share one entry, which lives while any
does; its display name is the oldest of them.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prefix_sidecar import _core
from prefix_sidecar.config import DEFAULTS
from prefix_sidecar.routing.scope import NO_SCOPE, Scope, scoped_key, scoped_prefix_id
from prefix_sidecar.upstream.body import escape

# Prompts are matched against registered prefixes by their first escaped bytes: prefixes at
# least this long are found by one dict lookup, shorter ones by a linear scan.
MATCH_HEAD_BYTES = 64


class PrefixError(ValueError):
    """A prefix that cannot be stored; the message says what to fix."""


class PrefixNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "prefix not found"


class PrefixLimitExceeded(PrefixError):
    """The store holds its configured maximum number of prefixes."""


@dataclass
class PrefixEntry:
    """One registered prefix. The text is kept once, JSON-escaped (`json_bytes`): that is
    what every request splices into its upstream body, and prefix matching works on it too
    (see `prefix_sidecar.upstream.body.escape`)."""

    id: str
    # Every name that points at this text, oldest first; replaced (never mutated) so a reader
    # on another thread sees a whole tuple.
    names: tuple[str, ...]
    json_bytes: bytes
    route_key: int
    replicas: int
    size: int  # UTF-8 bytes of the text
    chars: int
    # KV size in tokens by a pod's /tokenize (upstream/tokenize.py); 0 until measured:
    # placement then estimates from bytes.
    tokens: int = 0
    # The adapter and salt it was registered for; `text_id` and `text_key` are its text's
    # own id and key (the route key unscoped), equal to `id` and `route_key` when unscoped.
    scope: Scope = NO_SCOPE
    text_id: str = ""
    text_key: int = 0

    @property
    def name(self) -> str:
        """The display name: the oldest name still pointing at this text."""
        names = self.names
        return names[0] if names else ""

    @property
    def text(self) -> str:
        """The prefix text, decoded on demand (tools and tests; not the request path)."""
        return str(json.loads(b'"' + self.json_bytes + b'"'))


class PrefixStore:
    """Thread-safe map of id -> entry and name -> versions (oldest first).

    `max_prefixes` bounds both the entries (texts) and the names: a name is cheap to send, so
    a caller registering one text under endless names must not grow the store without bound.
    """

    def __init__(
        self,
        max_prefixes: int = DEFAULTS.max_prefixes,
        max_bytes: int = DEFAULTS.max_prefix_bytes,
    ) -> None:
        self._max_prefixes = max_prefixes
        self._max_bytes = max_bytes
        self._by_id: dict[str, PrefixEntry] = {}
        self._versions: dict[str, list[str]] = {}
        self._by_head: dict[bytes, list[PrefixEntry]] = {}
        self._short: list[PrefixEntry] = []
        self._max_chars = 0
        self._lock = threading.Lock()
        # Bumped whenever the set of entries or a replica count changes: placements that
        # depend on the whole registered set (routing/placement.py) recompute on it.
        self.generation = 0
        self._watchers: list[Callable[[], None]] = []

    def watch(self, watcher: Callable[[], None]) -> None:
        """Call `watcher` after every change that bumps `generation`, once the change is whole
        and the lock released (the home placement is rebuilt then, not by the next request)."""
        self._watchers.append(watcher)

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        with self._lock:
            before = self.generation
            yield
            changed = self.generation != before
        if changed:
            for watcher in self._watchers:
                watcher()

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[PrefixEntry]:
        return iter(list(self._by_id.values()))

    def register(
        self, name: str, text: str, replicas: int = 0, scope: Scope = NO_SCOPE
    ) -> tuple[PrefixEntry, bool]:
        """Store a prefix; returns (entry, created). Same text in the same scope again is a
        no-op."""
        if not name:
            raise PrefixError("prefix name is empty; give the prefix a stable name")
        if len(name) > 256:
            raise PrefixError(f"prefix name is {len(name)} characters; the maximum is 256")
        if not text:
            raise PrefixError(f"prefix {name!r} has empty text; send the fat prefix in 'text'")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PrefixError(
                f"prefix {name!r} is not valid UTF-8 (lone surrogate at character {exc.start})"
            ) from None
        if len(data) > self._max_bytes:
            raise PrefixError(
                f"prefix {name!r} is {len(data)} bytes; the maximum is {self._max_bytes} "
                "(config max_prefix_bytes)"
            )
        text_id = _core.prefix_id(text)
        entry_id = scoped_prefix_id(text_id, scope)
        with self._changing():
            if name not in self._versions and len(self._versions) >= self._max_prefixes:
                raise PrefixLimitExceeded(
                    f"the sidecar holds {len(self._versions)} prefix names, its maximum "
                    "(config max_prefixes); unregister unused names first"
                )
            existing = self._by_id.get(entry_id)
            versions = self._versions.setdefault(name, [])
            if existing is not None:
                if replicas and replicas != existing.replicas:
                    existing.replicas = replicas
                    self.generation += 1
                if entry_id in versions:
                    versions.remove(entry_id)
                versions.append(entry_id)
                if name not in existing.names:
                    existing.names = (*existing.names, name)
                return existing, False
            if len(self._by_id) >= self._max_prefixes:
                if not versions:
                    del self._versions[name]
                raise PrefixLimitExceeded(
                    f"the sidecar holds {len(self._by_id)} prefixes, its maximum "
                    "(config max_prefixes); unregister old versions first"
                )
            text_key = _core.route_key(data)
            entry = PrefixEntry(
                id=entry_id,
                names=(name,),
                json_bytes=escape(text),
                route_key=scoped_key(text_key, scope),
                replicas=replicas,
                size=len(data),
                chars=len(text),
                scope=scope,
                text_id=text_id,
                text_key=text_key,
            )
            self._by_id[entry_id] = entry
            versions.append(entry_id)
            if len(entry.json_bytes) >= MATCH_HEAD_BYTES:
                self._by_head.setdefault(entry.json_bytes[:MATCH_HEAD_BYTES], []).append(entry)
            else:
                self._short.append(entry)
            self._max_chars = max(self._max_chars, entry.chars)
            self.generation += 1
            return entry, True

    def set_tokens(self, prefix_id: str, tokens: int) -> bool:
        """Record the prefix's measured token count; a change is a registry change (the
        placement is rebuilt by the watchers). False when the prefix is gone or unchanged."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise PrefixError(f"a prefix's token count must be an int >= 1, got {tokens!r}")
        with self._changing():
            entry = self._by_id.get(prefix_id)
            if entry is None or entry.tokens == tokens:
                return False
            entry.tokens = tokens
            self.generation += 1
            return True

    def get(self, prefix_id: str) -> PrefixEntry:
        entry = self._by_id.get(prefix_id)
        if entry is None:
            raise PrefixNotFound(
                f"no prefix with id {prefix_id!r}; register it first (RegisterPrefix) "
                "or send prefix_text"
            )
        return entry

    def by_name(self, name: str, scope: Scope = NO_SCOPE) -> PrefixEntry:
        """The newest version of the name registered in `scope`, else its newest version."""
        versions = self._versions.get(name)
        if not versions:
            raise PrefixNotFound(f"no prefix named {name!r}; register it first (RegisterPrefix)")
        for prefix_id in reversed(versions):
            entry = self._by_id[prefix_id]
            if entry.scope == scope:
                return entry
        return self._by_id[versions[-1]]

    def in_scope(self, entry: PrefixEntry, scope: Scope) -> PrefixEntry | None:
        """The entry of `entry`'s text registered in `scope`, if any."""
        if entry.scope == scope:
            return entry
        return self._by_id.get(scoped_prefix_id(entry.text_id, scope))

    def versions(self, name: str) -> list[str]:
        return list(self._versions.get(name, ()))

    def has_name(self, name: str) -> bool:
        return name in self._versions

    def has_id(self, prefix_id: str) -> bool:
        return prefix_id in self._by_id

    def names_of(self, prefix_id: str) -> tuple[str, ...]:
        """The names pointing at a text, oldest first; () for an unknown id."""
        entry = self._by_id.get(prefix_id)
        return entry.names if entry is not None else ()

    def named(self) -> list[tuple[str, PrefixEntry]]:
        """Every (name, entry) pair: each name with each of its versions, oldest first. A
        text registered under two names appears once under each."""
        with self._lock:
            return [
                (name, self._by_id[prefix_id])
                for name, versions in self._versions.items()
                for prefix_id in versions
            ]

    def unregister_id(self, prefix_id: str) -> list[str]:
        with self._changing():
            entry = self._by_id.get(prefix_id)
            if entry is None:
                raise PrefixNotFound(f"no prefix with id {prefix_id!r} to unregister")
            self._remove(entry)
            return [prefix_id]

    def unregister_name(self, name: str) -> list[str]:
        with self._changing():
            ids = self._versions.get(name)
            if not ids:
                raise PrefixNotFound(f"no prefix named {name!r} to unregister")
            del self._versions[name]
            removed = []
            for prefix_id in ids:
                entry = self._by_id[prefix_id]
                entry.names = tuple(n for n in entry.names if n != name)
                # The same text may also be registered under another name: it stays for it.
                if entry.names:
                    continue
                self._remove(entry)
                removed.append(prefix_id)
            return removed

    def _remove(self, entry: PrefixEntry) -> None:
        del self._by_id[entry.id]
        self.generation += 1
        for name in entry.names:
            versions = self._versions.get(name)
            if versions is not None and entry.id in versions:
                versions.remove(entry.id)
                if not versions:
                    del self._versions[name]
        entry.names = ()
        head_key = entry.json_bytes[:MATCH_HEAD_BYTES]
        head = self._by_head.get(head_key)
        if head is not None and entry in head:
            head.remove(entry)
            if not head:
                del self._by_head[head_key]
        if entry in self._short:
            self._short.remove(entry)

    def match(self, prompt: str) -> PrefixEntry | None:
        """The longest registered prefix the prompt starts with, if any."""
        if not self._by_id:
            return None
        # Only the head that could hold a prefix is escaped: O(longest prefix), not O(prompt).
        return self.match_escaped(escape(prompt[: self._max_chars]))

    def match_escaped(self, escaped: bytes, start: int = 0) -> PrefixEntry | None:
        """`match` for a prompt already escaped: `escaped[start:]` is escape(prompt), or
        begins with it (the OpenAI front matches a caller's body where its prompt is, when
        the caller escaped it as `escape` does)."""
        if not self._by_id:
            return None
        matching = [
            candidate
            for candidate in self._candidates(escaped, start)
            if escaped.startswith(candidate.json_bytes, start)
        ]
        return max(matching, key=lambda entry: entry.size, default=None)  # ties: the first

    def escaped_reach(self, escaped: bytes, start: int = 0) -> int:
        """How many bytes from `start` match_escaped reads: the head it looks up, and the
        longest prefix it compares. Nothing past them can change its answer."""
        candidates = self._candidates(escaped, start)
        return max([MATCH_HEAD_BYTES, *(len(entry.json_bytes) for entry in candidates)])

    def _candidates(self, escaped: bytes, start: int) -> list[PrefixEntry]:
        """The prefixes `escaped[start:]` may begin with: those of its head, and the short."""
        return [*self._by_head.get(escaped[start : start + MATCH_HEAD_BYTES], ()), *self._short]
