"""A request's scope: the LoRA adapter it names and its cache salt (routing contract 10).

vLLM hashes blocks by adapter (every block) and `cache_salt` (the first, which later blocks
chain from), so a prefix cached under one scope misses under any other. Route keys are
scoped to match: an empty scope leaves the key unchanged (contract sections 1-9 as
written); a scoped key is key(scope bytes || key), so every sidecar agrees on a scoped home
set and an adapter never shares a home with the base model by accident. Which pods hold an
adapter: routing/adapters.py. Complexity: one key() of at most ~1 KB per scoped request.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from prefix_sidecar import _core

# Caller-controlled, so bounded like any caller text that reaches a key (vLLM sets no
# limit; a tenant id or random token is tens of bytes).
MAX_SALT_BYTES = 1024


class Scope(NamedTuple):
    adapter: str = ""  # the LoRA adapter the request's model names; "" the base model
    salt: str = ""  # vLLM's cache_salt; "" none

    @property
    def empty(self) -> bool:
        return not self.adapter and not self.salt


NO_SCOPE = Scope()


def scope_bytes(scope: Scope) -> bytes:
    """be32(len(adapter)) || adapter || be32(len(salt)) || salt, each UTF-8 (contract 10)."""
    adapter, salt = scope.adapter.encode(), scope.salt.encode()
    return len(adapter).to_bytes(4, "big") + adapter + len(salt).to_bytes(4, "big") + salt


def scoped_key(key: int, scope: Scope) -> int:
    """The route key of `key` under `scope`: `key` itself when the scope is empty, else
    key(scope_bytes(scope) || be64(key))."""
    if scope.empty:
        return key
    return _core.route_key(scope_bytes(scope) + key.to_bytes(8, "big"))


def scoped_prefix_id(text_id: str, scope: Scope) -> str:
    """A prefix's id under `scope`, from its id (SHA-256 hex of its text, contract 2): that id
    when the scope is empty, else SHA-256 hex of scope_bytes(scope) || the id's ASCII, so one
    text has one entry per scope, found without hashing the text again."""
    if scope.empty:
        return text_id
    return hashlib.sha256(scope_bytes(scope) + text_id.encode("ascii")).hexdigest()


def checked_salt(salt: object, field: str = "cache_salt") -> str:
    """A caller's salt: a string of at most MAX_SALT_BYTES UTF-8 bytes (ValueError saying
    what to fix)."""
    if not isinstance(salt, str):
        raise ValueError(f"{field} must be a string")
    if len(salt.encode("utf-8", "surrogatepass")) > MAX_SALT_BYTES:
        raise ValueError(f"{field} is over {MAX_SALT_BYTES} bytes; send a shorter salt")
    return salt
